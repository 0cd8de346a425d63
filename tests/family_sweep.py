"""Family sweep: every model type of transformers' causal-LM mapping, built tiny, classified, and checked.

For each ``model_type`` in ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``: a tiny random config (no remote code) is
built under the config class's own parameter names (its ``attribute_map`` and ``__init__`` signature, not
a table per family), the model is instantiated from it (seeded), and ``speccompile.convert.choose_path``
classifies it:

- ``canonical``: converted to runtime/backends/torch/decoder.py; ``generic``: its own modules through
  runtime/backends/torch/hf_decoder.py; ``refused``: speccompile's own ``UnsupportedModelError``, with its reason;
- ``config failed``: the tiny config or the model could not be made (transformers' error, not a refusal
  by speccompile); ``skipped``: a multimodal composite config (its text model has its own entry).

For each model that builds: logits parity of our decoder against ``model(ids).logits`` (fp32, tolerance
1e-4), and speculative == plain greedy (near-tie rule of docs/design.md section 6, ``tests/lossless.py``) on
3 prompts x 24 new tokens for an early exit after block L//2, a whole-block skip of block 1, and, on the
canonical path, a sublayer skip (attention of block 1, MLP of block 2).

    nice -n 19 python tests/family_sweep.py [--only llama,olmo2] [--json sweep.json]

Single-threaded, one model at a time; every per-model exception lands in the table.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

PARITY_TOL = 1e-4
NEW_TOKENS = 24
N_PROMPTS = 3
SEED = 0

# The tiny geometry, by concept: the first entry is transformers' standard attribute name, the rest the
# spellings configs use in their __init__ (GPT-2's n_embd, MPT's d_model, ...). A value is passed under
# every spelling the config class accepts (its __init__ parameters, or through its attribute_map).
TINY: list[tuple[tuple[str, ...], object]] = [
    (
        (
            "hidden_size",
            "n_embd",
            "n_embed",
            "d_model",
            "dim",
            "embed_dim",
            "emb_dim",
            "hidden_dim",
            "word_embed_proj_dim",
        ),
        64,
    ),
    (
        (
            "num_hidden_layers",
            "n_layer",
            "n_layers",
            "num_layers",
            "decoder_layers",
            "num_decoder_layers",
            "encoder_layers",
        ),
        4,
    ),
    (
        ("num_attention_heads", "n_head", "n_heads", "num_heads", "decoder_attention_heads", "encoder_attention_heads"),
        4,
    ),
    (("num_key_value_heads", "num_kv_heads", "n_head_kv", "kv_n_heads", "multi_query_group_num"), 2),
    (
        (
            "intermediate_size",
            "n_inner",
            "ffn_dim",
            "decoder_ffn_dim",
            "d_ff",
            "ffn_hidden_size",
            "intermediate_dim",
            "d_inner",
            "inner_hidden_size",
            "encoder_ffn_dim",
        ),
        128,
    ),
    (("vocab_size", "n_words"), 320),
    (("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "seq_length", "max_sequence_length"), 256),
    (("head_dim", "attention_head_dim", "d_head", "kv_channels"), 16),
    (("rotary_dim",), 8),  # partial rotary (GPT-J, CodeGen): within the head
    # mixture of experts: 4 experts, top-2, small expert MLPs
    (("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts", "num_routed_experts"), 4),
    (("num_experts_per_tok", "num_experts_per_token", "moe_top_k", "moe_topk", "top_k", "num_selected_experts"), 2),
    (
        (
            "moe_intermediate_size",
            "expert_intermediate_size",
            "shared_expert_intermediate_size",
            "moe_ffn_hidden_size",
            "expert_ffn_hidden_size",
        ),
        64,
    ),
    (("n_shared_experts", "num_shared_experts", "moe_num_shared_experts"), 1),
    (("n_group",), 1),
    (("topk_group",), 1),
    (("first_k_dense_replace",), 1),
    # multi-head latent attention (DeepSeek-style)
    (("kv_lora_rank",), 16),
    (("q_lora_rank",), 32),
    (("qk_rope_head_dim",), 8),
    (("qk_nope_head_dim",), 8),
    (("v_head_dim",), 16),
    # small windows: a 12..20-token prompt plus 24 new tokens crosses them
    (("sliding_window", "window_size"), 16),
    (("initializer_range",), 0.08),  # spread logits: fewer near-ties in the greedy comparison
]
TOKEN_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
MULTIMODAL_SUB_CONFIGS = ("vision", "audio", "image", "speech")


def _params(config_cls) -> set[str]:
    return set(inspect.signature(config_cls.__init__).parameters) - {"self", "kwargs"}


def tiny_kwargs(config_cls, vocab: int = 320) -> dict:
    """Tiny sizes under ``config_cls``'s own parameter names; sub-configs (MPT's attn_config, DBRX's
    ffn_config, a composite's text_config) get theirs, as dicts."""
    params = _params(config_cls)
    amap = getattr(config_cls, "attribute_map", {}) or {}
    kwargs = {}
    for names, value in TINY:
        for name in names:
            target = amap.get(name, name)
            if target in params:
                kwargs[target] = value
    for name in params:  # token ids inside the tiny vocabulary
        if name in TOKEN_IDS:
            kwargs[name] = TOKEN_IDS[name]
        elif name.endswith(("_token_id", "_token_index")):
            default = inspect.signature(config_cls.__init__).parameters[name].default
            if isinstance(default, int) and default >= vocab:
                kwargs[name] = 3
    if "kv_lora_rank" in params:  # latent attention: every query head gets its own K and V from the latent
        kwargs.update(
            {k: kwargs[h] for k in OPTIONAL[1] for h in ("num_attention_heads",) if k in kwargs and h in kwargs}
        )
    for key, sub_cls in (getattr(config_cls, "sub_configs", {}) or {}).items():
        if key not in params or not isinstance(sub_cls, type):
            continue
        if sub_cls.__name__ == "AutoConfig":  # the default sub-config's own class (Fuyu's Persimmon text model)
            from transformers import CONFIG_MAPPING

            default = getattr(config_cls(), key, None)
            if default is None or not getattr(default, "model_type", None):
                continue
            kwargs[key] = {"model_type": default.model_type, **tiny_kwargs(CONFIG_MAPPING[default.model_type], vocab)}
        else:
            kwargs[key] = tiny_kwargs(sub_cls, vocab)
    return kwargs


