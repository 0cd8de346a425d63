"""The artifact manifest: the one schema the runtime, the passes and the writer share.

The runtime owns it (it is the lowest layer), so an edge box that only has numpy can read an
artifact. Everything here is plain data: dataclasses that round-trip through JSON.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from ..errors import ArtifactError, quote
from .legacy import MODEL_FIELDS, model_part, upgrade_plan
from .schema import REJECT_UNKNOWN, build_dataclass, check_json_shape, check_value, json_type

SCHEMA_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)
"""Schema versions this runtime reads: versions 1 (plans with every source's options flat on the plan) and 2
(plans with the model part in first-class fields, its kind optional) are converted on load
(``runtime/artifact/legacy.py``); artifacts are written as ``SCHEMA_VERSION``."""
MANIFEST_NAME = "manifest.json"
TOKENIZER_FILE = "tokenizer/tokenizer.json"  # opened by the runtime for every artifact
DTYPES = ("float32", "float16", "bfloat16")
FILE_KEYS = ("file", "weights", "datastore")
"""Keys of a ``backends[...]`` record or of a plan (at any depth) whose string value names a file the
runtime opens, as do keys ending in ``_file``. Each such file must be listed (and so hashed) in ``files``."""
_SHA256 = re.compile(r"[0-9a-f]{64}")
CONFIG_CHOICES = {
    "qk_norm_over": ("head", "proj"),
    "norm": ("rms", "layer"),
    "mlp": ("gated", "plain"),
    "activation": ("silu", "gelu", "gelu_tanh", "relu"),
    "positions": ("rotary", "learned"),
}
"""The string options of ``ArchConfig`` the decoder implements (``runtime/backends/torch/decoder.py``)."""
MAX_SIZE = 1 << 24
"""Largest size a config may name (vocabulary, widths, layers, context): past it the manifest is damaged."""


@dataclass
class ArchConfig:
    """Geometry and numerics of the canonical decoder; one set of options covers every family.

    Families differ only in these switches (gpt-fast style: one decoder, many configs), never in code
    paths copied per family.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    norm: str = "rms"  # "rms" | "layer"
    norm_eps: float = 1e-6
    mlp: str = "gated"  # "gated" (act(gate) * up) | "plain" (act(up))
    activation: str = "silu"  # "silu" | "gelu" | "gelu_tanh" | "relu"
    parallel_residual: bool = False  # GPT-NeoX: x + attn(ln1(x)) + mlp(ln2(x))
    positions: str = "rotary"  # "rotary" | "learned"
    rotary_dim: int = 0  # rotary applied to the first rotary_dim dims of each head (partial rotary)
    rope_attention_scaling: float = 1.0  # cos/sin multiplier (YaRN-style scalings); 1.0 otherwise
    position_offset: int = 0  # learned positions are looked up at pos + offset (OPT: 2)
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before rotary
    embed_scale: float | None = None  # Gemma: embeddings multiplied by sqrt(hidden_size)
    attn_qkv_bias: bool = False
    attn_out_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    max_position_embeddings: int = 2048
    attn_scale: float | None = None  # None: head_dim ** -0.5
    pre_norm: bool = True  # a norm before each sublayer (OLMo 2 has none: its norms follow the sublayers)
    post_norm: bool = False  # a norm on each sublayer's output before the residual add (OLMo 2; Gemma 3's sandwich)
    qk_norm_over: str = "head"  # q/k norm over each head ("head": Qwen3) or the whole projection ("proj": OLMo 2)
    nope_layers: list[int] = field(default_factory=list)  # blocks without rotary (SmolLM3's NoPE layers)
    lm_head_bias: bool = False  # Phi-2
    logit_scale: float | None = None  # logits multiplied by this (Cohere)
    window_layers: list[int] | None = None  # blocks with the sliding window (None: every block, when there is one)
    local_rope: bool = False  # windowed blocks rotate with their own table, rope_local_inv_freq (Gemma 3)
    final_softcap: float | None = None  # logits = cap * tanh(logits / cap) (Gemma 2/3)
    num_experts: int = 0  # > 0: the MLP is a mixture of that many gated experts (Mixtral)
    experts_per_token: int = 0  # experts each token is routed to (softmax, top-k, renormalised)
    decoder: str = (
        "canonical"  # "canonical": runtime/backends/torch/decoder.py | "generic": the model's own modules (torch only)
    )

    def window_of(self, i: int) -> int | None:
        """Block ``i``'s sliding window (None: it attends to every earlier position)."""
        if self.sliding_window is None or (self.window_layers is not None and i not in self.window_layers):
            return None
        return self.sliding_window

    def rotary_of(self, i: int) -> str | None:
        """Which rotary table block ``i`` uses: "global", "local" (a windowed block of a model with two
        tables, Gemma 3) or None (learned positions, or a NoPE block)."""
        if self.positions != "rotary" or i in self.nope_layers:
            return None
        return "local" if self.local_rope and self.window_of(i) is not None else "global"

    @property
    def scale(self) -> float:
        return self.attn_scale if self.attn_scale is not None else self.head_dim**-0.5

    def validate(self) -> None:
        """The rules the field types cannot say: names from known sets, sizes that fit together. (Whether
        they fit the weights is ``runtime/backends/weights_check.py``'s, when the artifact is opened.)"""
        sizes = (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
            "max_position_embeddings",
        )
        if self.decoder not in ("canonical", "generic"):
            raise ArtifactError(
                f"manifest config.decoder is {quote(self.decoder)}, not 'canonical' or 'generic'; this "
                "artifact needs a newer speccompile, or rebuild it"
            )
        for name, allowed in CONFIG_CHOICES.items():
            if getattr(self, name) not in allowed:
                raise ArtifactError(
                    f"manifest config.{name} is {quote(getattr(self, name))}, not one of "
                    f"{', '.join(map(repr, allowed))}; rebuild the artifact"
                )
        bad = [name for name in sizes if getattr(self, name) < 1]
        if bad:
            raise ArtifactError(
                f"manifest config has non-positive sizes {bad}; the manifest is damaged: rebuild the artifact"
            )
        big = [name for name in sizes if getattr(self, name) > MAX_SIZE]
        if big:
            raise ArtifactError(
                f"manifest config has sizes over {MAX_SIZE} {big}; the manifest is damaged: rebuild the artifact"
            )
        for name, layers in (("nope_layers", self.nope_layers), ("window_layers", self.window_layers or [])):
            if any(not 0 <= i < self.num_layers for i in layers):
                raise ArtifactError(
                    f"manifest config.{name} names blocks outside 0..{self.num_layers - 1}; rebuild the artifact"
                )
        if self.num_heads % self.num_kv_heads:
            raise ArtifactError(
                f"manifest config.num_heads ({self.num_heads}) is not a multiple of num_kv_heads "
                f"({self.num_kv_heads}); the manifest is damaged: rebuild the artifact"
            )
        if (
            self.decoder == "canonical"
            and self.positions == "rotary"
            and (self.rotary_dim < 2 or self.rotary_dim % 2 or self.rotary_dim > self.head_dim)
        ):
            raise ArtifactError(
                f"manifest config.rotary_dim ({self.rotary_dim}) must be even and in 2..head_dim "
                f"({self.head_dim}); the manifest is damaged: rebuild the artifact"
            )
        if self.num_experts < 0 or (self.num_experts and not 1 <= self.experts_per_token <= self.num_experts):
            raise ArtifactError(
                f"manifest config routes {self.experts_per_token} of {self.num_experts} experts per "
                "token; the manifest is damaged: rebuild the artifact"
            )
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ArtifactError(
                f"manifest config.sliding_window must be >= 1 or null, got {self.sliding_window}; rebuild the artifact"
            )
        if self.position_offset < 0 or self.norm_eps < 0:
            raise ArtifactError(
                "manifest config.position_offset and norm_eps must not be negative; rebuild the artifact"
            )
        if any(value is not None and value <= 0 for value in (self.final_softcap, self.attn_scale)):
            raise ArtifactError(
                "manifest config.final_softcap and attn_scale must be positive or null; rebuild the artifact"
            )

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "config") -> "ArchConfig":
        return build_dataclass(cls, data, where)


