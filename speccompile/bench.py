"""`speccompile bench`: the same prompts decoded plain and speculative by the runtime, and by
transformers ``generate()`` (greedy) on the source model, with tokens/s, speedups, mean accepted tokens
and whether the outputs are identical."""

from __future__ import annotations

import json
import time
from pathlib import Path

from tqdm.auto import tqdm

from speccompile.calibration import DEFAULT_CALIBRATION
from speccompile.runtime import load
from speccompile.runtime.drafting import describe
from speccompile.runtime.errors import SpeccompileError


def load_prompts(path: str | None, manifest) -> tuple[list[str], str]:
    """Prompts from ``path`` (JSONL "prompt"/"text" or plain text, one prompt per blank-line block),
    else the source model's own prompts.jsonl (the reference model ships one), else the built-in set."""
    from speccompile.calibration import load_calibration

    if path is not None:
        return load_calibration(path, kind="prompts"), path
    shipped = Path(manifest.source.get("path", "")) / "prompts.jsonl"
    if manifest.source.get("path") and shipped.is_file():
        return load_calibration(str(shipped), kind="prompts"), str(shipped)
    return list(DEFAULT_CALIBRATION), "built-in"


def _generate_all(model, prompt_ids, max_new_tokens, eos, pad, desc, progress, **extra):
    """Greedy ``generate()`` of a transformers-API model (transformers or optimum) on every prompt;
    ``extra`` generation options select a peer's own speculation (``prompt_lookup_num_tokens``,
    ``assistant_early_exit``)."""
    import torch
    from transformers import GenerationConfig
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # generate() chatters about generation-config defaults on every model
    pad = pad if pad is not None else (eos or [0])[0]
    config = GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=False, num_beams=1, eos_token_id=eos or None, pad_token_id=pad, **extra
    )
    warmup = GenerationConfig(max_new_tokens=4, do_sample=False, num_beams=1, pad_token_id=pad, **extra)
    outputs, seconds = [], 0.0
    with torch.inference_mode():
        model.generate(torch.tensor([prompt_ids[0]]), generation_config=warmup)
        for ids in tqdm(prompt_ids, desc=desc, disable=not progress):
            start = time.perf_counter()
            out = model.generate(torch.tensor([ids]), generation_config=config)
            seconds += time.perf_counter() - start
            outputs.append(out[0, len(ids) :].tolist())
    return outputs, seconds


def _transformers_model(source_path: Path):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(source_path, dtype=torch.float32, use_safetensors=True).eval()


def _optimum_model(source_path: Path):
    """optimum's own ONNX export of the source model, run by its ORTModelForCausalLM (KV cache on)."""
    try:
        from optimum.onnxruntime import ORTModelForCausalLM
    except ImportError:
        raise SpeccompileError(
            "the optimum baseline needs optimum-onnx; pip install 'optimum-onnx[onnxruntime]'"
        ) from None
    return ORTModelForCausalLM.from_pretrained(source_path, export=True, use_cache=True)


