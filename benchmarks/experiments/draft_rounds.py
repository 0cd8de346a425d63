"""What a model draft's steps and the verify after them cost when they alternate as a round runs them, against
the same calls back-to-back, with ONNX Runtime's threads stopping their spin after each call (the
default) and without (``SPECCOMPILE_ORT_SPIN_STOP=0``), each in processes of its own, in turns.

    python benchmarks/experiments/draft_rounds.py ART [--plan NAME] [--draft-tokens 4] [--turns 2] [--backend onnx]

Per turn and setting it prints: the plain step and a (k+1)-token verify back-to-back, one draft step and the
verify's cost after the draft steps relative to back-to-back (``cost_model.measure_draft_rounds``), and plain
decoding's tokens/s on six benchmark prompts (64 new tokens), so that the setting's cost to plain decoding
shows next to what it saves a draft.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from speccompile.runtime.drafting import has_model_part

BENCHMARKS = Path(__file__).resolve().parent.parent  # benchmarks/ (this script is in benchmarks/experiments/)


def measure(args) -> dict:
    import numpy as np

    from speccompile.bench import load_prompts
    from speccompile.passes.cost_model import _best_seconds, measure_draft_rounds
    from speccompile.runtime import load

    model = load(args.artifact, backend=args.backend)
    backend, k = model.backend, args.draft_tokens
    plan = model.manifest.plan(args.plan)
    if not has_model_part(plan):
        raise SystemExit(f"plan {plan.name!r} has no model draft; pass --plan with one (precision, early exit, ...)")
    rng = np.random.default_rng(0)
    backend.reserve(256)
    backend.forward(rng.integers(0, backend.config.vocab_size, 128).tolist(), 0)
    ids = [rng.integers(0, backend.config.vocab_size, t).tolist() for t in range(1, k + 2)]
    full = [min(_best_seconds(lambda: backend.forward(x, 128)) for _ in range(7)) for x in ids]

    class Costs:  # what measure_draft_rounds reads and writes
        draft_steps, verify_after_draft = {}, {}

        @staticmethod
        def full(t):
            return full[t - 1]

    draft, factor = measure_draft_rounds(backend, Costs, plan, k, rounds=8)
    texts, _ = load_prompts(args.prompts, model.manifest)
    prompts = [model.encode_prompt(t) for t in texts[:6]]
    model.generate(prompts[0], max_new_tokens=8, speculate=False)
    tokens = seconds = 0
    for p in prompts:
        result = model.generate(p, max_new_tokens=64, speculate=False)
        tokens, seconds = tokens + len(result.token_ids), seconds + result.stats.seconds
    return {
        "plain_step_ms": full[0] * 1e3,
        "verify_ms": full[k] * 1e3,
        "draft_step_ms": draft * 1e3,
        "verify_after_draft": factor,
        "plain_tok_s": tokens / seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--plan", default=None, help="a plan with a model draft (default: the artifact's default plan)")
    parser.add_argument("--backend", default="onnx")
    parser.add_argument("--draft-tokens", type=int, default=4)
    parser.add_argument("--turns", type=int, default=2)
    parser.add_argument("--prompts", default=str(BENCHMARKS / "data" / "smollm2_prompts.jsonl"))
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args)))
        return
    rows = []
    for turn in range(args.turns):
        for spin_stop in ("1", "0") if turn % 2 == 0 else ("0", "1"):
            out = subprocess.run(
                [sys.executable, __file__, *sys.argv[1:], "--child"],
                capture_output=True,
                text=True,
                env={**os.environ, "SPECCOMPILE_ORT_SPIN_STOP": spin_stop},
                check=True,
            )
            row = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append((spin_stop, row))
            print(
                f"turn {turn + 1}, spinning {'stopped after each call' if spin_stop == '1' else 'onnxruntime default  '}: "
                f"plain step {row['plain_step_ms']:.1f} ms, {args.draft_tokens + 1}-token verify {row['verify_ms']:.1f} ms "
                f"back-to-back, draft step {row['draft_step_ms']:.1f} ms, verify after the drafts "
                f"{row['verify_after_draft']:.2f}x back-to-back, plain decoding {row['plain_tok_s']:.1f} tok/s",
                flush=True,
            )


if __name__ == "__main__":
    main()