# A config field this runtime does not know changes the model's numerics: refuse it rather than guess.
setattr(ArchConfig, REJECT_UNKNOWN, True)


MODEL_PARAMS: dict[str, Any] = {
    "skip_attn": list[int],
    "skip_mlp": list[int],
    "exit_layer": int | None,
    "head": str,
    "draft_vocab": int | None,
    "draft_head_file": str | None,
}
"""The model options several draft kinds share, kept in a plan's ``params``: name -> JSON type. Which of them a
kind reads is the kind's (``runtime/drafting/kinds/``); their types are checked here, when a manifest is read, so
that no kind meets a damaged value. The value each means when absent is ``legacy.MODEL_FIELDS``'s, the same in
every schema version, which is what lets the conversion leave out a field at that value."""


@dataclass
class DraftPlan:
    """A draft plan as data (docs/design.md section 2): which sources draft, and how.

    The model part is a draft kind (``runtime/drafting/kinds/``) named in ``kind``, with the kind's options in
    ``params``: ``early_exit`` runs blocks 0..exit_layer-1 and a head, and the verifier then runs only blocks
    exit_layer..L-1 on the draft's own hidden states and KV, which are exactly the full model's; ``layer_skip``
    runs every block but drops the listed sublayers; ``precision`` runs them with quantized weights; ``lookup``
    has no model part. The options several kinds share (``MODEL_PARAMS``: ``exit_layer``, ``skip_attn``, the
    draft head's ``head``, ``draft_vocab``, ``draft_head_file``) read as properties, with their values when absent.
    ``DraftPlan.of`` builds a plan from those options as fields, naming its kind the way older manifests' plans
    are converted (``runtime/artifact/legacy.py``).

    The model-free part: ``lookup`` lists sources tried in order each round (``ngram``, ``retrieval``,
    ``lookahead``, ``logitspec``, ``recycling``: ``runtime/drafting/``), each drafting at most
    ``lookup_max_draft`` tokens, as token trees when ``lookup_branches`` > 1. With both parts, a lookup hit
    drafts the round and the model drafts otherwise, extended by a lookup continuation when ``extend``.

    ``sources`` holds each source's options under its name (``"model"`` for the model part), as plain JSON:
    the source's options dataclass reads and checks them (``runtime/drafting/__init__.py``, ``options``), so
    a new source adds no field here.
    """

    name: str
    kind: str
    params: dict[str, Any] = field(default_factory=dict)
    lookup: list[str] = field(default_factory=list)
    lookup_max_draft: int = 8
    lookup_branches: int = 1
    tree_nodes: int = 0  # a lookup tree's node budget (0: lookup_max_draft)
    extend: bool = True  # a lookup continuation may extend the model's draft
    sources: dict[str, dict[str, Any]] = field(default_factory=dict)
    measured: dict[str, Any] = field(
        default_factory=dict
    )  # the tuner's figures: schema in runtime/artifact/measured.py

    @classmethod
    def of(cls, name: str, kind: str | None = None, **fields: Any) -> "DraftPlan":
        """A plan built in code: ``fields`` are the plan's fields and any of ``MODEL_PARAMS``, which go into
        ``params``; without ``kind``, the kind is inferred from them as an old manifest's plan is (early exit, layer
        skip, else lookup only: ``legacy.model_part``), so code and converted manifests name kinds alike."""
        return cls(**model_part({"name": name, "kind": kind, **fields}))

    def param(self, key: str) -> Any:
        """``params[key]``, or the value it means when absent (``MODEL_FIELDS``; a fresh list for a list, so that no
        caller can change the shared default)."""
        if key in self.params:
            return self.params[key]
        absent = MODEL_FIELDS[key]
        return list(absent) if isinstance(absent, list) else absent

    def with_params(self, **changes: Any) -> "DraftPlan":
        """A copy whose ``params`` has ``changes`` merged in; a change to None removes the option (its value
        when absent)."""
        params = {**self.params, **changes}
        return dataclasses.replace(self, params={key: value for key, value in params.items() if value is not None})

    @property
    def skip_attn(self) -> list[int]:
        return self.param("skip_attn")

    @property
    def skip_mlp(self) -> list[int]:
        return self.param("skip_mlp")

    @property
    def exit_layer(self) -> int | None:
        return self.param("exit_layer")

    @property
    def head(self) -> str:
        """The draft head: ``"final"`` (the model's own), ``"exit:E"``, or ``"adapter:E"`` (a trained exit adapter)."""
        return self.param("head")

    @property
    def draft_vocab(self) -> int | None:
        """The size of a reduced draft vocabulary (None: the full one)."""
        return self.param("draft_vocab")

    @property
    def draft_head_file(self) -> str | None:
        """The draft head (``runtime/artifact/draft_head_file.py``): a trained exit adapter and/or the ids of a
        reduced draft vocabulary, in one safetensors file in the artifact."""
        return self.param("draft_head_file")

    @property
    def is_early_exit(self) -> bool:
        return self.exit_layer is not None

    @property
    def max_tree_nodes(self) -> int:
        """Most tokens one lookup round drafts: a tree's node budget, else the chain's length."""
        return max(self.lookup_max_draft, self.tree_nodes) if self.lookup_branches > 1 else self.lookup_max_draft

    def with_options(self, **changes: dict[str, Any]) -> "DraftPlan":
        """A copy whose ``sources[name]`` has ``changes[name]`` merged in (``plan.with_options(ngram={"min": 3})``)."""
        sources = {name: dict(values) for name, values in self.sources.items()}
        for name, values in changes.items():
            sources.setdefault(name, {}).update(values)
        return dataclasses.replace(self, sources=sources)

    def option(self, source: str, key: str, default: Any = None) -> Any:
        """The option as written in ``sources`` (``default`` when absent); ``runtime.drafting.options`` reads a
        source's options with its own defaults and checks."""
        return self.sources.get(source, {}).get(key, default)

    def set_option(self, source: str, key: str, value: Any) -> None:
        """Set one option on this plan (the tuner's last touches on a plan it made). The ``sources`` mapping is
        replaced, not mutated: plans copied with ``dataclasses.replace`` share it, and must not change together."""
        self.sources = {**self.sources, source: {**self.sources.get(source, {}), key: value}}

    def validate(self, num_layers: int) -> None:
        """The data rules of a plan; what its kind and sources require is checked by
        ``runtime.drafting.check_plan``."""
        for name, layers in (("skip_attn", self.skip_attn), ("skip_mlp", self.skip_mlp)):
            bad = [i for i in layers if not 0 <= i < num_layers]
            if bad:
                raise ArtifactError(f"plan '{self.name}': {name} has layers {bad} outside 0..{num_layers - 1}")
        if self.exit_layer is not None:
            if not 1 <= self.exit_layer < num_layers:
                raise ArtifactError(f"plan '{self.name}': exit_layer {self.exit_layer} must be in 1..{num_layers - 1}")
            if self.skip_attn or self.skip_mlp:
                raise ArtifactError(
                    f"plan '{self.name}': an early-exit plan cannot also skip sublayers (the verifier "
                    "reuses the draft's prefix, which must be the full model's)"
                )
        if self.lookup_max_draft < 1:
            raise ArtifactError(f"plan '{self.name}': lookup_max_draft must be >= 1, got {self.lookup_max_draft}")
        if self.lookup_branches < 1 or self.tree_nodes < 0:
            raise ArtifactError(
                f"plan '{self.name}': lookup_branches must be >= 1 and tree_nodes >= 0, got "
                f"{self.lookup_branches} and {self.tree_nodes}"
            )
        if self.lookup_branches > 1 and not self.lookup:
            raise ArtifactError(
                f"plan '{self.name}': token trees (lookup_branches > 1) are drafted by lookup sources; "
                "give the plan lookup sources, or set lookup_branches to 1"
            )
        if (self.head.startswith("adapter:") or self.draft_vocab is not None) and not self.draft_head_file:
            raise ArtifactError(
                f"plan '{self.name}' drafts with an adapter or a reduced vocabulary but names no "
                "draft_head_file; rebuild the artifact"
            )
        if self.head.startswith("adapter:") and self.head != f"adapter:{self.exit_layer}":
            raise ArtifactError(
                f"plan '{self.name}': head {self.head!r} does not match exit_layer {self.exit_layer}; "
                "rebuild the artifact"
            )
        if self.draft_vocab is not None and self.draft_vocab < 1:
            raise ArtifactError(f"plan '{self.name}': draft_vocab must be >= 1, got {self.draft_vocab}")

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "plan") -> "DraftPlan":
        """Unknown fields are ignored (a plan written by a newer toolkit still loads); known ones are
        checked against their annotations, the shared model options against ``MODEL_PARAMS``, and ``measured``
        against its schema (``runtime/artifact/measured.py``). A plan in an older schema's form is converted
        first (``runtime/artifact/legacy.py``)."""
        from .measured import check_measured

        plan = build_dataclass(cls, upgrade_plan(data) if isinstance(data, dict) else data, where)
        for key, value in plan.params.items():
            if key in MODEL_PARAMS:
                check_value(value, MODEL_PARAMS[key], f"{where}.params[{key!r}]")
        check_measured(plan.measured, where)
        return plan


