"""Two artifacts of the same model and backend, timed in turns: does one's default plan decode faster?

Issue 26's plan-quality check (a budgeted ``auto`` build against the old full ``auto``): both artifacts are
loaded into one process; every turn decodes one benchmark prompt plainly (with the first artifact) and with
each artifact's default plan, in an order that alternates from turn to turn, so the machine's drift falls
on all of them alike. Prints each plan's speedup over plain decoding (total plain seconds / total plan
seconds), the ratio of the two with a 95% interval over the per-turn log ratios, and whether every output
matched plain decoding.

    python benchmarks/auto_compare.py OLD_ARTIFACT NEW_ARTIFACT [--prompts FILE] [--max-new-tokens 96] [--rounds 2]
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from speccompile.runtime.drafting import describe

HERE = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("first")
    parser.add_argument("second")
    parser.add_argument("--prompts", default=str(HERE / "data" / "smollm2_prompts.jsonl"))
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=2, help="passes over the prompts")
    args = parser.parse_args()

    from speccompile.bench import load_prompts
    from speccompile.passes.confirm import interval
    from speccompile.runtime import load

    models = {"first": load(args.first), "second": load(args.second)}
    texts, _ = load_prompts(args.prompts, models["first"].manifest)
    prompts = [models["first"].encode_prompt(t) for t in texts]
    runs = {
        "plain": lambda ids: models["first"].generate(ids, max_new_tokens=args.max_new_tokens, speculate=False),
        "first": lambda ids: models["first"].generate(ids, max_new_tokens=args.max_new_tokens),
        "second": lambda ids: models["second"].generate(ids, max_new_tokens=args.max_new_tokens),
    }
    for run in runs.values():  # warm-up
        run(prompts[0])
    seconds = {name: 0.0 for name in runs}
    log_ratio, identical = [], {"first": True, "second": True}
    turn = 0
    for _ in range(args.rounds):
        for ids in prompts:
            order = list(runs) if turn % 2 == 0 else list(runs)[::-1]
            results = {name: runs[name](ids) for name in order}
            for name, result in results.items():
                seconds[name] += result.stats.seconds
            for name in ("first", "second"):
                identical[name] &= results[name].token_ids == results["plain"].token_ids
            log_ratio.append(math.log(results["first"].stats.seconds / results["second"].stats.seconds))
            turn += 1
    for name, path in (("first", args.first), ("second", args.second)):
        plan = models[name].draft_plan(None)
        label = describe(plan) if plan is not None else "plain decoding (no default plan)"
        print(
            f"{name:6s} {path}: {seconds['plain'] / seconds[name]:.3f}x plain   identical {identical[name]}   {label}"
        )
    mean, lo, hi = interval(log_ratio)
    print(
        f"second vs first: {math.exp(mean):.3f}x (95% interval {math.exp(lo):.3f}x..{math.exp(hi):.3f}x over {turn} turns)"
    )
    sys.exit(0 if all(identical.values()) else 1)


if __name__ == "__main__":
    main()