# Overrides dropped, one group at a time, when the full tiny config does not build or run (for instance
# multi-head latent attention needs as many KV heads as query heads): the geometry stays tiny either way.
OPTIONAL = (
    ("is_decoder",),
    ("num_key_value_heads", "num_kv_heads", "n_head_kv", "kv_n_heads", "multi_query_group_num"),
    ("head_dim", "attention_head_dim", "d_head", "kv_channels"),
    ("sliding_window", "window_size"),
)
MAX_PARAMS = 20_000_000  # a "tiny" model above this kept a large default the tiny names did not reach


class Skip(Exception):
    """Not a decoder-only text model entry to sweep (the reason is the message)."""


def build_model(model_type: str, seed: int = SEED):
    """The tiny random ``*ForCausalLM`` of ``model_type`` (eval, fp32). Raises ``Skip`` for multimodal
    composites; anything else that fails is transformers' own error."""
    import torch
    import transformers
    from transformers import CONFIG_MAPPING, AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from speccompile.convert import recurrent_layer

    class_name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]
    model_cls = getattr(transformers, class_name)
    config_cls = CONFIG_MAPPING[model_type]
    wanted = getattr(model_cls, "config_class", None) or config_cls
    if wanted is config_cls:
        multimodal = [
            k for k in (getattr(config_cls, "sub_configs", {}) or {}) if any(m in k for m in MULTIMODAL_SUB_CONFIGS)
        ]
        if multimodal:
            raise Skip(f"multimodal composite ({', '.join(multimodal)}); {class_name} is not a text-only causal LM")
    # every config takes is_decoder (PretrainedConfig): encoder stacks offered as causal LMs (BERT & co.)
    # are causal only with it, as transformers' own warning says
    full = {"is_decoder": True, **tiny_kwargs(wanted)}
    attempts = [full]
    if "rope_scaling" in _params(wanted):  # text classes whose composite usually fills rope_scaling in (mllama)
        attempts.append({**full, "rope_scaling": {"rope_type": "default"}})
    dropped: set[str] = set()  # then drop the optional overrides, cumulatively
    for group in OPTIONAL:
        if any(k in full for k in group):
            dropped |= set(group)
            attempts.append({k: v for k, v in full.items() if k not in dropped})
    first_error = None
    for kwargs in attempts:
        try:
            if wanted is not config_cls:
                # the mapping points to the text model of a composite config (mllama, llama4): the composite's
                # text config, as the composite builds it (it fills in what the text class leaves empty)
                keys = [k for k, c in (getattr(config_cls, "sub_configs", {}) or {}).items() if c is wanted]
                config = getattr(config_cls(**{keys[0]: kwargs}), keys[0]) if keys else wanted(**kwargs)
                make = lambda: model_cls(config)  # noqa: E731
            else:
                config = AutoConfig.for_model(model_type, **kwargs)
                make = lambda: AutoModelForCausalLM.from_config(config)  # noqa: E731
            try:
                with torch.device("meta"):
                    size = sum(p.numel() for p in make().parameters())
            except Exception:  # noqa: BLE001 - a model whose __init__ computes on tensors: no estimate
                size = 0
            if size > MAX_PARAMS:
                raise ValueError(f"{size / 1e6:.0f}M parameters from the tiny config (a large default was not reached)")
            torch.manual_seed(seed)
            model = make().eval()
            if recurrent_layer(model) is not None:  # refused before any forward: skip the (slow) smoke run
                return model
            with torch.inference_mode():  # transformers' own forward must run on the tiny config
                model(input_ids=torch.randint(3, 300, (1, 8)))
            return model
        except Exception as exc:  # noqa: BLE001 - try the next, smaller set of overrides
            first_error = first_error or exc
    raise first_error