@dataclass
class Manifest:
    """manifest.json: what the artifact is, how it was tuned, and the sha256 of every file in it."""

    config: ArchConfig
    plans: dict[str, DraftPlan]
    default_plan: str | None
    files: dict[str, dict[str, Any]]
    backends: dict[str, dict[str, Any]]
    dtype: str = "float32"
    source: dict[str, Any] = field(default_factory=dict)
    tokens: dict[str, Any] = field(default_factory=dict)  # eos_token_ids, bos_token_id, pad_token_id
    tuning: dict[str, Any] = field(default_factory=dict)
    toolkit_version: str = ""
    schema_version: int = SCHEMA_VERSION

    @property
    def eos_ids(self) -> frozenset[int]:
        """The tokens that end generation (``tokens.eos_token_ids``)."""
        return frozenset(self.tokens.get("eos_token_ids") or ())

    def plan(self, name: str | None = None) -> DraftPlan:
        name = name or self.default_plan
        if name is None or name not in self.plans:
            raise ArtifactError(f"artifact has no draft plan named {name!r}; available: {sorted(self.plans) or 'none'}")
        return self.plans[name]

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": self.schema_version,
            "toolkit_version": self.toolkit_version,
            "source": self.source,
            "dtype": self.dtype,
            "config": dataclasses.asdict(self.config),
            "tokens": self.tokens,
            "plans": {name: dataclasses.asdict(plan) for name, plan in self.plans.items()},
            "default_plan": self.default_plan,
            "tuning": self.tuning,
            "backends": self.backends,
            "files": self.files,
        }

    @classmethod
    def from_dict(cls, data: Any) -> "Manifest":
        """Check ``data`` against the dataclasses' annotated types and the artifact's rules (paths
        confined to the artifact, every file the runtime opens listed with a sha256); every problem is
        an ``ArtifactError``. Unknown top-level and plan fields are ignored (forward compatibility)."""
        if not isinstance(data, dict):
            raise ArtifactError(f"manifest.json must hold a JSON object, got {json_type(data)}; rebuild the artifact")
        check_json_shape(data, "manifest")
        version = data.get("schema_version")
        if type(version) is not int or version not in READABLE_VERSIONS:
            raise ArtifactError(
                f"artifact schema version {quote(version)} is not supported by this runtime (it reads versions "
                f"{', '.join(map(str, READABLE_VERSIONS))}); rebuild the artifact with `speccompile build` or install "
                "the matching runtime"
            )
        data = {**data, "schema_version": SCHEMA_VERSION}  # plans in older schemas' forms convert one by one
        plans = data.get("plans", {})
        if isinstance(plans, dict):  # plans are built one by one so that messages name the plan
            data = {**data, "plans": {name: DraftPlan.from_dict(p, f"plans[{name!r}]") for name, p in plans.items()}}
        manifest = build_dataclass(cls, {**data, "config": ArchConfig.from_dict(data.get("config"))}, "manifest")
        manifest.validate()
        return manifest

    def validate(self) -> None:
        """The rules the field types cannot say."""
        self.config.validate()
        for plan in self.plans.values():
            plan.validate(self.config.num_layers)
        if self.default_plan is not None and self.default_plan not in self.plans:
            raise ArtifactError(
                f"manifest default_plan {quote(self.default_plan)} is not one of its plans "
                f"{quote(sorted(self.plans), 200)}; rebuild the artifact"
            )
        if isinstance(self.tuning, dict) and "call_costs" in self.tuning:
            from .measured import check_call_costs

            check_call_costs(self.tuning["call_costs"])
        if self.dtype not in DTYPES:
            raise ArtifactError(
                f"manifest dtype {quote(self.dtype)} is not one of {', '.join(DTYPES)}; rebuild the artifact"
            )
        for relative, record in self.files.items():
            check_relative_path(relative, "files")
            digest, size = record.get("sha256"), record.get("bytes")
            if not isinstance(digest, str) or not _SHA256.fullmatch(digest):
                raise ArtifactError(
                    f"manifest entry for file {quote(relative)} has no valid sha256; rebuild the artifact"
                )
            if type(size) is not int or size < 0:
                raise ArtifactError(
                    f"manifest entry for file {quote(relative)} has no valid byte size; rebuild the artifact"
                )
        if not self.backends:
            raise ArtifactError("manifest lists no backends; rebuild the artifact with --backend torch or onnx")
        check_backend_records(self.backends)
        check_tokens(self.tokens)
        for relative in self.opened_files():
            check_relative_path(relative, "a backend record or plan")
            if relative not in self.files:
                raise ArtifactError(
                    f"artifact file {quote(relative)} is used by the runtime but not listed with a sha256 in the manifest; "
                    "rebuild the artifact"
                )

    def opened_files(self) -> list[str]:
        """Every file the runtime opens: the tokenizer and each file a backend record or plan names (FILE_KEYS)."""
        found = [TOKENIZER_FILE]
        for name, record in self.backends.items():
            found += _file_values(record, f"backends[{name!r}]")
        for name, plan in self.plans.items():
            found += _file_values(dataclasses.asdict(plan), f"plans[{name!r}]")
        return found


