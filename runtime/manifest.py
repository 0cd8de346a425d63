"""The artifact manifest: the one schema the runtime, the passes and the writer share.

The runtime owns it (it is the lowest layer), so an edge box that only has numpy can read an
artifact. Everything here is plain data: dataclasses that round-trip through JSON.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import ArtifactError

SCHEMA_VERSION = 1
MANIFEST_NAME = "manifest.json"


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

    @property
    def scale(self) -> float:
        return self.attn_scale if self.attn_scale is not None else self.head_dim**-0.5

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ArchConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ArtifactError(
                f"manifest config has unknown fields {sorted(unknown)}; rebuild the artifact with this "
                "version of speccompile"
            )
        return cls(**data)


@dataclass
class DraftPlan:
    """A draft subgraph as data (DESIGN.md section 2).

    Layer-skip plans run every block but drop the listed sublayers. Early-exit plans run blocks
    0..exit_layer-1 and the shared head; the verifier then runs only blocks exit_layer..L-1 on the
    draft's own hidden states and KV, which are exactly the full model's.
    """

    name: str
    skip_attn: list[int] = field(default_factory=list)
    skip_mlp: list[int] = field(default_factory=list)
    exit_layer: int | None = None
    head: str = "final"
    draft_vocab: int | None = None
    max_draft: int = 6
    threshold: float = 0.0
    adaptive: bool = True
    target_acceptance: float = 0.6  # the adaptive threshold steers the acceptance rate toward this
    measured: dict[str, Any] = field(default_factory=dict)

    @property
    def is_early_exit(self) -> bool:
        return self.exit_layer is not None

    def validate(self, num_layers: int) -> None:
        for name, layers in (("skip_attn", self.skip_attn), ("skip_mlp", self.skip_mlp)):
            bad = [i for i in layers if not 0 <= i < num_layers]
            if bad:
                raise ArtifactError(f"plan '{self.name}': {name} has layers {bad} outside 0..{num_layers - 1}")
        if self.exit_layer is not None:
            if not 1 <= self.exit_layer < num_layers:
                raise ArtifactError(
                    f"plan '{self.name}': exit_layer {self.exit_layer} must be in 1..{num_layers - 1}"
                )
            if self.skip_attn or self.skip_mlp:
                raise ArtifactError(
                    f"plan '{self.name}': an early-exit plan cannot also skip sublayers (the verifier "
                    "reuses the draft's prefix, which must be the full model's)"
                )
        if self.max_draft < 1:
            raise ArtifactError(f"plan '{self.name}': max_draft must be >= 1, got {self.max_draft}")
        if not 0.0 <= self.threshold < 1.0:
            raise ArtifactError(f"plan '{self.name}': threshold must be in [0, 1), got {self.threshold}")

    def describe(self) -> str:
        if self.is_early_exit:
            return f"early exit after block {self.exit_layer}"
        return f"skip {len(self.skip_attn)} attention + {len(self.skip_mlp)} MLP sublayers"

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "DraftPlan":
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


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

    def plan(self, name: str | None = None) -> DraftPlan:
        name = name or self.default_plan
        if name is None or name not in self.plans:
            raise ArtifactError(
                f"artifact has no draft plan named {name!r}; available: {sorted(self.plans) or 'none'}"
            )
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
    def from_dict(cls, data: dict[str, Any]) -> "Manifest":
        version = data.get("schema_version")
        if version != SCHEMA_VERSION:
            raise ArtifactError(
                f"artifact schema version {version!r} is not supported by this runtime (it reads version "
                f"{SCHEMA_VERSION}); rebuild the artifact with `speccompile build` or install the matching runtime"
            )
        try:
            config = ArchConfig.from_dict(data["config"])
            plans = {name: DraftPlan.from_dict(p) for name, p in data.get("plans", {}).items()}
            manifest = cls(
                config=config,
                plans=plans,
                default_plan=data.get("default_plan"),
                files=data["files"],
                backends=data["backends"],
                dtype=data.get("dtype", "float32"),
                source=data.get("source", {}),
                tokens=data.get("tokens", {}),
                tuning=data.get("tuning", {}),
                toolkit_version=data.get("toolkit_version", ""),
                schema_version=version,
            )
        except (KeyError, TypeError) as exc:
            raise ArtifactError(f"manifest.json is malformed ({exc}); rebuild the artifact") from None
        for plan in plans.values():
            plan.validate(config.num_layers)
        return manifest


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
    """Read and check an artifact's manifest; refuse unknown schemas, missing files and bad hashes."""
    root = Path(root)
    if not root.is_dir():
        raise ArtifactError(f"artifact folder {str(root)!r} does not exist; build one with `speccompile build`")
    path = root / MANIFEST_NAME
    if not path.is_file():
        raise ArtifactError(f"{str(root)!r} has no {MANIFEST_NAME}; it is not a speccompile artifact")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ArtifactError(f"{path} is not valid JSON ({exc.msg} at line {exc.lineno}); rebuild the artifact") from None
    manifest = Manifest.from_dict(data)
    if verify_files:
        for relative, record in manifest.files.items():
            file_path = root / relative
            if not file_path.is_file():
                raise ArtifactError(
                    f"artifact file {relative!r} is missing from {str(root)!r}; rebuild the artifact or restore the file"
                )
            if file_path.stat().st_size != record.get("bytes", file_path.stat().st_size) or sha256_file(
                file_path
            ) != record["sha256"]:
                raise ArtifactError(
                    f"artifact file {relative!r} does not match its sha256 in the manifest (corrupted or edited); "
                    "rebuild the artifact"
                )
    return manifest
