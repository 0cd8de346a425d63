"""How fast could model-free drafting make an artifact on this machine? An upper bound, from the
benchmark prompts themselves.

    python benchmarks/experiments/draft_ceiling.py artifacts/smollm2-onnx      # after benchmarks/real_model.py
    python benchmarks/experiments/draft_ceiling.py artifacts/smollm2-torch --prompts benchmarks/data/smollm2_prompts.jsonl

1. Decodes every prompt plainly with the artifact (its own backend), once: the output any lossless
   drafter must reproduce.
2. Replays every lookup plan of the tuner's grid (n-gram sizes x draft lengths, with and without the
   artifact's retrieval datastore) over those outputs with the runtime's own drafters
   (``passes/replay.py``) and prices the rounds with the step costs the build measured on this backend
   (``manifest.tuning.step_costs``). The best row is tuned *on the test prompts*: no real build can beat
   it, so it bounds what lookup drafting can reach here.
3. Prints what any drafter would need: for a per-token acceptance a (token i of a draft accepted with
   probability a^i, drafts free), the best draft length and speedup under the same verify costs, and
   the smallest a that reaches 1.3x and 1.5x.
The verify-cost column is the reason: where a k-token verify costs much more than one step (a 2-core
CPU is compute-bound beyond a few tokens), drafts must be long *and* accurate to pay.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from speccompile.runtime.drafting import has_model_part, options

BENCHMARKS = Path(__file__).resolve().parent.parent  # benchmarks/ (this script is in benchmarks/experiments/)
REPO = BENCHMARKS.parent
sys.path.insert(0, str(REPO))


@dataclass
class Sequence_:
    """What ``passes.replay.replay`` reads of a calibration reference: the tokens and the prompt length."""

    tokens: np.ndarray  # [1, N]
    prompt_len: int


def plain_outputs(model, prompts: list[list[int]], new_tokens: int) -> list[Sequence_]:
    """Each prompt's plain greedy output, stopping at an end-of-sequence token as ``bench`` does."""
    from speccompile.runtime.decoding.speculative import DecodeRequest, decode_all

    out = []
    for prompt in prompts:
        tokens, _ = decode_all(model.backend, DecodeRequest(prompt, new_tokens, eos_ids=model.eos_ids))
        out.append(Sequence_(np.array([prompt + tokens]), len(prompt)))
    return out


def step_costs(manifest):
    from speccompile.passes.cost_model import StepCosts

    recorded = manifest.tuning.get("step_costs")
    if not recorded:
        sys.exit("the artifact records no step costs (built before they were measured): rebuild it")
    return StepCosts(
        forward=recorded["forward"],
        sublayers=None,
        draft_overhead=recorded["draft_overhead"],
        lookup=recorded["lookup"],
        backend=recorded["backend"],
    )


def ideal_drafter(costs, acceptance: float) -> tuple[int, float]:
    """Best draft length and speedup for free drafts whose i-th token is accepted with acceptance^i."""
    best = (0, 1.0)
    for k in range(1, len(costs.forward)):
        tokens = sum(acceptance**i for i in range(k + 1))
        speedup = tokens * costs.forward[0] / costs.forward[k]
        if speedup > best[1]:
            best = (k, speedup)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--prompts", type=Path, default=BENCHMARKS / "data" / "smollm2_prompts.jsonl")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    args = parser.parse_args()

    from speccompile.passes.lookup_autotune import DATASTORE_FILE, lookup_grid
    from speccompile.passes.replay import estimate_rounds, replay, round_mix
    from speccompile.runtime.model import load

    model = load(args.artifact)
    costs = step_costs(model.manifest)
    texts = [json.loads(line)["prompt"] for line in args.prompts.read_text().splitlines() if line.strip()]
    sequences = plain_outputs(model, [model.tokenizer.encode(t) for t in texts], args.max_new_tokens)
    has_datastore = (args.artifact / DATASTORE_FILE).exists()

    print(
        f"# draft ceiling: {args.artifact.name} on {costs.backend}, {len(sequences)} prompts x "
        f"{args.max_new_tokens} new tokens\n"
    )
    ratios = [f / costs.forward[0] for f in costs.forward]
    print(
        "verify cost / one step, by tokens verified: "
        + ", ".join(f"{k}: {ratios[k - 1]:.2f}" for k in (2, 3, 4, 6, 8, 13) if k <= len(ratios))
        + "\n"
    )

    rows = []
    for plan in lookup_grid(has_datastore):
        rounds = replay(plan, sequences, None, args.artifact)
        rows.append((estimate_rounds(rounds, plan, costs), plan, round_mix(rounds)))
    rows.sort(key=lambda row: -row[0].expected_speedup)
    own = model.manifest.plans.get(model.manifest.default_plan)
    if own is not None and own.lookup and not has_model_part(own):
        rounds = replay(own, sequences, None, args.artifact)
        rows.insert(0, (estimate_rounds(rounds, own, costs), own, round_mix(rounds)))

    print("| lookup plan | tokens / round | rounds with a draft | acceptance | expected speedup |")
    print("|---|---|---|---|---|")
    for i, (estimate, plan, mix) in enumerate(rows[:8]):
        label = f"{'+'.join(plan.lookup)} n {options(plan, 'ngram').max}..{options(plan, 'ngram').min}, draft {plan.lookup_max_draft}"
        label += f", 1 after a match of <= {options(plan, 'ngram').short}" if options(plan, "ngram").short else ""
        if i == 0 and own is not None and plan is own:
            label = f"the artifact's plan ({label})"
        print(
            f"| {label} | {estimate.tokens_per_round:.3f} | {1 - mix.get('none', 0.0):.2f} | "
            f"{estimate.acceptance_rate:.3f} | {estimate.expected_speedup:.3f}x |"
        )

    print("\n| per-token acceptance a | best draft length | speedup (free drafts) |")
    print("|---|---|---|")
    needed = {}
    for a in np.round(np.arange(0.3, 0.96, 0.05), 2):
        k, speedup = ideal_drafter(costs, float(a))
        print(f"| {a:.2f} | {k} | {speedup:.3f}x |")
    for goal in (1.3, 1.5):
        grid = np.arange(0.01, 1.0, 0.01)
        reach = [a for a in grid if ideal_drafter(costs, float(a))[1] >= goal]
        needed[goal] = f"{reach[0]:.2f}" if reach else "none below 1"
    print(
        f"\nsmallest per-token acceptance for 1.3x: {needed[1.3]}; for 1.5x: {needed[1.5]} "
        f"(free drafts, these verify costs)"
    )


if __name__ == "__main__":
    main()
