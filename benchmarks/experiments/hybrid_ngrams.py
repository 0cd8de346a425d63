"""A model draft behind lookup, with the lookup's shortest n-gram varied: which rounds the lookup
should take from a draft that is accepted most of the time. Timed in turns against plain decoding on the
backend that runs the artifact.

    python benchmarks/experiments/hybrid_ngrams.py ART [--plan NAME] [--backend onnx|torch] [--prompts FILE] [--max-new-tokens 96]

``--plan`` (default: the artifact's default plan) must put lookup in front of a model draft (a precision plan
behind lookup, a hybrid). Its variants: the same plan with n-grams from 1, 2 and 3 tokens (up to the plan's
longest, at least 3), and its model draft alone. Prints, per variant, the speedup over plain decoding (summed
over the prompts; plain and every variant decoded one after the other on each prompt, in an order that
alternates), the rounds, and whether each output equals plain decoding.
"""

from __future__ import annotations

import dataclasses

from plan_turns import plan_arguments, time_plan_variants

from speccompile.runtime.drafting import has_model_part, options


def variants(plan) -> dict:
    """name -> plan: the n-gram minimum varied, and the model draft alone."""
    high = max(options(plan, "ngram").max, 3)
    found = {f"as built (n {options(plan, 'ngram').max}..{options(plan, 'ngram').min})": plan}
    for low in (1, 2, 3):
        if low != options(plan, "ngram").min or high != options(plan, "ngram").max:
            found[f"n {high}..{low}"] = dataclasses.replace(
                plan.with_options(ngram={"min": low, "max": high, "short": min(options(plan, "ngram").short, high)}),
                measured={},
            )
    found["model draft alone"] = dataclasses.replace(
        plan.with_options(retrieval={"datastore": None}), lookup=[], measured={}
    )
    return found


def main() -> None:
    args = plan_arguments(__doc__.splitlines()[0])
    prompts, plain_seconds, timed = time_plan_variants(
        args, lambda p: p.lookup and has_model_part(p), "lookup in front of a model draft", variants
    )
    print("| variant | vs plain | rounds | identical |\n|---|---|---|---|")
    for key, t in timed.items():
        print(f"| {key} | {plain_seconds / t.seconds:.3f}x | {t.rounds} | {t.identical}/{len(prompts)} |")


if __name__ == "__main__":
    main()
