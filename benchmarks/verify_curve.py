"""What a k-token verify costs against a one-token step, per engine, and where ONNX Runtime spends it.

    python benchmarks/verify_curve.py ARTIFACT [--threads 2] [--max-k 16] [--context 128] [--rounds 7]
                                      [--profile] [--peers openvino,llamacpp] [--products] [--out FILE.json]

ARTIFACT is built with ``--backend torch,onnx`` (``speccompile build MODEL -o ARTIFACT --backend torch,onnx
--method lookup`` is enough: only the full model runs here). Engines, each a backend of this runtime on the
same weights: ONNX Runtime with the artifact's graphs (``fused``: contrib ops, KV in place, weights
prepacked), the portable ``standard`` graphs (re-exported next to the artifact by ``derive``, which
``experiments/onnx_plain.py`` uses too), and the torch backend. For k = 1..max-k every engine runs ``forward`` of k new tokens after
``--context`` cached positions; the calls go round-robin over engines and k for ``--rounds`` rounds and
the minimum per cell is kept (a shared machine only ever adds time), so the ratios compare calls timed
in the same minutes.

With openvino installed, ``OpenVINO f32|bf16 (our standard graph)`` is the artifact's verify graph in its
portable variant, read by ``openvino.Core().read_model``, made stateful (KV kept in OpenVINO variables, the
state restored after every timed call) and compiled by the CPU plugin at that inference precision (bf16
runs on AMX where the CPU has it). (Our fused graph also loads in OpenVINO, but its GroupQueryAttention
returns a ``present`` of the new length, so it cannot keep the cache in place: 46 ms a step here.) ``--peers`` adds, each from its
own venv (``benchmarks/peer_compare.py`` sets them up) and timed in its own process after ours: OpenVINO
GenAI's exported model (``optimum-cli export openvino``, fp32, the stateful IR its pipelines run; KV state
restored before every call) and llama.cpp on the f32 GGUF of the same checkpoint (one k-token batch decode,
cache rolled back before every call).

``--products`` times the products alone, the floor under every curve: 30 pairs of SmolLM2-sized MLP
products (576 -> 3072 -> 576, fp32, 424 MB of weights, more than this machine's caches hold) on k rows,
in four kernel libraries: ONNX Runtime's MLAS (weights prepacked), torch's MKL (``F.linear``), oneDNN
with prepacked weights (``torch.ops.mkldnn._linear_pointwise``) and OpenVINO's CPU plugin (f32).

``--profile`` adds ONNX Runtime's own profiler for the fused graph at k = 1 and k = 8: the time of each
node, grouped into the head's product (the node that reads ``lm_head`` / the tied embedding), the
blocks' products (MatMul, FusedMatMul, MatMulNBits, Gemm), attention (GroupQueryAttention and the
standard graph's attention ops) and everything else, so the rise of the curve is named by component.
"""

from __future__ import annotations

import argparse
import dataclasses
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


def derive(src: Path, dst: Path, options: dict) -> Path:
    """``src`` with its ONNX graphs re-exported with ``options`` (torch weights dropped), unless ``dst`` exists."""
    from speccompile.artifact_writer import read_canonical_weights
    from speccompile.exporters.onnx_export import export_onnx_weights
    from speccompile.runtime.artifact.manifest import TOKENIZER_FILE, file_record, read_manifest, write_manifest

    if (dst / "manifest.json").is_file():
        return dst
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    manifest = read_manifest(src)
    shutil.copytree(src / "tokenizer", tmp / "tokenizer")
    # the files the plans open (retrieval datastore, draft heads) come along, or the manifest does not validate
    plan_files = set(dataclasses.replace(manifest, backends={}).opened_files()) - {TOKENIZER_FILE}
    for relative in sorted(plan_files):
        (tmp / relative).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src / relative, tmp / relative)
    heads = {p.draft_head_file: src / p.draft_head_file for p in manifest.plans.values() if p.draft_head_file}
    record = export_onnx_weights(
        manifest.config,
        read_canonical_weights(src, manifest),
        manifest.plans,
        tmp / "onnx",
        "float32",
        draft_heads=heads,
        **options,
    )
    manifest.backends = {"onnx": record}
    manifest.files = {
        str(p.relative_to(tmp)): file_record(tmp, str(p.relative_to(tmp)))
        for p in sorted(tmp.rglob("*"))
        if p.is_file()
    }
    write_manifest(tmp, manifest)
    shutil.rmtree(dst, ignore_errors=True)
    tmp.rename(dst)
    return dst