@dataclass
class _TensorSlice:
    """An entry of ``backends['onnx'].tensors``: where a weight lies in the shared weights file."""

    offset: int
    nbytes: int
    dtype: str
    shape: list[int]


@dataclass
class _GraphRecord:
    """An entry of ``backends['onnx'].graphs``."""

    file: str
    inputs: list[dict[str, Any]] = field(default_factory=list)
    outputs: list[dict[str, Any]] = field(default_factory=list)
    initializers: list[str] = field(default_factory=list)


BACKEND_RECORDS: dict[str, dict[str, Any]] = {
    "torch": {"weights": str},
    "onnx": {"weights": str, "graphs": dict[str, _GraphRecord], "tensors": dict[str, _TensorSlice]},
}
"""Required fields of the backends this runtime opens, checked like the dataclasses' annotations (other
fields of a record, and records of unknown backends, are left alone)."""


def check_backend_records(backends: dict[str, dict[str, Any]]) -> None:
    for name, required in BACKEND_RECORDS.items():
        if name not in backends:
            continue
        record = backends[name]
        for key, annotation in required.items():
            if key not in record:
                raise ArtifactError(
                    f"manifest backends[{name!r}] lacks {key!r}; rebuild the artifact with --backend {name}"
                )
            check_value(record[key], annotation, f"backends[{name!r}].{key}")
    for key, graph in backends.get("onnx", {}).get("graphs", {}).items():
        for side, needs in (("inputs", ("name", "shape")), ("outputs", ("name",))):
            for item in graph.get(side, []):
                if not isinstance(item.get("name"), str) or (
                    "shape" in needs and not isinstance(item.get("shape"), list)
                ):
                    raise ArtifactError(
                        f"manifest backends['onnx'].graphs[{quote(key)}].{side} has an entry without "
                        f"{' or '.join(needs)}; rebuild the artifact with --backend onnx"
                    )
    for tensor, t in backends.get("onnx", {}).get("tensors", {}).items():
        if t["offset"] < 0 or t["nbytes"] < 0 or any(type(d) is not int or d < 0 for d in t["shape"]):
            raise ArtifactError(
                f"manifest backends['onnx'].tensors[{tensor!r}] has a negative offset, size or "
                "dimension; rebuild the artifact with --backend onnx"
            )


