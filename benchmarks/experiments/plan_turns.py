"""What the plan-variant benchmarks share (``hybrid_ngrams.py``, ``draft_branches.py``, ``twin_variants.py``): a
plan read from an artifact, and variants of it timed against plain decoding in turns.

Each prompt is decoded plainly, then with every variant, one after the other, in an order that alternates from
prompt to prompt, so that the machine's drift touches all alike; a variant's speedup is plain decoding's seconds
over its own, summed over the prompts.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from speccompile.runtime.drafting import check_plan

PROMPTS = Path(__file__).resolve().parent.parent / "data" / "smollm2_prompts.jsonl"  # benchmarks/data/


def plan_arguments(description: str) -> argparse.Namespace:
    """The command line the plan-variant benchmarks take: ART [--plan] [--backend] [--prompts] [--max-new-tokens]."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("artifact")
    parser.add_argument("--plan", default=None, help="the plan to vary (default: the artifact's default plan)")
    parser.add_argument("--backend", default=None, help="torch or onnx (default: the artifact's first)")
    parser.add_argument("--prompts", default=str(PROMPTS))
    parser.add_argument("--max-new-tokens", type=int, default=96)
    return parser.parse_args()


def artifact_plan(model, name: str | None, wanted: Callable, what: str):
    """``model``'s plan ``name`` (default: its default plan), which must satisfy ``wanted``; a one-line exit naming
    ``what`` it must have and the plans the artifact has otherwise."""
    name = name or model.manifest.default_plan
    plan = model.manifest.plans.get(name) if name else None
    if plan is None or not wanted(plan):
        raise SystemExit(
            f"error: plan {name!r} of {model.root} does not have {what}; pass --plan with one that does "
            f"(it has: {', '.join(model.manifest.plans) or 'none'})"
        )
    return name, plan


def read_prompts(model, path: str | Path) -> list[list[int]]:
    return [model.tokenizer.encode(json.loads(line)["prompt"]) for line in open(path) if line.strip()]


@dataclass
class Timed:
    """One variant's totals over the prompts."""

    seconds: float = 0.0
    rounds: int = 0
    identical: int = 0
    per_source: dict = field(default_factory=dict)  # source -> [drafted, accepted]


def time_variants(
    model,
    variants: dict,
    prompts: list[list[int]],
    max_new_tokens: int,
    before: Callable | None = None,
    after_plain: Callable | None = None,
) -> tuple[float, dict]:
    """Plain decoding's seconds and each variant's ``Timed``; ``variants`` maps a key to a plan, ``before(key)``
    runs ahead of each variant's decode (a twin swapped in), ``after_plain(prompt, tokens)`` after each plain one."""
    from speccompile.runtime.decoding.speculative import DecodeRequest, decode_all

    backend, keys = model.backend, list(variants)
    plain_seconds, timed = 0.0, {key: Timed() for key in keys}
    decode_all(backend, DecodeRequest(prompts[0], 8), None, model.root)  # warm-up
    for i, prompt in enumerate(prompts):
        start = time.perf_counter()
        plain, _ = decode_all(backend, DecodeRequest(prompt, max_new_tokens), None, model.root)
        plain_seconds += time.perf_counter() - start
        if after_plain is not None:
            after_plain(prompt, plain)
        for key in keys if i % 2 == 0 else keys[::-1]:
            if before is not None:
                before(key)
            start = time.perf_counter()
            out, stats = decode_all(backend, DecodeRequest(prompt, max_new_tokens), variants[key], model.root)
            t = timed[key]
            t.seconds += time.perf_counter() - start
            t.rounds += stats.rounds
            t.identical += out == plain
            for source, (drafted, accepted) in stats.per_source.items():
                counts = t.per_source.setdefault(source, [0, 0])
                counts[0] += drafted
                counts[1] += accepted
    return plain_seconds, timed


def time_plan_variants(args: argparse.Namespace, wanted: Callable, what: str, variants_of: Callable):
    """``plan_arguments``' artifact and plan (``artifact_plan``), its variants (``variants_of(plan)``: key -> plan,
    each validated) timed in turns, and the table's header printed: (prompts, plain seconds, key -> ``Timed``)."""
    from speccompile.runtime import load

    model = load(args.artifact, backend=args.backend)
    name, plan = artifact_plan(model, args.plan, wanted, what)
    plans = variants_of(plan)
    for each in plans.values():
        check_plan(each, model.manifest.config.num_layers)
    prompts = read_prompts(model, args.prompts)
    plain_seconds, timed = time_variants(model, plans, prompts, args.max_new_tokens)
    print(
        f"{args.artifact} ({model.backend.__class__.__name__}), plan {name!r}: {len(prompts)} prompts, "
        f"{args.max_new_tokens} new tokens, greedy"
    )
    return prompts, plain_seconds, timed