def engines(artifact: Path, threads: int) -> dict:
    from speccompile.runtime.artifact.manifest import read_manifest
    from speccompile.runtime.backends.onnx import OnnxBackend
    from speccompile.runtime.backends.torch.backend import TorchBackend

    manifest = read_manifest(artifact)
    found = {}
    if "onnx" in manifest.backends:
        found[f"ORT {manifest.backends['onnx'].get('variant', 'standard')}"] = OnnxBackend(
            artifact, manifest.backends["onnx"], manifest.config, threads=threads, roles=["verify"]
        )
        if manifest.backends["onnx"].get("variant") == "fused":
            standard = derive(
                artifact, artifact.with_name(artifact.name + "-variants") / "standard", {"variant": "standard"}
            )
            m = read_manifest(standard)
            found["ORT standard"] = OnnxBackend(
                standard, m.backends["onnx"], m.config, threads=threads, roles=["verify"]
            )
    if "torch" in manifest.backends:
        import torch

        torch.set_num_threads(threads)
        found["torch"] = TorchBackend.from_files(
            artifact / manifest.backends["torch"]["weights"], manifest.config, manifest.dtype
        )
    if "ORT standard" in found:
        try:
            graph = standard / m.backends["onnx"]["graphs"]["verify"]["file"]
            for precision in ("f32", "bf16"):
                found[f"OpenVINO {precision} (our standard graph)"] = OpenVinoGraph(
                    graph, manifest.config, threads, precision
                )
        except ImportError:
            print("openvino is not installed: no OpenVINO rows (pip install openvino)", file=sys.stderr)
    return found


class OpenVinoGraph:
    """Our standard verify graph on OpenVINO's CPU plugin, made stateful (each layer's KV is an OpenVINO
    variable, as in OpenVINO GenAI's own models), with the ``forward`` that ``curve`` times. After the prefix
    the state is saved; ``rollback`` (called by ``curve`` outside the timing) restores it after every call."""

    def __init__(self, graph: Path, config, threads: int, precision: str):
        import openvino as ov
        from openvino._offline_transformations import apply_make_stateful_transformation

        self.ov, self.config = ov, config
        core = ov.Core()
        model = core.read_model(str(graph))
        apply_make_stateful_transformation(
            model,
            {
                f"past_key_values.{i}.{t}": f"present.{i}.{t}"
                for i in range(config.num_layers)
                for t in ("key", "value")
            },
        )
        self.request = core.compile_model(
            model, "CPU", {"INFERENCE_PRECISION_HINT": precision, "INFERENCE_NUM_THREADS": threads}
        ).create_infer_request()
        self.names = {i.get_any_name() for i in self.request.model_inputs}
        self.saved: list = []

    def reserve(self, max_len: int) -> None:
        pass

    def forward(self, ids: list[int], pos: int) -> None:
        c = self.config
        if pos == 0:  # a new sequence: empty states of batch 1 (the transformation's default has batch 0)
            for state in self.request.query_state():
                state.state = self.ov.Tensor(np.zeros((1, c.num_kv_heads, 0, c.head_dim), np.float32))
        feed = {"input_ids": np.asarray([ids], dtype=np.int64)}
        if "position_ids" in self.names:
            feed["position_ids"] = np.arange(pos, pos + len(ids), dtype=np.int64)[None]
        self.request.infer(feed)
        if pos == 0:
            self.saved = [(state, state.state.data.copy()) for state in self.request.query_state()]

    def rollback(self) -> None:
        for state, data in self.saved:
            state.state = self.ov.Tensor(data)


