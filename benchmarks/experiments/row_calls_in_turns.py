"""Batched calls of ONNX artifacts timed in turns: n one-token rows, and one verify row of w tokens.

    python benchmarks/experiments/row_calls_in_turns.py ARTIFACT [ARTIFACT ...] [--rows 1,2,4,16] [--verify 5]
        [--context 160] [--repeats 15]

Why: whether one export's graphs (packed rows or not, quantized or not) make a server's calls dearer than
another's is a question of ratios on one machine, so each call shape runs on every artifact in turn, after a
shared past of ``--context`` positions copied into every slot; prints the median milliseconds per call.
"""

from __future__ import annotations

import argparse
import statistics
import time

from speccompile.runtime import load
from speccompile.runtime.backends.slots import batch_of
from speccompile.runtime.decoding.load import shared_past
from speccompile.runtime.segments import Row, full_model


def opened(artifact: str, slots: int, context: int, width: int):
    backend = batch_of(load(artifact, backend="onnx").backend)
    shared_past(backend, slots, context + width + 2, context)
    return backend


def in_turns(backends: dict, rows: list[Row], repeats: int) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in backends}
    for _ in range(repeats):
        for name, backend in backends.items():
            start = time.perf_counter()
            backend.run_rows(full_model(backend.config.num_layers), rows)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) * 1e3 for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifacts", nargs="+")
    parser.add_argument("--rows", default="1,2,4,16")
    parser.add_argument("--verify", type=int, default=5, help="tokens of the one verify row (0: none)")
    parser.add_argument("--context", type=int, default=160)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    counts = [int(n) for n in args.rows.split(",")]
    backends = {a: opened(a, max(counts), args.context, max(args.verify, 1)) for a in args.artifacts}
    for name in backends:  # a warm-up of each shape
        in_turns({name: backends[name]}, [Row(s, args.context, [1]) for s in range(max(counts))], 2)
    print("| call | " + " | ".join(backends) + " |")
    print("|---" * (len(backends) + 1) + "|")
    for n in counts:
        ms = in_turns(backends, [Row(s, args.context, [1]) for s in range(n)], args.repeats)
        print(f"| {n} one-token rows | " + " | ".join(f"{ms[a]:.1f}" for a in backends) + " |")
    if args.verify:
        ms = in_turns(backends, [Row(0, args.context, [1] * args.verify)], args.repeats)
        print(f"| one row of {args.verify} tokens | " + " | ".join(f"{ms[a]:.1f}" for a in backends) + " |")


if __name__ == "__main__":
    main()
