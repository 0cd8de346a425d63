"""A model-draft plan as a chain and as trees (``sources.model.branches``: the draft's runner-ups as leaves
beside each token it drafts), timed in turns against plain decoding on the backend that runs the artifact.

    python benchmarks/experiments/draft_branches.py ART [--plan NAME] [--backend onnx|torch] [--prompts FILE] [--max-new-tokens 96]

``--plan`` (default: the artifact's default plan) must have a model draft. Its variants: 1 (a chain), 2 and 3
branches, everything else as built. Prints, per variant, the speedup over plain decoding (summed over the
prompts; plain and every variant decoded one after the other on each prompt, in an order that alternates), the
rounds, the leaves verified and accepted, and whether each output equals plain decoding.
"""

from __future__ import annotations

import dataclasses

from plan_turns import plan_arguments, time_plan_variants

from speccompile.runtime.drafting import has_model_part, options


def variants(plan) -> dict:
    """name -> plan: 1 (a chain), 2 and 3 branches."""
    return {
        f"{b} branch{'es' if b > 1 else ''}{' (as built)' if b == options(plan, 'model').branches else ''}": dataclasses.replace(
            plan.with_options(model={"branches": b}), measured={}
        )
        for b in (1, 2, 3)
    }


def main() -> None:
    args = plan_arguments(__doc__.splitlines()[0])
    prompts, plain_seconds, timed = time_plan_variants(args, lambda p: has_model_part(p), "a model draft", variants)
    print("| variant | vs plain | rounds | leaves accepted / verified | identical |\n|---|---|---|---|---|")
    for key, t in timed.items():
        verified, accepted = t.per_source.get("branch", (0, 0))
        print(
            f"| {key} | {plain_seconds / t.seconds:.3f}x | {t.rounds} | {accepted} / {verified} | "
            f"{t.identical}/{len(prompts)} |"
        )


if __name__ == "__main__":
    main()