def products_floor(threads: int, rounds: int, ks=(1, 2, 4, 8, 16)) -> dict[str, dict[int, float]]:
    """Seconds of 30 (576 -> 3072 -> 576) product pairs on k rows, per kernel library, k and library in turns."""
    import onnx
    import onnxruntime as ort
    import torch
    from onnx import TensorProto, helper, numpy_helper

    pairs, d, n = 30, 576, 3072
    rng = np.random.default_rng(0)
    up = [rng.standard_normal((d, n), dtype=np.float32) * 0.02 for _ in range(pairs)]
    down = [rng.standard_normal((n, d), dtype=np.float32) * 0.02 for _ in range(pairs)]
    nodes, weights, x = [], [], "x"
    for i in range(pairs):
        weights += [numpy_helper.from_array(up[i], f"up{i}"), numpy_helper.from_array(down[i], f"down{i}")]
        nodes += [
            helper.make_node("MatMul", [x, f"up{i}"], [f"h{i}"]),
            helper.make_node("MatMul", [f"h{i}", f"down{i}"], [f"y{i}"]),
        ]
        x = f"y{i}"
    graph = helper.make_graph(
        nodes,
        "products",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["k", d])],
        [helper.make_tensor_value_info(x, TensorProto.FLOAT, ["k", d])],
        weights,
    )
    folder = Path(tempfile.mkdtemp(prefix="verify-curve-products-"))
    onnx.save(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]),
        str(folder / "products.onnx"),
        save_as_external_data=True,
        location="products.bin",
    )
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    session = ort.InferenceSession(str(folder / "products.onnx"), options, providers=["CPUExecutionProvider"])
    torch.set_num_threads(threads)
    t_up = [torch.from_numpy(w.T.copy()) for w in up]  # F.linear takes [out, in]
    t_down = [torch.from_numpy(w.T.copy()) for w in down]
    packed = [
        (torch.ops.mkldnn._reorder_linear_weight(a, 8), torch.ops.mkldnn._reorder_linear_weight(b, 8))
        for a, b in zip(t_up, t_down)
    ]

    def mkl(a):
        h = torch.from_numpy(a)
        for w1, w2 in zip(t_up, t_down):
            h = torch.nn.functional.linear(torch.nn.functional.linear(h, w1), w2)

    def onednn(a):
        h = torch.from_numpy(a)
        for w1, w2 in packed:
            h = torch.ops.mkldnn._linear_pointwise(
                torch.ops.mkldnn._linear_pointwise(h, w1, None, "none", [], ""), w2, None, "none", [], ""
            )

    libraries = {
        "ORT MLAS (prepacked)": lambda a: session.run(None, {"x": a}),
        "torch MKL": mkl,
        "oneDNN (prepacked)": onednn,
    }
    try:
        import openvino as ov

        core = ov.Core()
        request = core.compile_model(
            core.read_model(str(folder / "products.onnx")),
            "CPU",
            {"INFERENCE_PRECISION_HINT": "f32", "INFERENCE_NUM_THREADS": threads},
        ).create_infer_request()
        libraries["OpenVINO f32"] = lambda a: request.infer({0: a})
    except ImportError:
        pass
    inputs = {k: rng.standard_normal((k, d), dtype=np.float32) for k in ks}
    best = {name: {k: float("inf") for k in ks} for name in libraries}
    with torch.inference_mode():
        for r in range(rounds + 1):
            for k in ks:
                for name, run in libraries.items():
                    start = time.perf_counter()
                    run(inputs[k])
                    if r:  # round 0 warms up
                        best[name][k] = min(best[name][k], time.perf_counter() - start)
    shutil.rmtree(folder, ignore_errors=True)
    return best