@dataclass
class Row:
    model_type: str
    path: str  # canonical | generic | refused | config failed | skipped | error
    parity: float | None = None
    lossless: str = ""  # "yes" | "NO" | "error" | ""
    reason: str = ""
    checks: list[str] = field(default_factory=list)
    seconds: float = 0.0


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:200]}"


def prompts(vocab: int, n: int = N_PROMPTS, seed: int = SEED) -> list[list[int]]:
    """Prompts of 12..20 tokens; the second repeats a phrase (drafts get accepted), the others random."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = 12 + 4 * (i % 3)
        if i % 3 == 1:
            phrase = torch.randint(3, vocab, (5,), generator=g).tolist()
            out.append((phrase * 4)[:length])
        else:
            out.append(torch.randint(3, vocab, (length,), generator=g).tolist())
    return out


def plans(num_layers: int, canonical: bool):
    from speccompile.runtime.artifact.manifest import DraftPlan

    out = [
        DraftPlan.of(name=f"exit{num_layers // 2}", exit_layer=num_layers // 2, sources={"model": {"max_draft": 4}}),
        DraftPlan.of(name="skip_block1", skip_attn=[1], skip_mlp=[1], sources={"model": {"max_draft": 3}}),
    ]
    if canonical:
        out.append(
            DraftPlan.of(name="skip_attn1_mlp2", skip_attn=[1], skip_mlp=[2], sources={"model": {"max_draft": 3}})
        )
    return out


def decoder_for(model):
    """(path, why, decoder) through ``choose_path``; raises ``UnsupportedModelError`` when refused."""
    from speccompile.convert import arch_config, canonical_weights, choose_path
    from speccompile.runtime.backends.torch.decoder import build_decoder

    chosen = choose_path(model)
    if chosen.path == "canonical":
        config = arch_config(model)
        return chosen.path, chosen.why, build_decoder(config, canonical_weights(model, config))
    return chosen.path, chosen.why, chosen.decoder


def parity(model, decoder, vocab: int) -> float:
    import torch

    ids = torch.randint(3, vocab, (2, 20), generator=torch.Generator().manual_seed(SEED + 1))
    with torch.inference_mode():
        ref = model(input_ids=ids).logits.float()
        ours = decoder(ids).float()
    return float((ref - ours).abs().max())


def lossless_checks(decoder, canonical: bool) -> list[str]:
    """One entry per (plan, prompt) that is not lossless; empty when all are (near-ties count as equal)."""
    from lossless import assert_same_greedy, run

    from speccompile.runtime.backends.torch.backend import TorchBackend

    backend = TorchBackend(decoder)
    vocab = decoder.config.vocab_size
    failures = []
    for p, prompt in enumerate(prompts(vocab)):
        plain, _ = run(backend, prompt, NEW_TOKENS)
        for plan in plans(decoder.config.num_layers, canonical):
            try:
                spec, _ = run(backend, prompt, NEW_TOKENS, plan)
                assert_same_greedy(decoder, prompt, plain, spec)
            except AssertionError as exc:
                failures.append(f"{plan.name} prompt {p}: {str(exc).splitlines()[0]}")
            except Exception as exc:  # noqa: BLE001 - the table records it
                failures.append(f"{plan.name} prompt {p}: {_one_line(exc)}")
    return failures


def check(model_type: str) -> Row:
    """Build, classify and check one model type; never raises."""
    from speccompile.convert import UnsupportedModelError

    start = time.perf_counter()
    row = Row(model_type, "error")
    try:
        try:
            model = build_model(model_type)
        except Skip as exc:
            row.path, row.reason = "skipped", str(exc)
            return row
        except Exception as exc:  # noqa: BLE001
            row.path, row.reason = "config failed", f"config/instantiation failed: {_one_line(exc)}"
            return row
        try:
            path, why, decoder = decoder_for(model)
        except UnsupportedModelError as exc:
            row.path, row.reason = "refused", str(exc)
            return row
        row.path, row.reason = path, why
        row.parity = parity(model, decoder, decoder.config.vocab_size)
        row.checks = lossless_checks(decoder, path == "canonical")
        row.lossless = "NO" if row.checks else "yes"
        if row.checks:
            row.reason = row.checks[0]
        elif row.parity > PARITY_TOL:
            row.reason = f"logits differ from transformers by {row.parity:.1e}"
    except Exception as exc:  # noqa: BLE001
        row.lossless = row.lossless or "error"
        row.reason = f"{_one_line(exc)} (at {traceback.extract_tb(exc.__traceback__)[-1].name})"
    finally:
        row.seconds = time.perf_counter() - start
    return row


def ok(row: Row) -> bool:
    return (
        row.path in ("canonical", "generic")
        and row.lossless == "yes"
        and row.parity is not None
        and row.parity <= PARITY_TOL
    )


def table(rows: list[Row]) -> str:
    lines = ["| model_type | path | parity max diff | lossless | reason |", "|---|---|---|---|---|"]
    for r in rows:
        par = "" if r.parity is None else f"{r.parity:.1e}"
        reason = r.reason.replace("|", "/")
        lines.append(f"| {r.model_type} | {r.path} | {par} | {r.lossless} | {reason} |")
    return "\n".join(lines)


def summary(rows: list[Row]) -> str:
    counts: dict[str, int] = {}
    for r in rows:
        counts[r.path] = counts.get(r.path, 0) + 1
    good = sum(ok(r) for r in rows)
    built = sum(r.path in ("canonical", "generic") for r in rows)
    parts = ", ".join(f"{k}: {v}" for k, v in sorted(counts.items()))
    return (
        f"{len(rows)} model types: {parts}\n"
        f"built on canonical or generic: {built}; parity <= {PARITY_TOL:g} and lossless: {good}"
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated model types (default: the whole mapping)")
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args(argv)

    import logging
    import warnings

    import torch
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    from transformers.utils import logging as hf_logging

    torch.set_num_threads(1)
    hf_logging.set_verbosity_error()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    types = list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    if args.only:
        wanted = [t.strip() for t in args.only.split(",") if t.strip()]
        unknown = [t for t in wanted if t not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES]
        if unknown:
            parser.error(f"not in the causal-LM mapping: {', '.join(unknown)}")
        types = wanted
    rows = []
    for mt in types:
        row = check(mt)
        rows.append(row)
        print(
            f"{mt:24s} {row.path:13s} {'' if row.parity is None else f'{row.parity:.1e}':8s} "
            f"{row.lossless:5s} {row.seconds:5.1f}s  {row.reason[:150]}",
            file=sys.stderr,
            flush=True,
        )
    print(table(rows))
    print()
    print(summary(rows))
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
