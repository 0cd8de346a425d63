"""What a k-token verify costs against a one-token step, per engine, and where ONNX Runtime spends it (issue 21).

    python benchmarks/verify_curve.py ARTIFACT [--threads 2] [--max-k 16] [--context 128] [--rounds 7]
                                      [--profile] [--out FILE.json]

ARTIFACT is built with ``--backend torch,onnx`` (``speccompile build MODEL -o ARTIFACT --backend torch,onnx
--method lookup`` is enough: only the full model runs here). Engines, each a backend of this runtime on the
same weights: ONNX Runtime with the artifact's graphs (``fused``: contrib ops, KV in place, weights
prepacked), the portable ``standard`` graphs (re-exported next to the artifact, as ``onnx_plain.py``
does), and the torch backend. For k = 1..max-k every engine runs ``forward`` of k new tokens after
``--context`` cached positions; the calls go round-robin over engines and k for ``--rounds`` rounds and
the minimum per cell is kept (a shared machine only ever adds time), so the ratios compare calls timed
in the same minutes.

``--profile`` adds ONNX Runtime's own profiler for the fused graph at k = 1 and k = 8: the time of each
node, grouped into the head's product (the node that reads ``lm_head`` / the tied embedding), the
blocks' products (MatMul, FusedMatMul, MatMulNBits, Gemm), attention (GroupQueryAttention and the
standard graph's attention ops) and everything else, so the rise of the curve is named by component.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

PRODUCTS = ("MatMul", "FusedMatMul", "MatMulNBits", "Gemm")
ATTENTION = ("GroupQueryAttention", "MultiHeadAttention", "Attention", "Softmax")


def engines(artifact: Path, threads: int) -> dict:
    from onnx_plain import derive

    from speccompile.runtime.backends.onnx_backend import OnnxBackend
    from speccompile.runtime.backends.torch_backend import TorchBackend
    from speccompile.runtime.manifest import read_manifest

    manifest = read_manifest(artifact)
    found = {}
    if "onnx" in manifest.backends:
        found[f"ORT {manifest.backends['onnx'].get('variant', 'standard')}"] = OnnxBackend(
            artifact, manifest.backends["onnx"], manifest.config, threads=threads, roles=["verify"])
        if manifest.backends["onnx"].get("variant") == "fused":
            standard = derive(artifact, artifact.with_name(artifact.name + "-variants") / "standard",
                              {"variant": "standard"})
            m = read_manifest(standard)
            found["ORT standard"] = OnnxBackend(standard, m.backends["onnx"], m.config, threads=threads, roles=["verify"])
    if "torch" in manifest.backends:
        import torch

        torch.set_num_threads(threads)
        found["torch"] = TorchBackend.from_files(artifact / manifest.backends["torch"]["weights"], manifest.config,
                                                 manifest.dtype)
    return found


def curve(backends: dict, max_k: int, context: int, rounds: int) -> dict[str, list[float]]:
    """Seconds of ``forward`` of k tokens after ``context`` positions, k = 1..max_k, per engine."""
    rng = np.random.default_rng(0)
    first = next(iter(backends.values()))
    vocab = first.config.vocab_size
    prefix = rng.integers(0, vocab, context).tolist()
    inputs = [rng.integers(0, vocab, k).tolist() for k in range(1, max_k + 1)]
    for backend in backends.values():
        backend.reserve(context + max_k)
        backend.forward(prefix, 0)
        for ids in inputs:  # warm-up: first calls allocate and pick kernels
            backend.forward(ids, context)
    best = {name: [float("inf")] * max_k for name in backends}
    for r in range(rounds):
        order = list(backends.items())
        order = order[r % len(order):] + order[: r % len(order)]  # rotate who goes first
        for k, ids in enumerate(inputs):
            for name, backend in order:
                start = time.perf_counter()
                backend.forward(ids, context)
                best[name][k] = min(best[name][k], time.perf_counter() - start)
    return best


def profile(artifact: Path, threads: int, context: int, ks=(1, 8), calls: int = 20) -> dict[int, dict[str, float]]:
    """ORT's profiler on the artifact's verify graph: milliseconds per component of one ``forward`` of k
    tokens (mean over ``calls`` calls after a warm-up), one profiled session per k."""
    import onnx
    import onnxruntime as ort

    from speccompile.runtime.backends.onnx_backend import OnnxBackend
    from speccompile.runtime.manifest import read_manifest

    manifest = read_manifest(artifact)
    record = manifest.backends["onnx"]
    graph = record["graphs"]["verify"]
    model = onnx.load(str(artifact / graph["file"]), load_external_data=False)
    head_nodes = {n.name for n in model.graph.node if {"lm_head.weight", "embed.weight"} & set(n.input)}
    rng = np.random.default_rng(0)
    result: dict[int, dict[str, float]] = {}
    for k in ks:
        # The cache's contents do not change what a call costs: no prefill, every profiled call is a k-token one.
        backend = OnnxBackend(artifact, record, manifest.config, threads=threads, roles=["verify"])
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.enable_profiling = True
        options.profile_file_prefix = str(Path(tempfile.mkdtemp(prefix="verify-curve-")) / "ort")
        for name in graph.get("initializers", []):
            options.add_initializer(name, backend._ortvalues[name])
        backend.sessions["verify"] = ort.InferenceSession(str(artifact / graph["file"]), sess_options=options,
                                                          providers=["CPUExecutionProvider"])
        backend.reserve(context + k)
        ids = rng.integers(0, manifest.config.vocab_size, k).tolist()
        start = time.perf_counter_ns()
        for _ in range(calls):
            backend.forward(ids, context)
        wall = (time.perf_counter_ns() - start) / 1e6 / calls
        trace_file = Path(backend.sessions["verify"].end_profiling())
        trace = json.loads(trace_file.read_text())
        shutil.rmtree(trace_file.parent, ignore_errors=True)
        groups = {"head product": 0.0, "block products": 0.0, "attention": 0.0, "other": 0.0}
        for event in trace:
            if event.get("cat") != "Node" or not event["name"].endswith("_kernel_time"):
                continue
            node, op = event["name"][: -len("_kernel_time")], event.get("args", {}).get("op_name", "")
            group = ("head product" if node in head_nodes else "block products" if op in PRODUCTS
                     else "attention" if op in ATTENTION else "other")
            groups[group] += event["dur"] / 1000 / calls
        groups["outside nodes (wall - nodes)"] = wall - sum(groups.values())
        result[k] = groups
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-k", type=int, default=16)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    backends = engines(args.artifact, args.threads)
    seconds = curve(backends, args.max_k, args.context, args.rounds)
    names = list(seconds)
    print(f"k-token forward after {args.context} positions, relative to k = 1 (minimum of {args.rounds} rounds in turns)")
    print("| k | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for k in range(args.max_k):
        cells = [f"{seconds[n][k] / seconds[n][0]:.2f}x" for n in names]
        print(f"| {k + 1} | " + " | ".join(cells) + " |")
    print("| 1-token ms | " + " | ".join(f"{seconds[n][0] * 1e3:.1f}" for n in names) + " |")
    report = {"seconds": seconds}
    if args.profile:
        parts = profile(args.artifact, args.threads, args.context)
        report["profile_ms"] = parts
        print("\nONNX Runtime profile of the artifact's verify graph, ms per call by component")
        print("| component | k = 1 | k = 8 | k = 8 / k = 1 |")
        print("|---|---|---|---|")
        for group in parts[1]:
            one, eight = parts[1][group], parts[8][group]
            print(f"| {group} | {one:.2f} | {eight:.2f} | {eight / one if one else float('nan'):.2f}x |")
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