def peer_curves(artifact: Path, peers: list[str], args) -> dict[str, list[float]]:
    """k-token costs of the peers' own models, each measured by its peer script in its own venv."""
    import subprocess

    from peer_compare import PEERS, checkpoint_gguf, llamacpp_gguf, llamacpp_python, openvino_model, venv

    from speccompile.runtime.artifact.manifest import read_manifest

    source = Path(read_manifest(artifact).source["path"])
    common = ["--max-k", args.max_k, "--context", args.context, "--rounds", args.rounds, "--threads", args.threads]
    found = {}
    if "openvino" in peers:
        python = venv(args.venvs, "openvino", ["optimum-intel[openvino]", "openvino-genai"])
        command = [
            python,
            PEERS / "openvino_genai_peer.py",
            openvino_model(args.venvs, source, "fp32"),
            "--curve",
            "--precision",
            "f32",
            *common,
        ]
        found["OpenVINO GenAI model (f32)"] = command
    if "llamacpp" in peers:
        python = llamacpp_python(args.venvs)
        found["llama.cpp f32"] = [
            python,
            PEERS / "llamacpp_peer.py",
            "curve",
            llamacpp_gguf(args.venvs, checkpoint_gguf(None), "f32"),
            *common,
        ]
    return {
        name: json.loads(subprocess.run(list(map(str, command)), check=True, stdout=subprocess.PIPE, text=True).stdout)[
            "seconds"
        ]
        for name, command in found.items()
    }


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
            getattr(backend, "rollback", lambda: None)()
    best = {name: [float("inf")] * max_k for name in backends}
    for r in range(rounds):
        order = list(backends.items())
        order = order[r % len(order) :] + order[: r % len(order)]  # rotate who goes first
        for k, ids in enumerate(inputs):
            for name, backend in order:
                start = time.perf_counter()
                backend.forward(ids, context)
                best[name][k] = min(best[name][k], time.perf_counter() - start)
                getattr(backend, "rollback", lambda: None)()  # a stateful engine's cache back to ``context``
    return best


def profile(artifact: Path, threads: int, context: int, ks=(1, 8), calls: int = 20) -> dict[int, dict[str, float]]:
    """ORT's profiler on the artifact's verify graph: milliseconds per component of one ``forward`` of k
    tokens (mean over ``calls`` calls after a warm-up), one profiled session per k."""
    import onnx
    import onnxruntime as ort

    from speccompile.runtime.artifact.manifest import read_manifest
    from speccompile.runtime.backends.onnx import OnnxBackend

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
        backend.sessions["verify"] = ort.InferenceSession(
            str(artifact / graph["file"]), sess_options=options, providers=["CPUExecutionProvider"]
        )
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
            group = (
                "head product"
                if node in head_nodes
                else "block products"
                if op in PRODUCTS
                else "attention"
                if op in ATTENTION
                else "other"
            )
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
    parser.add_argument("--products", action="store_true", help="also time the products alone in four kernel libraries")
    parser.add_argument("--peers", default="", help="comma-separated: openvino, llamacpp")
    from peer_compare import DEFAULT_VENVS

    parser.add_argument(
        "--venvs",
        type=Path,
        default=DEFAULT_VENVS,
        help="where the peers' venvs live (default artifacts/peers, or env SPECCOMPILE_PEER_VENVS)",
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    backends = engines(args.artifact, args.threads)
    seconds = curve(backends, args.max_k, args.context, args.rounds)
    del backends
    seconds.update(peer_curves(args.artifact, [p for p in args.peers.split(",") if p], args))
    names = list(seconds)
    print(
        f"k-token forward after {args.context} positions, relative to k = 1 (minimum of {args.rounds} rounds in turns)"
    )
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
    if args.products:
        floor = products_floor(args.threads, args.rounds)
        report["products_seconds"] = floor
        libraries = list(floor)
        print("\nThe products alone: 30 pairs 576 -> 3072 -> 576 (424 MB fp32) on k rows, relative to k = 1")
        print("| k | " + " | ".join(libraries) + " |")
        print("|---|" + "---|" * len(libraries))
        for k in next(iter(floor.values())):
            print(f"| {k} | " + " | ".join(f"{floor[n][k] / floor[n][1]:.2f}x" for n in libraries) + " |")
        print("| 1-row ms | " + " | ".join(f"{floor[n][1] * 1e3:.1f}" for n in libraries) + " |")
        print("| 8-row ms | " + " | ".join(f"{floor[n][8] * 1e3:.1f}" for n in libraries) + " |")
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