def _file_values(value: Any, where: str) -> list[str]:
    """String values under FILE_KEYS / ``*_file`` keys anywhere in a backend record or plan."""
    found: list[str] = []
    if isinstance(value, dict):
        for key, item in value.items():
            if isinstance(key, str) and (key in FILE_KEYS or key.endswith("_file")):
                if item is None:  # an optional file that is absent
                    continue
                if not isinstance(item, str):
                    if isinstance(item, dict):  # a table keyed by tensor or graph names, not a file name
                        found += _file_values(item, f"{where}[{key!r}]")
                        continue
                    raise ArtifactError(
                        f"manifest field {where}[{key!r}] must name a file, got {json_type(item)}; rebuild the artifact"
                    )
                found.append(item)
            else:
                found += _file_values(item, f"{where}[{key!r}]")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found += _file_values(item, f"{where}[{i}]")
    return found


def check_tokens(tokens: dict[str, Any]) -> None:
    eos = tokens.get("eos_token_ids", [])
    if not isinstance(eos, list) or any(type(t) is not int for t in eos):
        raise ArtifactError("manifest tokens.eos_token_ids must be a list of integers; rebuild the artifact")
    for key in ("bos_token_id", "pad_token_id"):
        if tokens.get(key) is not None and type(tokens[key]) is not int:
            raise ArtifactError(f"manifest tokens.{key} must be an integer or null; rebuild the artifact")


