"""The torch int8 twin's variants side by side: SmoothQuant scales or none, int8 or fp16 MLP down
projections, on one torch artifact's precision plans, each timed against plain decoding in turns.

    speccompile build MODEL -o ART --backend torch          # an auto build with a precision plan, or --method precision
    python benchmarks/experiments/twin_variants.py ART [--plans precision,precision-alone] [--prompts FILE] [--max-new-tokens 96]

Every variant runs the artifact's plans unchanged (their draft lengths and thresholds were tuned on the twin the
artifact ships, ``runtime/backends/torch/int8_twin.int8_twin``); only the twin under them changes. Prints, per
variant and plan, the speedup over plain decoding (summed over the prompts, plain and every variant decoded one
after the other on each prompt, in an order that alternates), the rounds, whether each output equals plain decoding,
and the twin's teacher-forced agreement: how often its greedy token is the model's over each prompt's plain
continuation, in one parallel pass (what the first drafted token of a round sees; later ones read the twin's own
KV).
"""

from __future__ import annotations

import argparse

from plan_turns import PROMPTS, read_prompts, time_variants


def variants(decoder) -> dict:
    """name -> twin: what the runtime runs (the artifact's scales), and the two ways of doing without them."""
    import speccompile.runtime.backends.torch.int8_twin as it

    scales = getattr(decoder, "int8_input_scales", None)
    fp16_down = lambda linear, outliers: (it.DynamicFp16Linear if outliers else it.DynamicInt8Linear)(linear)  # noqa: E731
    found = {"shipped twin": it.int8_twin(decoder)}
    if scales:  # the norms' outputs smoothed, the down projections' inputs not (so they keep fp16 weights)
        found["smoothed but down, fp16 down"] = it.twin_with(
            decoder, fp16_down, {name: s for name, s in scales.items() if not name.endswith(".down")}
        )
    found["no smoothing, fp16 down"] = it.twin_with(decoder, fp16_down, None)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact")
    parser.add_argument("--plans", default="precision,precision-alone")
    parser.add_argument("--prompts", default=str(PROMPTS))
    parser.add_argument("--max-new-tokens", type=int, default=96)
    args = parser.parse_args()

    import torch

    import speccompile.runtime.backends.torch.int8_twin as it
    from speccompile.runtime import load

    model = load(args.artifact, backend="torch")
    decoder = model.backend.decoder
    prompts = read_prompts(model, args.prompts)
    plans = {name: model.manifest.plans[name] for name in args.plans.split(",") if name in model.manifest.plans}
    if not plans:
        raise SystemExit(
            f"error: {args.artifact} has none of the plans {args.plans}; it has {', '.join(model.manifest.plans)}"
        )
    twins = variants(decoder)
    runs = {(twin, plan): plans[plan] for twin in twins for plan in plans}
    agreed, positions = {twin: 0 for twin in twins}, [0]

    def agreement(prompt, plain):  # teacher-forced, over the plain continuation
        ids = torch.tensor([prompt + list(plain)])
        with torch.inference_mode():
            target = decoder(ids)[0, len(prompt) - 1 : -1].argmax(-1)
            for twin in twins:
                agreed[twin] += int((twins[twin](ids)[0, len(prompt) - 1 : -1].argmax(-1) == target).sum())
        positions[0] += target.shape[0]

    def swap(run):  # the twin the backend's precision segments run
        it._TWINS[decoder] = twins[run[0]]

    plain_seconds, timed = time_variants(model, runs, prompts, args.max_new_tokens, before=swap, after_plain=agreement)
    print(f"{args.artifact}: {len(prompts)} prompts, {args.max_new_tokens} new tokens, torch, greedy")
    print("| twin | agreement | plan | vs plain | rounds | identical |\n|---|---|---|---|---|---|")
    for (twin, plan), t in timed.items():
        print(
            f"| {twin} | {agreed[twin] / max(positions[0], 1):.3f} | {plan} | {plain_seconds / t.seconds:.3f}x | "
            f"{t.rounds} | {t.identical}/{len(prompts)} |"
        )


if __name__ == "__main__":
    main()
