"""A model draft behind lookup, with the lookup's shortest n-gram varied (issue 22): which rounds the lookup
should take from a draft that is accepted most of the time. Timed in turns against plain decoding on the
backend that runs the artifact.

    python benchmarks/hybrid_ngrams.py ART [--plan NAME] [--backend onnx|torch] [--prompts FILE] [--max-new-tokens 96]

``--plan`` (default: the artifact's default plan) must put lookup in front of a model draft (a precision plan
behind lookup, a hybrid). Its variants: the same plan with n-grams from 1, 2 and 3 tokens (up to the plan's
longest, at least 3), and its model draft alone. Prints, per variant, the speedup over plain decoding (summed
over the prompts; plain and every variant decoded one after the other on each prompt, in an order that
alternates), the rounds, and whether each output equals plain decoding.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def variants(plan) -> dict:
    """name -> plan: the n-gram minimum varied, and the model draft alone."""
    high = max(plan.ngram_max, 3)
    found = {f"as built (n {plan.ngram_max}..{plan.ngram_min})": plan}
    for low in (1, 2, 3):
        if low != plan.ngram_min or high != plan.ngram_max:
            found[f"n {high}..{low}"] = dataclasses.replace(plan, ngram_min=low, ngram_max=high,
                                                           short_ngram=min(plan.short_ngram, high), measured={})
    found["model draft alone"] = dataclasses.replace(plan, lookup=[], datastore=None, measured={})
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact")
    parser.add_argument("--plan", default=None)
    parser.add_argument("--backend", default=None)
    parser.add_argument("--prompts", default=str(HERE / "data" / "smollm2_prompts.jsonl"))
    parser.add_argument("--max-new-tokens", type=int, default=96)
    args = parser.parse_args()

    from speccompile.runtime import load
    from speccompile.runtime.speculative import DecodeRequest, decode_all

    model = load(args.artifact, backend=args.backend)
    name = args.plan or model.manifest.default_plan
    plan = model.manifest.plans.get(name) if name else None
    if plan is None or not plan.lookup or not plan.has_model_draft:
        raise SystemExit(f"error: plan {name!r} of {args.artifact} does not put lookup in front of a model draft; "
                         f"pass --plan with one that does (it has: {', '.join(model.manifest.plans) or 'none'})")
    plans = variants(plan)
    for each in plans.values():
        each.validate(model.manifest.config.num_layers)
    prompts = [model.tokenizer.encode(json.loads(line)["prompt"]) for line in open(args.prompts) if line.strip()]
    backend = model.backend
    plain_seconds, seconds = 0.0, {key: 0.0 for key in plans}
    rounds, same = {key: 0 for key in plans}, {key: 0 for key in plans}
    decode_all(backend, DecodeRequest(prompts[0], 8), None, model.root)  # warm-up
    for i, prompt in enumerate(prompts):
        start = time.perf_counter()
        plain, _ = decode_all(backend, DecodeRequest(prompt, args.max_new_tokens), None, model.root)
        plain_seconds += time.perf_counter() - start
        for key in list(plans) if i % 2 == 0 else list(plans)[::-1]:
            start = time.perf_counter()
            out, stats = decode_all(backend, DecodeRequest(prompt, args.max_new_tokens), plans[key], model.root)
            seconds[key] += time.perf_counter() - start
            rounds[key] += stats.rounds
            same[key] += out == plain
    print(f"{args.artifact} ({backend.__class__.__name__}), plan {name!r}: {len(prompts)} prompts, "
          f"{args.max_new_tokens} new tokens, greedy")
    print("| variant | vs plain | rounds | identical |\n|---|---|---|---|")
    for key in plans:
        print(f"| {key} | {plain_seconds / seconds[key]:.3f}x | {rounds[key]} | {same[key]}/{len(prompts)} |")


if __name__ == "__main__":
    main()