def run_bench(
    artifact: str,
    prompts_path: str | None = None,
    max_new_tokens: int = 128,
    plan: str | None = None,
    with_transformers: bool = True,
    progress: bool = True,
    backend: str | None = None,
) -> dict:
    model = load(artifact, backend=backend)
    texts, prompt_source = load_prompts(prompts_path, model.manifest)
    prompt_ids = [model.encode_prompt(text) for text in texts]
    model.generate(prompt_ids[0], max_new_tokens=8, speculate=False)  # warm-up
    model.generate(prompt_ids[0], max_new_tokens=8, plan=plan)
    plain, spec = [], []
    for ids in tqdm(prompt_ids, desc="bench: runtime plain + speculative", disable=not progress):
        plain.append(model.generate(ids, max_new_tokens=max_new_tokens, speculate=False))
        spec.append(model.generate(ids, max_new_tokens=max_new_tokens, plan=plan))

    def rate(results) -> float:
        return sum(r.stats.new_tokens for r in results) / sum(r.stats.seconds for r in results)

    rounds = sum(r.stats.rounds for r in spec)
    accepted = sum(r.stats.accepted for r in spec)
    drafted = sum(r.stats.drafted for r in spec)
    spec_same = [a.token_ids == b.token_ids for a, b in zip(plain, spec)]
    divergences = _divergences(model.backend, prompt_ids, plain, spec, model.manifest.dtype)
    draft_plan = model.draft_plan(plan)
    report = {
        "artifact": str(artifact),
        "plan": draft_plan.name if draft_plan is not None else None,
        "plan_description": describe(draft_plan) if draft_plan is not None else model.plain_reason,
        "prompts": len(prompt_ids),
        "prompt_source": prompt_source,
        "max_new_tokens": max_new_tokens,
        "autoregressive": {"tokens_per_s": round(rate(plain), 2), "new_tokens": sum(r.stats.new_tokens for r in plain)},
        "speculative": {
            "tokens_per_s": round(rate(spec), 2),
            "new_tokens": sum(r.stats.new_tokens for r in spec),
            "mean_accepted": round((accepted + rounds) / max(rounds, 1), 3),
            "acceptance_rate": round(accepted / max(drafted, 1), 3),
            "rounds": rounds,
            "drafted_per_round": round(drafted / max(rounds, 1), 3),
            "tree_rounds": sum(r.stats.tree_rounds for r in spec),
            "sources": _sources(spec),
            "round_mix": _mix(spec),
        },
        "backend": model.backend.name,
        "dtype": model.manifest.dtype,
        "transformers": None,
        "speedup": {"speculative_vs_autoregressive": round(rate(spec) / rate(plain), 3)},
        "identical_detail": {"speculative_vs_autoregressive": f"{sum(spec_same)}/{len(spec_same)}"},
        "divergences": divergences,
        "near_tie_divergences": sum(d["near_tie"] for d in divergences),
        "real_divergences": sum(not d["near_tie"] for d in divergences),
    }
    identical = all(spec_same)
    source_path = Path(model.manifest.source.get("path", ""))
    if with_transformers:
        for key, make, extra, desc in _baselines(model, draft_plan, max_new_tokens):
            if not (source_path / "config.json").is_file():
                report[f"{key}_skipped"] = f"source model folder {str(source_path)!r} is not available"
                continue
            if isinstance(extra, str):
                report[f"{key}_skipped"] = extra
                continue
            try:
                outputs, seconds = _generate_all(
                    make(source_path),
                    prompt_ids,
                    max_new_tokens,
                    sorted(model.eos_ids),
                    model.manifest.tokens.get("pad_token_id"),
                    desc,
                    progress,
                    **extra,
                )
            except SpeccompileError:
                raise
            except Exception as exc:  # an external baseline failing must not hide our own figures
                if key == "transformers":
                    raise
                report[f"{key}_skipped"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
                continue
            base_rate = sum(len(o) for o in outputs) / seconds
            same = [o == r.token_ids for o, r in zip(outputs, plain)]
            report[key] = {"tokens_per_s": round(base_rate, 2), "new_tokens": sum(len(o) for o in outputs)}
            report["speedup"][f"speculative_vs_{key}"] = round(rate(spec) / base_rate, 3)
            report["speedup"][f"autoregressive_vs_{key}"] = round(rate(plain) / base_rate, 3)
            report["identical_detail"][f"{key}_vs_autoregressive"] = f"{sum(same)}/{len(same)}"
            if key in ("transformers", "optimum"):  # plain decoders: they must agree with ours
                identical = identical and all(same)
    report["identical"] = identical
    return report


NEAR_TIE = 1e-4  # docs/design.md section 6: a divergence where the top-2 logits are closer than this is rounding


HALF_MANTISSA_BITS = {"bfloat16": 7, "float16": 10}
NEAR_TIE_ULPS = 4  # half-precision artifacts: a top-2 gap of up to this many units in the last place is rounding


def near_tie_limit(dtype: str, top: float) -> float:
    """The top-2 gap under which a divergence is rounding, for an artifact of ``dtype`` whose top logit is ``top``.

    fp32: ``NEAR_TIE`` (docs/design.md section 6). bf16 and fp16 artifacts compute and round every product in
    their own precision, so a k-token verify and the one-token steps it replaces (different kernels, different
    accumulation orders) differ by units in the last place of that precision, compounded over the blocks:
    the gaps measured where they diverge lie within a few ulps of the top logit (measured: docs/history.md,
    'Figures behind the code's constants'). A gap of up to ``NEAR_TIE_ULPS`` such units counts as a near-tie
    there; and such divergences are not rare in half precision."""
    import math

    bits = HALF_MANTISSA_BITS.get(dtype)
    if bits is None or top == 0:
        return NEAR_TIE
    return NEAR_TIE_ULPS * 2.0 ** (math.floor(math.log2(abs(top))) - bits)


def _divergences(backend, prompt_ids, plain, spec, dtype: str = "float32") -> list[dict]:
    """Where speculative output leaves plain output: per such prompt, the first differing new token and the
    top-2 logit gap there of the backend's own logits (one call over prompt + plain output so far). A gap
    under ``near_tie_limit`` is floating-point rounding between a verify and the steps it replaces (docs/design.md
    section 6); a larger one means speculative decoding computed something else: a bug."""
    import numpy as np

    out = []
    for p, (a, b) in enumerate(zip(plain, spec)):
        if a.token_ids == b.token_ids:
            continue
        at = next(
            (k for k, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y),
            min(len(a.token_ids), len(b.token_ids)),
        )
        tokens = list(prompt_ids[p]) + list(a.token_ids[:at])
        backend.reserve(len(tokens) + 1)
        top = np.sort(np.asarray(backend.forward(tokens, 0), dtype=np.float64)[-1])[-2:]
        gap = float(top[1] - top[0])
        limit = near_tie_limit(dtype, float(top[1]))
        within = gap <= limit if dtype in HALF_MANTISSA_BITS else gap < limit  # fp32: the design's strict rule
        out.append({"prompt": p, "token": at, "top2_gap": gap, "near_tie_limit": limit, "near_tie": within})
    return out


def _sources(results) -> dict:
    """Per draft source: tokens drafted, accepted, and the acceptance rate, over all prompts."""
    totals: dict[str, list[int]] = {}
    for r in results:
        for source, (d, a) in r.stats.per_source.items():
            t = totals.setdefault(source, [0, 0])
            t[0] += d
            t[1] += a
    return {
        k: {"drafted": d, "accepted": a, "acceptance_rate": round(a / d, 3) if d else None}
        for k, (d, a) in sorted(totals.items())
    }


def _mix(results) -> dict:
    """Share of rounds per combination of sources (what the hybrid chose)."""
    mix: dict[str, int] = {}
    for r in results:
        for label, count in r.stats.source_mix.items():
            mix[label] = mix.get(label, 0) + count
    total = sum(mix.values()) or 1
    return {label: round(count / total, 3) for label, count in sorted(mix.items())}


PROMPT_LOOKUP_TOKENS = 10  # transformers' prompt lookup: tokens drafted per match (its docs suggest 10)


def _baselines(model, plan, max_new_tokens):
    """(key, model factory, generate() options or a reason to skip, progress label) for each peer."""
    exit_layer = (
        plan.exit_layer if plan is not None and plan.exit_layer else model.manifest.tuning.get("best_exit_layer")
    )
    early_exit = (
        {"assistant_early_exit": int(exit_layer)}
        if exit_layer
        else "no exit layer was tuned for this artifact (build with --method auto or early-exit)"
    )
    peers = [
        ("transformers", _transformers_model, {}, "bench: transformers generate"),
        (
            "transformers_prompt_lookup",
            _transformers_model,
            {"prompt_lookup_num_tokens": PROMPT_LOOKUP_TOKENS},
            "bench: transformers prompt lookup",
        ),
        ("transformers_early_exit", _transformers_model, early_exit, "bench: transformers assistant_early_exit"),
    ]
    if model.backend.name == "onnx":
        peers.append(("optimum", _optimum_model, {}, "bench: optimum ORTModelForCausalLM"))
    return peers


LABELS = {
    "transformers": "transformers generate()",
    "transformers_prompt_lookup": "transformers prompt lookup",
    "transformers_early_exit": "transformers assistant_early_exit",
    "optimum": "optimum ORTModelForCausalLM",
}


def format_report(report: dict) -> str:
    plan = report["plan"] or "none: plain decoding"
    lines = [
        f"bench: {report['prompts']} prompts ({report['prompt_source']}), {report['max_new_tokens']} new tokens, "
        f"plan '{plan}' ({report.get('plan_description')}), backend {report['backend']}"
    ]
    rows = [
        (f"runtime {report['backend']} plain (autoregressive)", report["autoregressive"]["tokens_per_s"]),
        (f"runtime {report['backend']} speculative", report["speculative"]["tokens_per_s"]),
    ]
    rows += [(label, report[key]["tokens_per_s"]) for key, label in LABELS.items() if report.get(key)]
    for name, value in rows:
        lines.append(f"  {name:36s} {value:9.1f} tokens/s")
    spec = report["speculative"]
    lines.append(
        f"  mean accepted tokens per round {spec['mean_accepted']:.2f} "
        f"(acceptance rate {spec['acceptance_rate']:.2f}, {spec['rounds']} rounds)"
    )
    if spec.get("tree_rounds"):
        lines.append(
            f"  token trees: {spec['tree_rounds']} of {spec['rounds']} rounds verified a tree; "
            f"{spec['drafted_per_round']:.2f} drafted tokens (tree nodes) per round"
        )
    if spec.get("sources"):
        lines.append(
            "  per source: "
            + ", ".join(f"{k} {v['accepted']}/{v['drafted']} accepted" for k, v in spec["sources"].items())
        )
        lines.append("  rounds by source: " + ", ".join(f"{k} {100 * v:.0f}%" for k, v in spec["round_mix"].items()))
    lines.append("  speedup: " + ", ".join(f"{k.replace('_', ' ')} {v:.2f}x" for k, v in report["speedup"].items()))
    lines.append(
        "  identical outputs: "
        + ("yes" if report["identical"] else "NO")
        + " ("
        + ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in report["identical_detail"].items())
        + ")"
    )
    divergences = report.get("divergences") or []
    if divergences:
        real = [d for d in divergences if not d["near_tie"]]
        limit = (
            f"<= {NEAR_TIE_ULPS} units in the last place of {report['dtype']}"
            if report.get("dtype") in HALF_MANTISSA_BITS
            else f"< {NEAR_TIE:g}"
        )
        lines.append(
            f"  speculative vs plain: {len(divergences) - len(real)} near-tie divergence(s) (top-2 gap "
            f"{limit}: rounding), {len(real)} real" + (" (A BUG: " if real else "")
        )
        if real:
            lines[-1] += (
                "; ".join(f"prompt {d['prompt']} token {d['token']}, gap {d['top2_gap']:.2e}" for d in real) + ")"
            )
    for key in LABELS:
        if f"{key}_skipped" in report:
            lines.append(f"  {key} baseline skipped: {report[key + '_skipped']}")
    return "\n".join(lines)


def dumps(report: dict) -> str:
    return json.dumps(report, indent=2)


__all__ = ["SpeccompileError", "dumps", "format_report", "run_bench"]
