"""A model-draft plan as a chain and as trees (``DraftPlan.draft_branches``: the draft's runner-ups as leaves
beside each token it drafts), timed in turns against plain decoding on the backend that runs the artifact.

    python benchmarks/draft_branches.py ART [--plan NAME] [--backend onnx|torch] [--prompts FILE] [--max-new-tokens 96]

``--plan`` (default: the artifact's default plan) must have a model draft. Its variants: 1 (a chain), 2 and 3
branches, everything else as built. Prints, per variant, the speedup over plain decoding (summed over the
prompts; plain and every variant decoded one after the other on each prompt, in an order that alternates), the
rounds, the leaves verified and accepted, and whether each output equals plain decoding.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


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
    if plan is None or not plan.has_model_draft:
        raise SystemExit(f"error: plan {name!r} of {args.artifact} has no model draft; pass --plan with one that has "
                         f"(it has: {', '.join(model.manifest.plans) or 'none'})")
    plans = {f"{b} branch{'es' if b > 1 else ''}{' (as built)' if b == plan.draft_branches else ''}":
             dataclasses.replace(plan, draft_branches=b, measured={}) for b in (1, 2, 3)}
    prompts = [model.tokenizer.encode(json.loads(line)["prompt"]) for line in open(args.prompts) if line.strip()]
    backend = model.backend
    plain_seconds, seconds = 0.0, {key: 0.0 for key in plans}
    rounds, same = {key: 0 for key in plans}, {key: 0 for key in plans}
    leaves = {key: [0, 0] for key in plans}  # verified, accepted
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
            drafted, accepted = stats.per_source.get("branch", (0, 0))
            leaves[key][0] += drafted
            leaves[key][1] += accepted
    print(f"{args.artifact} ({backend.__class__.__name__}), plan {name!r}: {len(prompts)} prompts, "
          f"{args.max_new_tokens} new tokens, greedy")
    print("| variant | vs plain | rounds | leaves accepted / verified | identical |\n|---|---|---|---|---|")
    for key in plans:
        print(f"| {key} | {plain_seconds / seconds[key]:.3f}x | {rounds[key]} | {leaves[key][1]} / {leaves[key][0]} | "
              f"{same[key]}/{len(prompts)} |")


if __name__ == "__main__":
    main()
