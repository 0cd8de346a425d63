"""Export the canonical decoder to ONNX graphs that share one external weights file.

Which graphs: the full model (``verify``), then, for every plan, the graphs its draft kind's segments
need (``DraftKind.segments()``: the exporter never asks what a plan is). A segment is one graph when the
variant can end it in the shared head (``LOGITS``), otherwise a blocks graph ending in a hidden state and a
head graph (the shared ``head``, or the plan's ``draft_head.<name>``). Graph keys name what they compute:
``prefix.<E>`` (blocks 0..E-1 to a hidden state), ``suffix.<E>`` (blocks E.. from one), ``skip.<plan>`` /
``skip_hidden.<plan>`` (blocks less a plan's skipped sublayers; plans that skip the same sublayers share
one graph). Every graph record carries its ``segment``, which the backends look graphs up by
(``runtime/backends/graph_index.py``).

Names follow optimum: ``input_ids``, ``past_key_values.{i}.key/value``, ``logits``, ``present.{i}.key/value``;
KV layout ``[batch, kv_heads, len, head_dim]``; dynamic batch / seq / past. Every initializer is stored as
external data in ``weights.bin`` next to the graphs (64-byte aligned, de-duplicated by dtype + shape +
bytes). The manifest record lists every tensor's offset, so a runtime can read the file once and hand the
same buffers to every session (``runtime/backends/onnx/backend.py``).
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto

from speccompile.runtime.artifact.manifest import ArchConfig, DraftPlan
from speccompile.runtime.drafting import read_plan
from speccompile.runtime.segments import FINAL_HEAD, Segment, full_model, parse_precision

from .onnx_blocks import HIDDEN, LAST_HIDDEN, LOGITS, build_blocks, draft_head_graph, load_draft_head
from .onnx_fused import FusedGraph
from .onnx_graph import NP_TO_ONNX, OPSET, GraphBuilder
from .onnx_quant import DEFAULT_ACCURACY_LEVEL, DEFAULT_BLOCK_SIZE, QUANT_BITS, QUANTIZED_COPY, Quantizer

WEIGHTS_NAME = "weights.bin"
ALIGN = 64
FORMAT_VERSION = 1
VARIANTS = ("standard", "fused")

_DTYPE_NAMES = {
    np.dtype(np.float32): "float32",
    np.dtype(np.float16): "float16",
    np.dtype(np.int64): "int64",
    np.dtype(np.uint8): "uint8",
}


def fused_supports(config: ArchConfig) -> bool:
    """Whether the fused variant covers this model. Every canonical block does since the block schedule is
    shared (``onnx_blocks``): pre-norms, post-norms, both, q/k norm per head or over the projection."""
    return config.decoder == "canonical"


def safe_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)


class _Lowering:
    """Segments -> graphs of one variant, each built once; ``graphs`` in the order they were needed."""

    def __init__(
        self,
        config: ArchConfig,
        dtype: np.dtype,
        weights: dict[str, np.ndarray],
        graph_class: type[GraphBuilder],
        graph_options: dict[str, Any],
        draft_heads: dict[str, Path] | None,
    ):
        self.config, self.dtype, self.weights, self.draft_heads = config, dtype, weights, draft_heads
        self.graph_class, self.graph_options = graph_class, graph_options
        self.graphs: dict[str, GraphBuilder] = {}
        self.segments: dict[str, dict[str, Any]] = {}
        self._by_blocks: dict[tuple, str] = {}  # (blocks, output) -> key: plans that skip the same sublayers share

    def segment(self, segment: Segment, plan: DraftPlan | None) -> list[str]:
        """The graph keys that compute ``segment`` (``plan`` names the graphs only it needs); none when this
        variant cannot (a precision segment needs the fused variant's ``MatMulNBits``): the backend then
        refuses the plan in one line (and float32 weights, which the quantizer reads)."""
        if segment.precision is not None and not (
            issubclass(self.graph_class, FusedGraph) and self.dtype == np.float32
        ):
            return []
        if (
            segment.head == FINAL_HEAD
            and not segment.keep_hidden
            and (segment.from_tokens or self.graph_class.head_after_hidden)
        ):
            return [self._blocks(segment, LOGITS, plan)]
        body = self._blocks(segment, HIDDEN if segment.from_tokens else LAST_HIDDEN, plan)
        if segment.head is None:
            return [body]
        return [body, self._head(segment.head, plan)]

    def _blocks(self, segment: Segment, output: str, plan: DraftPlan | None) -> str:
        L, blocks = self.config.num_layers, segment.blocks_key
        if (blocks, output) in self._by_blocks:
            return self._by_blocks[(blocks, output)]
        start, stop, skip_attn, skip_mlp, precision = blocks
        if skip_attn or skip_mlp:
            key = f"{'skip' if output == LOGITS else 'skip_hidden'}.{safe_name(plan.name)}"
        elif start == 0 and stop == L and output == LOGITS:
            key = "verify" if precision is None else "draft"
        elif start == 0:
            key = f"prefix.{stop}" if output != LOGITS else f"exit.{stop}"
        else:
            key = f"suffix.{start}"
        if precision is not None:
            key = safe_name(f"{key}.{precision}")
        graph = self._new(key, precision)
        self.graphs[key] = build_blocks(
            graph, start, stop, frozenset(skip_attn), frozenset(skip_mlp), segment.from_tokens, output
        )
        record = {"start": start, "stop": stop}
        if skip_attn or skip_mlp:
            record.update(skip_attn=list(skip_attn), skip_mlp=list(skip_mlp))
        if precision is not None:
            record["precision"] = precision
        self.segments[key] = record
        self._by_blocks[(blocks, output)] = key
        return key

    def _new(self, key: str, precision: str | None = None) -> GraphBuilder:
        options = self.graph_options
        if precision is not None:  # a precision self-draft: the fused graph on weight-only quantized products
            scheme, block_size, symmetric = parse_precision(precision)
            tag = f"{scheme}.b{block_size}{'s' if symmetric else ''}"
            options = dict(
                options,
                quantizer=Quantizer(scheme, block_size, DEFAULT_ACCURACY_LEVEL, symmetric, tag),
                pad_rows=False,  # a draft need not round like the verify; padding only costs it
                positions=True,  # so that it can attend to a window of the cache (runtime/backends/onnx/draft_window.py)
            )
        elif key == "verify" and issubclass(self.graph_class, FusedGraph):
            # the full model also verifies token trees (runtime/tree.py) and reads prompts, wanting only their last
            # token's logits (``FusedGraph.head``)
            options = dict(options, tree=True, logit_rows=True)
        return self.graph_class(key, self.config, self.dtype, self.weights, **options)

    def _head(self, head: str, plan: DraftPlan | None) -> str:
        L = self.config.num_layers
        if head == FINAL_HEAD:
            key = "head"
            if key not in self.graphs:
                self.graphs[key] = build_blocks(self._new(key), L, L, from_tokens=False, output=LOGITS)
        else:
            name = safe_name(Path(head).stem)
            key = f"draft_head.{name}"
            if key not in self.graphs:  # no KV: always the standard variant (nothing for an in-place cache to do)
                g = GraphBuilder(key, self.config, self.dtype, self.weights)
                self.graphs[key] = draft_head_graph(
                    g, load_draft_head(plan, self.config, self.draft_heads), f"draft_heads.{name}"
                )
        self.segments[key] = {"head_only": True, "head": head}
        return key


def export_onnx(
    decoder,
    plans: dict[str, DraftPlan],
    out_dir: Path,
    dtype: str = "float32",
    relative_to: Path | None = None,
    **options,
) -> dict[str, Any]:
    """Write the ONNX graphs of ``decoder`` (a ``runtime.backends.torch.decoder.Decoder``; its ``config`` and
    ``state_dict()`` are used) and of ``plans``' drafts, plus one shared ``weights.bin``, into
    ``out_dir``; return the manifest record for ``backends["onnx"]``.

    File paths in the record are relative to ``relative_to`` (default: ``out_dir.parent``, i.e. the
    artifact root when ``out_dir`` is ``<artifact>/onnx``). ``options``: see ``export_onnx_weights``.
    """
    return export_onnx_weights(decoder.config, decoder.state_dict(), plans, out_dir, dtype, relative_to, **options)


def export_onnx_weights(
    config: ArchConfig,
    weights,
    plans: dict[str, DraftPlan],
    out_dir: Path,
    dtype: str = "float32",
    relative_to: Path | None = None,
    variant: str = "standard",
    quantize: str | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    accuracy_level: int = DEFAULT_ACCURACY_LEVEL,
    pack: bool = True,
    pad_rows: bool | None = None,
    pad_products: bool | None = None,
    packed_rows: bool = False,
    draft_heads: dict[str, Path] | None = None,
    derived: dict[str, np.ndarray] | None = None,
    arrays: dict[str, np.ndarray] | None = None,
) -> dict[str, Any]:
    """``export_onnx`` from an ``ArchConfig`` and canonical weights (name -> torch tensor or numpy array,
    as in weights/model.safetensors; a tied lm_head may be absent). No torch needed for numpy weights.

    ``variant``: "standard" (ONNX ops only, passes ``onnx.checker``, runs on any execution provider) or "fused"
    (ONNX Runtime contrib ops, KV cache updated in place; see ``onnx_fused``). ``quantize`` ("int8" / "int4", fused
    only): weight-only ``MatMulNBits`` for every linear layer and the head, in blocks of ``block_size`` along the
    input dimension; ``accuracy_level`` is MatMulNBits' (0: unset, 4: int8 activations, ONNX Runtime's fast CPU
    path). ``pack`` (fused only): q/k/v and gate/up as one matmul each, on weights concatenated in the graph
    (``FusedGraph.linear_cat``). ``pad_rows`` (fused only; default: with ``quantize``): attention always runs on one
    more query row than the call has, so that a k-token verify computes exactly the 1-token steps it replaces
    (``FusedGraph.padding``; in ``packed_rows`` graphs, the runtime counts a one-token row's pad as a query row,
    ``FusedGraph.packed_layout``). Quantized graphs need it (int8 activations turn MLAS's one-row rounding into whole
    quantization steps); fp32 graphs agree within the near-tie rule without it, and it slows their plain steps
    (measured: docs/history.md, 'Figures behind the code's constants'). ``pad_products`` (quantized fused graphs;
    default: measured here, ``Quantizer.one_row_path_differs``): every ``MatMulNBits`` runs on at least two rows,
    where this CPU's one-row kernel rounds differently (on some CPUs, at a cost to the plain step: docs/history.md,
    'Figures behind the code's constants'). ``packed_rows`` (fused only; off unless asked: ``build --packed-rows``): rows
    of several sequences, each of any width (steps, verifies, prompt chunks), share one call through
    GroupQueryAttention's ``query_seqlens`` (``FusedGraph.packed_layout``; ONNX Runtime 1.32 or later runs these
    graphs). Off by default because the layout's gathers and the kernel's multi-row path make a lone
    sequence's calls dearer (docs/history.md, 'Figures behind the code's constants'); a server under load is
    where they pay.
    ``draft_heads`` maps plans' draft head files (exit adapters, reduced vocabularies) to where they are now.

    Memory: float weights already in the export's dtype are read in place (numpy views of the torch tensors)
    and written to ``weights.bin`` one tensor at a time, so an export holds no second copy of the model.
    ``derived`` (a dict the caller keeps between exports, such as a tuning run's) holds the quantized copies
    precision drafts use: each is made once, then reused, and kept as a map of the ``weights.bin`` it was first
    written to (resident only while read: ONNX Runtime sessions read their own copy). ``arrays`` (a dict to
    fill): every tensor the graphs use, by name, for a caller that hands them to ONNX Runtime from memory (``weights.bin`` is still
    written: ONNX Runtime reads the inputs of the weight concatenations it folds, the packed projections, from
    the file, whatever initializers it is given)."""
    if dtype not in ("float32", "float16"):
        raise ValueError(f"ONNX export supports float32 and float16, not {dtype!r}")
    if variant not in VARIANTS:
        raise ValueError(f"unknown ONNX graph variant {variant!r}; use one of {VARIANTS}")
    variant, quantizer, pad_rows, pad_products = _resolve_options(
        config, dtype, variant, quantize, block_size, accuracy_level, pad_rows, pad_products
    )
    packed_rows = variant == "fused" and bool(packed_rows)
    np_dtype = np.dtype(dtype)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    root = Path(relative_to) if relative_to is not None else out_dir.parent
    rel = lambda p: Path(p).resolve().relative_to(root.resolve()).as_posix()  # noqa: E731
    weights = _numpy_weights(weights, np_dtype)
    if derived is not None:
        weights.update(derived)
    reused = set(derived or ())

    graph_class, graph_options = _graph_builder(variant, quantizer, pack, pad_rows, pad_products, packed_rows)
    lowering = _Lowering(config, np_dtype, weights, graph_class, graph_options, draft_heads)
    plan_records = _lower_plans(lowering, config.num_layers, plans)

    tensors, total_bytes, weights_path = _write_weights(lowering.graphs, weights, out_dir)
    if derived is not None:
        _keep_derived(derived, reused, weights, tensors, weights_path, total_bytes)
    if arrays is not None:
        arrays.update({name: weights[name] for name in tensors})
    graph_records = _write_graphs(lowering, tensors, out_dir, rel)
    return {
        "format_version": FORMAT_VERSION,
        "opset": OPSET,
        "dtype": dtype,
        "exporter": "speccompile.exporters.onnx_export (onnx.helper)",
        "variant": variant,
        "quantization": quantizer.record() if quantizer is not None else None,
        "packed_projections": pack if variant == "fused" else False,
        # packed graphs: the runtime counts a one-token row's pad as a query row (FusedGraph.packed_layout)
        "padded_attention_rows": pad_rows if variant == "fused" else False,
        "padded_product_rows": pad_products if variant == "fused" else False,  # measured at build, see above
        # several sequences' one-token steps in one call (no padding row at batch > 1; OnnxBackend.run_rows)
        "batched_steps": variant == "fused",
        # rows of any width of several sequences in one call (query_seqlens: FusedGraph.packed_layout)
        "packed_rows": packed_rows,
        "weights": rel(weights_path),
        "weights_bytes": total_bytes,
        "precision_draft_bytes": _precision_draft_bytes(lowering, tensors),
        "tensors": tensors,
        "graphs": graph_records,
        "plans": plan_records,
    }


def _resolve_options(
    config: ArchConfig,
    dtype: str,
    variant: str,
    quantize: str | None,
    block_size: int,
    accuracy_level: int,
    pad_rows: bool | None,
    pad_products: bool | None,
) -> tuple[str, Quantizer | None, bool, bool]:
    """The export's graph variant, quantizer and row padding, from ``export_onnx_weights``' options and their
    defaults (``pad_products`` is measured on this CPU when not given); refuses the combinations no graph has."""
    quantizer = None
    if pad_rows is None:
        pad_rows = quantize is not None
    if quantize is not None:
        if variant != "fused" or dtype != "float32":
            raise ValueError("quantized ONNX export needs variant='fused' and float32 weights")
        quantizer = Quantizer(quantize, block_size, accuracy_level)
        if pad_products is None:
            pad_products = pad_rows and quantizer.one_row_path_differs(config.hidden_size, config.intermediate_size)
    pad_products = bool(pad_products) and quantizer is not None
    if variant == "fused" and not fused_supports(config):
        if quantizer is not None:
            raise ValueError(
                f"{config.model_type}: the fused graphs (which --quantize needs) do not support this "
                "model; export without --quantize"
            )
        variant = "standard"  # the portable graphs: ONNX Runtime runs them too, with the past KV copied per call
    return variant, quantizer, pad_rows, pad_products


def _graph_builder(
    variant: str, quantizer: Quantizer | None, pack: bool, pad_rows: bool, pad_products: bool, packed_rows: bool
) -> tuple[type[GraphBuilder], dict[str, Any]]:
    """The graph builder class of ``variant`` and the options every graph of the export is built with."""
    if variant == "fused":
        return FusedGraph, {
            "quantizer": quantizer,
            "pack": pack,
            "pad_rows": pad_rows,
            "pad_products": pad_products,
            "packed": packed_rows,
        }
    return GraphBuilder, {}


def _lower_plans(lowering: _Lowering, num_layers: int, plans: dict[str, DraftPlan]) -> dict[str, dict[str, Any]]:
    """Lower the full model, then every plan's segments; return each plan's record (its kind, its graphs)."""
    lowering.segment(full_model(num_layers), None)
    plan_records: dict[str, dict[str, Any]] = {}
    for plan_name, plan in plans.items():
        plan.validate(num_layers)
        kind = read_plan(plan, num_layers).kind
        graphs = [key for segment in kind.segments() for key in lowering.segment(segment, plan)]
        plan_records[plan_name] = {"kind": kind.name, "graphs": list(dict.fromkeys(graphs))}
    return plan_records


def _keep_derived(
    derived: dict[str, np.ndarray],
    reused: set[str],
    weights: dict[str, np.ndarray],
    tensors: dict[str, dict[str, Any]],
    weights_path: Path,
    total_bytes: int,
) -> None:
    """Hand the quantized copies this export made to ``derived``, for the next export: read back from the file
    written, so that they take memory only while something reads them (ONNX Runtime reads them itself)."""
    written = np.memmap(weights_path, dtype=np.uint8, mode="r") if total_bytes else None
    for name in [n for n in weights if QUANTIZED_COPY.search(n) and n not in reused]:
        t = tensors.get(name)
        if t is not None:
            view = written[t["offset"] : t["offset"] + t["nbytes"]]
            weights[name] = view.view(np.dtype(t["dtype"])).reshape(t["shape"])
        derived[name] = weights[name]


def _write_graphs(
    lowering: _Lowering, tensors: dict[str, dict[str, Any]], out_dir: Path, rel
) -> dict[str, dict[str, Any]]:
    """Save every lowered graph next to ``weights.bin`` (checking the standard ones) and return their records."""
    graph_records = {}
    for key, g in lowering.graphs.items():
        path = out_dir / f"{safe_name(key)}.onnx"
        onnx.save_model(_with_external_weights(g, tensors), str(path))
        if g.variant == "standard":  # the checker does not know ONNX Runtime's contrib ops
            onnx.checker.check_model(str(path), full_check=True)
        graph_records[key] = {
            "file": rel(path),
            "variant": g.variant,
            "inputs": g.input_records,
            "outputs": g.output_records,
            "initializers": list(g.used),
            "segment": lowering.segments[key],
        }
    return graph_records


def _precision_draft_bytes(lowering: _Lowering, tensors: dict[str, dict[str, Any]]) -> int:
    """The ``weights.bin`` bytes that only precision self-drafts' graphs read."""
    precision_graphs = {key for key, seg in lowering.segments.items() if seg.get("precision")}
    others = {name for key, g in lowering.graphs.items() if key not in precision_graphs for name in g.used}
    draft_only = {
        tensors[name]["offset"]: tensors[name]["nbytes"]
        for key in precision_graphs
        for name in lowering.graphs[key].used
        if name not in others
    }
    return sum(draft_only.values())


def _write_weights(graphs: dict[str, GraphBuilder], weights: dict[str, np.ndarray], out_dir: Path):
    """One weights file: every tensor any graph uses, de-duplicated by content (a tied lm_head is stored once),
    written tensor by tensor from the arrays' own memory."""
    used = list(dict.fromkeys(name for g in graphs.values() for name in g.used))
    tensors: dict[str, dict[str, Any]] = {}
    by_content: dict[tuple, dict[str, Any]] = {}
    weights_path = out_dir / WEIGHTS_NAME
    offset = 0
    with open(weights_path, "wb") as f:
        for name in used:
            arr = np.ascontiguousarray(weights[name])
            data = memoryview(arr).cast("B")  # the array's bytes, not a copy of them
            key = (str(arr.dtype), arr.shape, hashlib.sha256(data).hexdigest())
            if key not in by_content:
                pad = (-offset) % ALIGN
                offset += pad
                f.write(b"\0" * pad)
                f.write(data)
                by_content[key] = {
                    "offset": offset,
                    "nbytes": len(data),
                    "dtype": _DTYPE_NAMES[arr.dtype],
                    "shape": list(arr.shape),
                }
                offset += len(data)
            tensors[name] = dict(by_content[key])
    return tensors, offset, weights_path


def _with_external_weights(g: GraphBuilder, tensors: dict[str, dict[str, Any]]) -> onnx.ModelProto:
    model = g.to_model()
    for name in g.used:
        t = tensors[name]
        tp = TensorProto()
        tp.name = name
        tp.data_type = NP_TO_ONNX[np.dtype(t["dtype"])]
        tp.dims.extend(t["shape"])
        tp.data_location = TensorProto.EXTERNAL
        for k, v in (("location", WEIGHTS_NAME), ("offset", str(t["offset"])), ("length", str(t["nbytes"]))):
            entry = tp.external_data.add()
            entry.key, entry.value = k, v
        model.graph.initializer.append(tp)
    return model


def export_options(record: dict[str, Any] | None) -> dict[str, Any]:
    """The ``export_onnx_weights`` options an ONNX record was written with, so that re-exporting an
    artifact (``tune``) writes the same kind of graphs: variant and quantization scheme."""
    if not record:
        return {}
    options: dict[str, Any] = {"variant": record.get("variant", "standard")}
    if options["variant"] == "fused":
        options["pack"] = record.get("packed_projections", True)
        options["pad_rows"] = record.get("padded_attention_rows", bool(record.get("quantization")))
        options["pad_products"] = record.get("padded_product_rows", False)
        options["packed_rows"] = record.get("packed_rows", False)
    quant = record.get("quantization")
    if quant:
        options.update(quantize=quant["scheme"], block_size=quant["block_size"], accuracy_level=quant["accuracy_level"])
    return options


def _numpy_weights(state, dtype: np.dtype) -> dict[str, np.ndarray]:
    """Canonical weights (torch tensors or numpy arrays) -> numpy in ``dtype``; rope_inv_freq stays float32. A
    CPU float32 tensor exported in float32 is viewed, not copied (nothing here writes to the arrays)."""
    out = {}
    for name, tensor in state.items():
        if not isinstance(tensor, np.ndarray):
            import torch

            tensor = tensor.detach().to("cpu", torch.float32).numpy()
        target = np.float32 if name == "rope_inv_freq" else dtype
        out[name] = np.asarray(tensor, dtype=target)
    return out


def write_onnx_files(root: Path, ir, records: dict, onnx_memory: dict | None = None) -> dict:
    """The ONNX descriptor's writer (``runtime/backends/onnx/descriptor.py``): the graphs of the plans with a model
    part and their weights under ``root/onnx``, as the build chose to export them (``ir.tuning["onnx_export"]``: the
    graph variant, weight-only quantization), reusing the quantized copies in ``ir.quantized`` (and adding those it
    makes); ``onnx_memory``: more of ``export_onnx_weights``' memory options."""
    from speccompile.artifact_writer import model_plans

    return export_onnx_weights(
        ir.config,
        ir.weights,
        model_plans(ir.plans),
        Path(root) / "onnx",
        "float16" if ir.dtype == "float16" else "float32",
        **ir.tuning.get("onnx_export", {}),
        draft_heads=getattr(ir, "extra_files", {}),
        derived=getattr(ir, "quantized", None),
        **(onnx_memory or {}),
    )


__all__ = [
    "OPSET",
    "QUANT_BITS",
    "VARIANTS",
    "export_onnx",
    "export_onnx_weights",
    "export_options",
    "fused_supports",
    "write_onnx_files",
]
