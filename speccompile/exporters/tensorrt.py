"""Build TensorRT engines from the exported ONNX graphs (``--backend tensorrt``), with the TensorRT Python API.

Route chosen: our own engines from our own ONNX graphs, not ONNX Runtime's TensorRT execution provider.
The ORT EP builds its engines (and their weight copies) inside each session at first run, per shape
range it happens to see, and keeps the KV traffic inside ORT; building the engines here lets the
artifact carry them prebuilt with known profiles, weight-stripped (every weight stays once in
``onnx/weights.bin``), guarded by the GPU and TensorRT version they were built for, and lets the
runtime keep the KV cache in its own device buffers (``runtime/backends/tensorrt/backend.py``).

- One engine per graph the plans need (``verify``, ``skip.<plan>``, ``prefix.E`` / ``suffix.E`` /
  ``head``), parsed from the *standard* ONNX graphs (ONNX ops only: TensorRT's parser does not know
  ONNX Runtime's contrib ops). When every plan exits at the same block E there is no ``verify``
  engine: the runtime runs prefix(E) then suffix(E), so the device holds each weight once.
- Two optimization profiles per engine (``profile_shapes``): ``step`` (1..S tokens, S = the longest
  verify the plans can ask for) and ``prefill`` (1..P tokens, longer prompts run in chunks), both over
  past lengths 0..context-1, ``context`` being the model's, capped (``DEFAULT_CONTEXT_CAP``) because
  TensorRT sizes activation memory for the largest shapes.
- ``BuilderFlag.FP16`` (weakly typed network: layers may run in fp16, I/O stays as exported), one
  timing cache shared by all engines of the build and stored with them, ``STRIP_PLAN`` +
  ``REFIT_IDENTICAL`` (the engine keeps no weights; the runtime refits the identical weights at load).
- The manifest records the GPU name, compute capability and TensorRT version (the runtime refuses any
  other) and every engine's profiles.

Engines must be built on the GPU that runs them. ``python -m speccompile.exporters.tensorrt ARTIFACT`` adds
them to an existing ONNX artifact *without torch* (tensorrt + cuda-python + numpy only): build the ONNX
artifact on a workstation, copy it to the device (a Jetson), add the engines there.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable

from speccompile.runtime.artifact.manifest import ArchConfig, DraftPlan
from speccompile.runtime.backends.graph_index import full_model_without_verify
from speccompile.runtime.drafting import read_plans
from speccompile.runtime.errors import SpeccompileError

ENGINE_DIR = "tensorrt"
TIMING_CACHE = f"{ENGINE_DIR}/timing.cache"
DEFAULT_CONTEXT_CAP = 4096
PREFILL_TOKENS = 256
MIN_STEP_TOKENS = 8
FORMAT_VERSION = 1


def require_tensorrt():
    """TensorRT and cuda-python, or the one-line error naming the install (checked before a build starts)."""
    from speccompile.runtime.backends.tensorrt.backend import tensorrt_module
    from speccompile.runtime.backends.tensorrt.cuda import cuda_runtime

    trt = tensorrt_module()
    cuda_runtime()
    return trt


def engine_context(config: ArchConfig, cap: int = DEFAULT_CONTEXT_CAP) -> int:
    """Positions the engines cover: the model's context, capped (activation memory follows the largest shape)."""
    return max(2, min(int(config.max_position_embeddings), cap))


def step_tokens(plans: dict[str, DraftPlan], context: int) -> int:
    """The longest verify a round of these plans can ask for: 1 + model draft + lookup draft. Every plan counts,
    lookup-only ones too: they have no graphs of their own but their verifies run the engines."""
    room = 0
    for plan in read_plans(plans).values():
        model = plan.model.max_draft if plan.has_model_part else 0
        lookup = plan.lookup_max_draft if plan.lookup else 0
        room = max(room, model + lookup)
    return max(1, min(context, max(MIN_STEP_TOKENS, room + 1)))