def check_relative_path(relative: str, where: str) -> None:
    """A manifest path must be relative, normalised and POSIX (``weights/model.safetensors``): no
    ``..``, no ``.``, no empty parts, no backslashes, no NUL; so it cannot name anything outside."""
    path = PurePosixPath(relative)
    bad = (
        not relative
        or "\\" in relative
        or "\0" in relative
        or path.is_absolute()
        or str(path) != relative
        or any(part in ("..", ".") for part in path.parts)
    )
    if bad:
        raise ArtifactError(
            f"manifest path {quote(relative)} (in {where}) is not a plain relative path inside the artifact; the manifest "
            "was edited or damaged: rebuild the artifact"
        )


def confined_path(root: Path, relative: str) -> Path:
    """``root / relative`` after resolving symlinks, refused if that lands outside ``root``."""
    base = root.resolve()
    real = (root / relative).resolve()
    if real != base and base not in real.parents:
        raise ArtifactError(
            f"artifact file {quote(relative)} resolves to {quote(str(real), 200)}, outside the artifact "
            f"{quote(str(base), 200)} (a symlink?); "
            "the runtime only reads files inside the artifact: replace the link with the file or rebuild"
        )
    return real


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def file_record(root: Path, relative: str) -> dict[str, Any]:
    path = root / relative
    return {"sha256": sha256_file(path), "bytes": path.stat().st_size}


