"""The torch int8 twin's variants side by side (issue 22): SmoothQuant scales or none, int8 or fp16 MLP down
projections, on one torch artifact's precision plans, each timed against plain decoding in turns.

    speccompile build MODEL -o ART --backend torch          # an auto build with a precision plan, or --method precision
    python benchmarks/twin_variants.py ART [--plans precision,precision-alone] [--prompts FILE] [--max-new-tokens 96]

Every variant runs the artifact's plans unchanged (their draft lengths and thresholds were tuned on the twin the
artifact ships, ``runtime/int8_twin.int8_twin``); only the twin under them changes. Prints, per variant and plan,
the speedup over plain decoding (summed over the prompts, plain and every variant decoded one after the other on
each prompt, in an order that alternates), the rounds, whether each output equals plain decoding, and the twin's
teacher-forced agreement: how often its greedy token is the model's over each prompt's plain continuation, in
one parallel pass (what the first drafted token of a round sees; later ones read the twin's own KV).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def variants(decoder) -> dict:
    """name -> twin: what the runtime runs (the artifact's scales), and the two ways of doing without them."""
    import speccompile.runtime.int8_twin as it

    scales = getattr(decoder, "int8_input_scales", None)
    fp16_down = lambda linear, outliers: (it.DynamicFp16Linear if outliers else it.DynamicInt8Linear)(linear)  # noqa: E731
    found = {"shipped twin": it.int8_twin(decoder)}
    if scales:  # the norms' outputs smoothed, the down projections' inputs not (so they keep fp16 weights)
        found["smoothed but down, fp16 down"] = it.twin_with(
            decoder, fp16_down, {name: s for name, s in scales.items() if not name.endswith(".down")})
    found["no smoothing, fp16 down"] = it.twin_with(decoder, fp16_down, None)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact")
    parser.add_argument("--plans", default="precision,precision-alone")
    parser.add_argument("--prompts", default=str(HERE / "data" / "smollm2_prompts.jsonl"))
    parser.add_argument("--max-new-tokens", type=int, default=96)
    args = parser.parse_args()

    import torch

    import speccompile.runtime.int8_twin as it
    from speccompile.runtime import load
    from speccompile.runtime.speculative import DecodeRequest, decode_all

    model = load(args.artifact, backend="torch")
    backend, decoder = model.backend, model.backend.decoder
    prompts = [model.tokenizer.encode(json.loads(line)["prompt"]) for line in open(args.prompts) if line.strip()]
    plans = {name: model.manifest.plans[name] for name in args.plans.split(",") if name in model.manifest.plans}
    if not plans:
        raise SystemExit(f"error: {args.artifact} has none of the plans {args.plans}; it has {', '.join(model.manifest.plans)}")
    twins = variants(decoder)
    runs = [(twin, plan) for twin in twins for plan in plans]
    plain_seconds, seconds = 0.0, {run: 0.0 for run in runs}
    rounds, same = {run: 0 for run in runs}, {run: 0 for run in runs}
    agreed, positions = {twin: 0 for twin in twins}, 0
    decode_all(backend, DecodeRequest(prompts[0], 8), None, model.root)  # warm-up
    for i, prompt in enumerate(prompts):
        start = time.perf_counter()
        plain, _ = decode_all(backend, DecodeRequest(prompt, args.max_new_tokens), None, model.root)
        plain_seconds += time.perf_counter() - start
        ids = torch.tensor([prompt + list(plain)])
        with torch.inference_mode():
            target = decoder(ids)[0, len(prompt) - 1 : -1].argmax(-1)
            for twin in twins:
                agreed[twin] += int((twins[twin](ids)[0, len(prompt) - 1 : -1].argmax(-1) == target).sum())
        positions += target.shape[0]
        for twin, plan in runs if i % 2 == 0 else runs[::-1]:
            it._TWINS[decoder] = twins[twin]  # the twin the backend's precision segments run
            start = time.perf_counter()
            out, stats = decode_all(backend, DecodeRequest(prompt, args.max_new_tokens), plans[plan], model.root)
            seconds[(twin, plan)] += time.perf_counter() - start
            rounds[(twin, plan)] += stats.rounds
            same[(twin, plan)] += out == plain
    print(f"{args.artifact}: {len(prompts)} prompts, {args.max_new_tokens} new tokens, torch, greedy")
    print("| twin | agreement | plan | vs plain | rounds | identical |\n|---|---|---|---|---|---|")
    for twin, plan in runs:
        print(f"| {twin} | {agreed[twin] / max(positions, 1):.3f} | {plan} | {plain_seconds / seconds[(twin, plan)]:.3f}x | "
              f"{rounds[(twin, plan)]} | {same[(twin, plan)]}/{len(prompts)} |")


if __name__ == "__main__":
    main()