def profile_shapes(
    graph: dict[str, Any], context: int, step: int, prefill: int, decodes_one: bool = True
) -> list[dict]:
    """``[step, prefill]`` profiles of one graph: per input name, ``(min, opt, max)`` shapes.

    Symbolic dims of the exported graphs: ``batch`` (always 1 here), ``seq`` (tokens of the call) and
    ``past_len`` (cached positions before it). ``decodes_one``: the graph mostly runs one token (draft
    graphs, prefix, head, the decode step); the suffix mostly runs a whole verify."""
    prefill = max(1, min(prefill, context))
    step = max(1, min(step, context))
    seq_ranges = [(1, 1 if decodes_one else max(1, (step + 1) // 2), step), (1, min(prefill, 64), prefill)]
    past_opt = [min(context - 1, 256), 0]
    profiles = []
    for (seq_min, seq_opt, seq_max), p_opt in zip(seq_ranges, past_opt):
        ranges = {"batch": (1, 1, 1), "seq": (seq_min, seq_opt, seq_max), "past_len": (0, p_opt, context - 1)}
        shapes = {}
        for spec in graph["inputs"]:
            dims = [ranges[d] if isinstance(d, str) else (d, d, d) for d in spec["shape"]]
            shapes[spec["name"]] = [list(x) for x in zip(*dims)]  # [min_shape, opt_shape, max_shape]
        profiles.append(shapes)
    return profiles


def _check(ok, what: str) -> None:
    if not ok:
        raise SpeccompileError(
            f"TensorRT could not {what}; rerun with --debug for TensorRT's log, or use --backend onnx"
        )


def build_engines(
    root: Path,
    onnx_record: dict,
    plans: dict[str, DraftPlan],
    config: ArchConfig,
    device: str = "cuda",
    fp16: bool = True,
    context_cap: int = DEFAULT_CONTEXT_CAP,
    log: Callable[[str], None] = lambda m: None,
) -> dict:
    """Build one engine per graph of ``onnx_record`` (files relative to ``root``) into ``root/tensorrt``;
    return the manifest's ``backends["tensorrt"]`` record."""
    from speccompile.runtime.backends.tensorrt.cuda import CudaMemory

    trt = require_tensorrt()
    fp16 = fp16 and hasattr(trt.BuilderFlag, "FP16")  # TensorRT 11 dropped it (strongly typed networks only)
    index = int(device.partition(":")[2] or 0) if str(device).startswith("cuda") else 0
    gpu = CudaMemory(index).info()
    root = Path(root)
    (root / ENGINE_DIR).mkdir(parents=True, exist_ok=True)
    context = engine_context(config, context_cap)
    step, prefill = step_tokens(plans, context), min(PREFILL_TOKENS, context)
    split = full_model_without_verify(
        onnx_record, plans, config.num_layers
    )  # e.g. early exits at one block: no verify engine
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    timing_cache = None
    engines = {}
    for key, graph in onnx_record["graphs"].items():
        if split is not None and key == "verify":
            continue
        network = builder.create_network(0)  # explicit batch is the only mode in TensorRT 10
        parser = trt.OnnxParser(network, logger)
        if not parser.parse_from_file(str(root / graph["file"])):
            first = str(parser.get_error(0)) if parser.num_errors else "unknown error"
            raise SpeccompileError(
                f"TensorRT could not parse {graph['file']} ({first.splitlines()[0][:160]}); "
                "use --backend onnx for this model"
            )
        builder_config = builder.create_builder_config()
        if fp16:
            builder_config.set_flag(trt.BuilderFlag.FP16)
        builder_config.set_flag(trt.BuilderFlag.STRIP_PLAN)
        builder_config.set_flag(trt.BuilderFlag.REFIT_IDENTICAL)
        if timing_cache is None:
            timing_cache = builder_config.create_timing_cache(b"")
        _check(builder_config.set_timing_cache(timing_cache, ignore_mismatch=False), "use its timing cache")
        shapes = profile_shapes(graph, context, step, prefill, decodes_one=not key.startswith("suffix."))
        for profile_shapes_ in shapes:
            profile = builder.create_optimization_profile()
            for name, (low, opt, high) in profile_shapes_.items():
                profile.set_shape(name, low, opt, high)
            builder_config.add_optimization_profile(profile)
        log(f"building TensorRT engine {key} ({'fp16' if fp16 else 'fp32'}, weight-stripped)")
        serialized = builder.build_serialized_network(network, builder_config)
        _check(serialized is not None, f"build an engine for graph {key}")
        relative = f"{ENGINE_DIR}/{key}.engine"
        with open(root / relative, "wb") as handle:
            handle.write(serialized)
        engines[key] = {"file": relative, "profiles": {"step": shapes[0], "prefill": shapes[1]}}
    with open(root / TIMING_CACHE, "wb") as handle:
        handle.write(timing_cache.serialize())
    target = {"gpu": gpu.name, "compute_capability": gpu.compute_capability, "tensorrt_version": trt.__version__}
    record = backend_record(onnx_record, target, engines, context, step, prefill, fp16)
    record["timing_cache_file"] = TIMING_CACHE
    return record


def backend_record(
    onnx_record: dict, target: dict, engines: dict, context: int, step: int, prefill: int, fp16: bool = True
) -> dict:
    """The manifest's ``backends["tensorrt"]``: where the engines are, what they were built for and with
    which profiles, plus the ONNX graph table and the one weights file they are refitted from, and (``full_split``)
    the graphs that compute the full model where no ``verify`` engine is built."""
    return {
        "format_version": FORMAT_VERSION,
        "builder": "speccompile.exporters.tensorrt (TensorRT Python API)",
        "target": target,
        "precision": "fp16" if fp16 else "fp32",
        "weight_stripped": True,
        "context": context,
        "profiles": {"step": {"max_tokens": step}, "prefill": {"max_tokens": prefill}},
        "full_split": full_model_without_verify(onnx_record, {}),
        "engines": engines,
        **{k: onnx_record[k] for k in ("dtype", "opset", "weights", "weights_bytes", "tensors", "graphs", "plans")},
    }


def export_tensorrt(
    root: Path,
    ir,
    onnx_record: dict | None,
    plans: dict[str, DraftPlan],
    log: Callable[[str], None] = lambda m: None,
) -> dict:
    """The ``tensorrt`` backend files of ``ir`` under ``root``: reuses the artifact's standard ONNX
    export when there is one, else exports standard graphs (into ``onnx/`` or, next to a fused ONNX
    export, ``tensorrt/onnx/``) and builds the engines from them. ``plans``: every plan of the artifact;
    graphs are exported for those with a model part (as the ONNX backend's are), and the engines' step
    profile covers every plan's verify."""
    if onnx_record is None or onnx_record.get("variant", "standard") != "standard":
        from speccompile.artifact_writer import model_plans
        from speccompile.exporters.onnx_export import export_onnx_weights

        folder = root / ("onnx" if onnx_record is None else f"{ENGINE_DIR}/onnx")
        dtype = "float16" if ir.dtype == "float16" else "float32"
        onnx_record = export_onnx_weights(
            ir.config, ir.weights, model_plans(plans), folder, dtype, relative_to=root, variant="standard"
        )
    return build_engines(root, onnx_record, plans, ir.config, device=getattr(ir, "device", "cuda"), log=log)


def add_engines(root: Path, device: str = "cuda", log: Callable[[str], None] = lambda m: None) -> dict:
    """Build the TensorRT engines of an existing artifact from its standard ONNX graphs, here, and add
    the ``tensorrt`` backend to its manifest (rewritten atomically). Needs no torch."""
    from speccompile.runtime.artifact.manifest import MANIFEST_NAME, file_record, read_manifest
    from speccompile.runtime.errors import ArtifactError

    root = Path(root)
    manifest = read_manifest(root)
    onnx_record = manifest.backends.get("onnx")
    if onnx_record is None or onnx_record.get("variant", "standard") != "standard":
        raise ArtifactError(
            f"{str(root)!r} has no standard ONNX graphs to build TensorRT engines from; rebuild it with "
            "--backend onnx (or --backend tensorrt on this machine)"
        )
    require_tensorrt()
    record = build_engines(root, onnx_record, manifest.plans, manifest.config, device=device, log=log)
    manifest.backends["tensorrt"] = record
    for relative in [entry["file"] for entry in record["engines"].values()] + [record["timing_cache_file"]]:
        manifest.files[relative] = file_record(root, relative)
    manifest.validate()  # the new files are listed and confined to the artifact
    tmp = root / f".{MANIFEST_NAME}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(manifest.to_dict(), indent=2) + "\n")
    os.replace(tmp, root / MANIFEST_NAME)
    return record


def write_tensorrt_files(root: Path, ir, records: dict, onnx_memory: dict | None = None) -> dict:
    """The TensorRT descriptor's writer (``runtime/backends/tensorrt/descriptor.py``): engines built from the
    standard ONNX graphs (the artifact's, when ``records`` has them), refitted from their weights at load."""
    return export_tensorrt(root, ir, records.get("onnx"), ir.plans)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m speccompile.exporters.tensorrt",
        description="Add TensorRT engines to an ONNX artifact, on the GPU that will run it (no torch needed).",
    )
    parser.add_argument("artifact")
    parser.add_argument("--device", default="cuda", help="cuda or cuda:N (default: cuda)")
    args = parser.parse_args(argv)
    try:
        record = add_engines(Path(args.artifact), args.device, log=lambda m: print(m, file=sys.stderr))
    except SpeccompileError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    target = record["target"]
    print(
        f"added {len(record['engines'])} TensorRT engines for {target['gpu']} (TensorRT {target['tensorrt_version']}) "
        f"to {args.artifact}"
    )
    return 0


__all__ = [
    "ENGINE_DIR",
    "add_engines",
    "backend_record",
    "build_engines",
    "engine_context",
    "export_tensorrt",
    "profile_shapes",
    "require_tensorrt",
    "step_tokens",
    "write_tensorrt_files",
]


if __name__ == "__main__":
    sys.exit(main())