def write_manifest(root: Path, manifest: Manifest) -> None:
    (root / MANIFEST_NAME).write_text(json.dumps(manifest.to_dict(), indent=2, sort_keys=False) + "\n")


def read_manifest(root: Path, verify_files: bool = True) -> Manifest:
    """Read and check an artifact's manifest: refuse unknown schemas, malformed fields, paths that leave
    the artifact (``..``, absolute, or through a symlink), files the runtime opens but the manifest does
    not list, and (with ``verify_files``) missing files and wrong sizes or sha256s."""
    root = Path(root)
    if not root.is_dir():
        raise ArtifactError(f"artifact folder {str(root)!r} does not exist; build one with `speccompile build`")
    path = root / MANIFEST_NAME
    if not path.is_file():
        raise ArtifactError(f"{str(root)!r} has no {MANIFEST_NAME}; it is not a speccompile artifact")
    confined_path(root, MANIFEST_NAME)
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except OSError as exc:
        raise ArtifactError(f"cannot read {path} ({exc.strerror}); check its permissions") from None
    except UnicodeDecodeError:
        raise ArtifactError(f"{path} is not UTF-8 text; the manifest is damaged: rebuild the artifact") from None
    except json.JSONDecodeError as exc:
        raise ArtifactError(
            f"{path} is not valid JSON ({exc.msg} at line {exc.lineno}); rebuild the artifact"
        ) from None
    except (
        ValueError
    ) as exc:  # an integer of more digits than Python converts (sys.int_info.str_digits_check_threshold)
        raise ArtifactError(f"{path} holds a number Python will not read ({exc}); rebuild the artifact") from None
    except RecursionError:
        raise ArtifactError(f"{path} is nested too deeply to be a manifest; rebuild the artifact") from None
    manifest = Manifest.from_dict(data)
    for relative, record in manifest.files.items():
        file_path = confined_path(root, relative)
        if not verify_files:
            continue
        if not file_path.is_file():
            raise ArtifactError(
                f"artifact file {quote(relative)} is missing from {quote(str(root), 200)}; rebuild the artifact or restore the file"
            )
        if file_path.stat().st_size != record["bytes"] or sha256_file(file_path) != record["sha256"]:
            raise ArtifactError(
                f"artifact file {quote(relative)} does not match its sha256 in the manifest (corrupted or edited); "
                "rebuild the artifact"
            )
    return manifest


def unlisted_files(root: Path, manifest: Manifest) -> list[str]:
    """Files in the artifact folder that the manifest does not list: not verified, never opened by the
    runtime (``inspect`` reports them)."""
    root = Path(root)
    present = (p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() or p.is_symlink())
    return sorted(name for name in present if name != MANIFEST_NAME and name not in manifest.files)
