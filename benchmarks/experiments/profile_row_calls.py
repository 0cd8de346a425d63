"""Where a batched call's time goes on ONNX Runtime: its profiler over calls of n one-token rows, per operator.

    python benchmarks/experiments/profile_row_calls.py ARTIFACT [--rows 1,16] [--context 160] [--calls 20]

Why: a quantized target's throughput under load is bounded by how its kernels grow with the rows of a call
(MatMulNBits, GroupQueryAttention per sequence and head), which the call's total time does not show. Each
row count opens the artifact with profiling on, computes a shared past in every slot, warms up, then profiles
``--calls`` calls; only the operators of those calls are summed (the past's prefill is left out).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import tempfile
import time


def profile(artifact: str, rows: int, context: int, calls: int) -> tuple[float, collections.Counter]:
    import onnxruntime as ort

    from speccompile.runtime import load
    from speccompile.runtime.backends.slots import batch_of
    from speccompile.runtime.decoding.load import shared_past
    from speccompile.runtime.segments import Row, full_model

    prefix = os.path.join(tempfile.mkdtemp(), "profile")
    plain_options = ort.SessionOptions

    class Profiled(plain_options):  # the backend makes its own session options: profile every session it opens
        def __init__(self):
            super().__init__()
            self.enable_profiling = True
            self.profile_file_prefix = prefix

    ort.SessionOptions = Profiled
    try:
        backend = batch_of(load(artifact, backend="onnx").backend)
    finally:
        ort.SessionOptions = plain_options
    full = full_model(backend.config.num_layers)
    shared_past(backend, rows, context + 4, context)
    step = [Row(s, context, [1]) for s in range(rows)]
    for _ in range(5):
        backend.run_rows(full, step)
    seconds = []
    for _ in range(calls):
        start = time.perf_counter()
        backend.run_rows(full, step)
        seconds.append(time.perf_counter() - start)
    per_op: collections.Counter = collections.Counter()
    for session in backend.sessions.values():
        path = session.end_profiling()
        events = json.loads(open(path).read())
        runs = sorted(
            (e for e in events if e.get("cat") == "Session" and e["name"] == "model_run"), key=lambda e: e["ts"]
        )
        if len(runs) >= calls:
            first = runs[-calls]["ts"]
            for e in events:
                if e.get("cat") == "Node" and e["name"].endswith("_kernel_time") and e["ts"] >= first:
                    per_op[e["args"]["op_name"]] += e["dur"] / calls / 1e3  # ms per call
        os.remove(path)
    return statistics.median(seconds) * 1e3, per_op


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact")
    parser.add_argument("--rows", default="1,16")
    parser.add_argument("--context", type=int, default=160)
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args()
    results = {n: profile(args.artifact, n, args.context, args.calls) for n in map(int, args.rows.split(","))}
    ops = sorted(
        {op for _, per_op in results.values() for op in per_op}, key=lambda op: -max(r[1][op] for r in results.values())
    )
    print("| operator | " + " | ".join(f"{n} rows (ms per call)" for n in results) + " |")
    print("|---" * (len(results) + 1) + "|")
    for op in ops[:8]:
        print(f"| {op} | " + " | ".join(f"{per_op[op]:.2f}" for _, per_op in results.values()) + " |")
    print("| whole call, median (profiled) | " + " | ".join(f"{ms:.1f}" for ms, _ in results.values()) + " |")


if __name__ == "__main__":
    main()
