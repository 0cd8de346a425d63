"""Export the canonical decoder to ONNX graphs that share one external weights file.

Exporter choice: the graphs are **built directly with ``onnx.helper``** from the decoder's ``ArchConfig``
and canonical state dict, not traced with ``torch.onnx.export``. Reasons:

- every graph names its initializers with the canonical weight names (``layers.3.attn.q.weight``), so
  one weights file written once serves every graph: no renaming, no per-graph constant folding, no
  after-the-fact de-duplication of exporter output (we still de-duplicate by content: a tied
  ``lm_head`` is stored once);
- linear layers use ``Gemm(transB=1)`` on the canonical ``[out, in]`` weights, so no exporter-made
  transposed copies appear, and ONNX Runtime has nothing to constant-fold per session;
- the nine families differ only by ``ArchConfig`` switches, exactly as in ``runtime/decoder.py``, whose
  forward pass this module mirrors op for op (RMS/LayerNorm, gated/plain MLP, rotary full or partial
  with positions from the past length, learned positions with offset, q/k norm, embedding scale,
  parallel residual, GQA, causal + sliding-window mask);
- export is instant and independent of the torch exporter's version-to-version behaviour.

Graphs (optimum naming: ``input_ids``, ``past_key_values.{i}.key/value``, ``logits``,
``present.{i}.key/value``; KV layout ``[batch, kv_heads, len, head_dim]``; dynamic batch / seq / past):

- ``verify``: the full model;
- ``skip.<plan>`` per layer-skip plan: the full model with the plan's sublayers skipped; only layers
  whose attention runs have KV inputs / outputs;
- ``prefix.<E>`` per early-exit layer E: ``input_ids`` + past KV of layers 0..E-1 -> ``hidden`` at E
  + present KV of layers 0..E-1;
- ``suffix.<E>``: ``hidden`` at E + past KV of layers E..L-1 -> ``logits`` + present KV of E..L-1;
- ``head``: ``hidden`` -> ``logits`` (final norm + lm_head), shared by every exit.

Positions are ``past_len .. past_len + seq - 1`` with ``past_len`` read from the first past KV input's
shape. A graph with no KV input that still needs positions (a learned-position model whose plan skips
every attention sublayer) takes ``position_ids [batch, seq]`` (absolute positions) instead.

Every initializer is stored as external data in ``weights.bin`` next to the graphs (64-byte aligned,
de-duplicated by dtype + shape + bytes). The manifest record also lists every tensor's offset, so a
runtime can read the file once and hand the same buffers to every session
(``runtime/onnx_backend.py``).
"""

from __future__ import annotations

import hashlib
import math
import re
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper

from speccompile.runtime.manifest import ArchConfig, DraftPlan

OPSET = 18
IR_VERSION = 8
WEIGHTS_NAME = "weights.bin"
ALIGN = 64
FORMAT_VERSION = 1

_NP_TO_ONNX = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.float16): TensorProto.FLOAT16,
               np.dtype(np.int64): TensorProto.INT64}
_DTYPE_NAMES = {np.dtype(np.float32): "float32", np.dtype(np.float16): "float16", np.dtype(np.int64): "int64"}


class _Graph:
    """A small builder: nodes with generated output names, constants as Constant nodes."""

    def __init__(self, name: str, config: ArchConfig, dtype: np.dtype, weights: dict[str, np.ndarray]):
        self.name, self.c, self.dtype, self.weights = name, config, dtype, weights
        self.onnx_dtype = _NP_TO_ONNX[dtype]
        self.nodes: list[onnx.NodeProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self.used: list[str] = []
        self.input_records: list[dict[str, Any]] = []
        self.output_records: list[dict[str, Any]] = []
        self._n = 0
        self._shape_cache: dict[int, str] = {}
        self.bt_shape: str | None = None  # [batch, seq] as int64

    def op(self, op_type: str, *inputs: str, n_out: int = 1, **attrs) -> Any:
        self._n += 1
        outs = [f"{op_type.lower()}_{self._n}" + (f"_{k}" if n_out > 1 else "") for k in range(n_out)]
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, name=f"n{self._n}", **attrs))
        return outs[0] if n_out == 1 else outs

    def const(self, value, dtype=None) -> str:
        arr = np.asarray(value, dtype=dtype)
        self._n += 1
        name = f"const_{self._n}"
        self.nodes.append(helper.make_node("Constant", [], [name], value=helper.make_tensor(
            name, _NP_TO_ONNX[arr.dtype], arr.shape, arr.flatten().tolist())))
        return name

    def w(self, name: str) -> str:
        if name not in self.weights:
            raise KeyError(f"decoder has no weight {name!r}")
        if name not in self.used:
            self.used.append(name)
        return name

    def add_input(self, name: str, elem: int, shape: list) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, elem, shape))
        self.input_records.append({"name": name, "dtype": _elem_name(elem), "shape": shape})
        return name

    def add_output(self, src: str, name: str, elem: int, shape: list) -> None:
        self.nodes.append(helper.make_node("Identity", [src], [name], name=f"out_{name}"))
        self.outputs.append(helper.make_tensor_value_info(name, elem, shape))
        self.output_records.append({"name": name, "dtype": _elem_name(elem), "shape": shape})

    # -- building blocks mirroring runtime/decoder.py ----------------------------------------------
    def linear(self, x: str, prefix: str, out_features: int) -> str:
        """x [B, T, in] @ W[out, in]^T + b, as Gemm on the canonical weight (no transposed copy)."""
        in_features = self.weights[f"{prefix}.weight"].shape[1]
        x2 = self.op("Reshape", x, self.const([-1, in_features], np.int64))
        args = [x2, self.w(f"{prefix}.weight")]
        if f"{prefix}.bias" in self.weights:
            args.append(self.w(f"{prefix}.bias"))
        y = self.op("Gemm", *args, transB=1)
        return self.op("Reshape", y, self.out_shape(out_features))

    def out_shape(self, last: int) -> str:
        if last not in self._shape_cache:
            self._shape_cache[last] = self.op("Concat", self.bt_shape, self.const([last], np.int64), axis=0)
        return self._shape_cache[last]

    def norm(self, x: str, prefix: str) -> str:
        c = self.c
        if c.norm == "layer":
            return self.op("LayerNormalization", x, self.w(f"{prefix}.weight"), self.w(f"{prefix}.bias"),
                           axis=-1, epsilon=float(c.norm_eps))
        x32 = x if self.dtype == np.float32 else self.op("Cast", x, to=TensorProto.FLOAT)
        ms = self.op("ReduceMean", self.op("Mul", x32, x32), self.const([-1], np.int64), keepdims=1)
        inv = self.op("Reciprocal", self.op("Sqrt", self.op("Add", ms, self.const(np.float32(c.norm_eps)))))
        y = self.op("Mul", x32, inv)
        if self.dtype != np.float32:
            y = self.op("Cast", y, to=self.onnx_dtype)
        return self.op("Mul", self.w(f"{prefix}.weight"), y)

    def act(self, x: str) -> str:
        kind = self.c.activation
        if kind == "silu":
            return self.op("Mul", x, self.op("Sigmoid", x))
        if kind == "relu":
            return self.op("Relu", x)
        half, one = self.const(np.array(0.5, self.dtype)), self.const(np.array(1.0, self.dtype))
        if kind == "gelu":
            inner = self.op("Erf", self.op("Mul", x, self.const(np.array(1 / math.sqrt(2), self.dtype))))
        elif kind == "gelu_tanh":
            cube = self.op("Mul", self.op("Mul", x, x), x)
            poly = self.op("Add", x, self.op("Mul", cube, self.const(np.array(0.044715, self.dtype))))
            inner = self.op("Tanh", self.op("Mul", poly, self.const(np.array(math.sqrt(2 / math.pi), self.dtype))))
        else:
            raise ValueError(f"activation {kind!r} is not supported by the ONNX exporter")
        return self.op("Mul", self.op("Mul", x, half), self.op("Add", inner, one))

    def mlp(self, i: int, h: str) -> str:
        c = self.c
        x = self.norm(h, f"layers.{i}.mlp_norm")
        up = self.linear(x, f"layers.{i}.mlp.up", c.intermediate_size)
        if c.mlp == "gated":
            inner = self.op("Mul", self.act(self.linear(x, f"layers.{i}.mlp.gate", c.intermediate_size)), up)
        else:
            inner = self.act(up)
        return self.linear(inner, f"layers.{i}.mlp.down", c.hidden_size)

    def rotary(self, x: str, rope: tuple[str, str]) -> str:
        c = self.c
        cos, sin = rope
        rot, half = c.rotary_dim, c.rotary_dim // 2
        if rot == c.head_dim:
            x_rot, x_pass = x, None
        else:
            x_rot = self.op("Slice", x, self.const([0], np.int64), self.const([rot], np.int64), self.const([-1], np.int64))
            x_pass = self.op("Slice", x, self.const([rot], np.int64), self.const([c.head_dim], np.int64),
                             self.const([-1], np.int64))
        x1 = self.op("Slice", x_rot, self.const([0], np.int64), self.const([half], np.int64), self.const([-1], np.int64))
        x2 = self.op("Slice", x_rot, self.const([half], np.int64), self.const([rot], np.int64), self.const([-1], np.int64))
        rotated = self.op("Concat", self.op("Neg", x2), x1, axis=-1)
        out = self.op("Add", self.op("Mul", x_rot, cos), self.op("Mul", rotated, sin))
        return out if x_pass is None else self.op("Concat", out, x_pass, axis=-1)

    def attention(self, i: int, h: str, rope, mask: str) -> str:
        c = self.c
        p = f"layers.{i}.attn"
        x = self.norm(h, f"layers.{i}.attn_norm")
        hd, nh, nkv = c.head_dim, c.num_heads, c.num_kv_heads

        def heads(name: str, n: int, norm: str | None) -> str:
            t = self.op("Reshape", self.linear(x, f"{p}.{name}", n * hd), self.const([0, 0, n, hd], np.int64))
            if norm is not None:
                t = self.norm(t, norm)
            return self.op("Transpose", t, perm=[0, 2, 1, 3])

        q = heads("q", nh, f"{p}.q_norm" if c.qk_norm else None)
        k = heads("k", nkv, f"{p}.k_norm" if c.qk_norm else None)
        v = heads("v", nkv, None)
        if rope is not None:
            q, k = self.rotary(q, rope), self.rotary(k, rope)
        past_k = self.add_input(f"past_key_values.{i}.key", self.onnx_dtype, ["batch", nkv, "past_len", hd])
        past_v = self.add_input(f"past_key_values.{i}.value", self.onnx_dtype, ["batch", nkv, "past_len", hd])
        k_all = self.op("Concat", past_k, k, axis=2)
        v_all = self.op("Concat", past_v, v, axis=2)
        self.add_output(k_all, f"present.{i}.key", self.onnx_dtype, ["batch", nkv, "total_len", hd])
        self.add_output(v_all, f"present.{i}.value", self.onnx_dtype, ["batch", nkv, "total_len", hd])
        scale = self.const(np.array(c.scale, self.dtype))
        if nh != nkv:  # GQA: query head h reads kv head h // groups
            q = self.op("Reshape", q, self.const([0, nkv, nh // nkv, -1, hd], np.int64))
            k_t = self.op("Unsqueeze", self.op("Transpose", k_all, perm=[0, 1, 3, 2]), self.const([2], np.int64))
            v_use = self.op("Unsqueeze", v_all, self.const([2], np.int64))
        else:
            k_t = self.op("Transpose", k_all, perm=[0, 1, 3, 2])
            v_use = v_all
        scores = self.op("Add", self.op("Mul", self.op("MatMul", q, k_t), scale), mask)
        out = self.op("MatMul", self.op("Softmax", scores, axis=-1), v_use)
        if nh != nkv:
            out = self.op("Reshape", out, self.const([0, nh, -1, hd], np.int64))
        out = self.op("Reshape", self.op("Transpose", out, perm=[0, 2, 1, 3]), self.const([0, 0, nh * hd], np.int64))
        return self.linear(out, f"{p}.o", c.hidden_size)

    def positions(self, past_len: str | None, position_ids: str | None) -> str:
        """Absolute positions [seq] (or [batch, seq] when given as an input), int64."""
        if position_ids is not None:
            return position_ids
        seq = self.op("Gather", self.bt_shape, self.const(1, np.int64), axis=0)
        return self.op("Range", past_len, self.op("Add", past_len, seq), self.const(1, np.int64))

    def rope(self, pos: str) -> tuple[str, str]:
        c = self.c
        f = self.op("Mul", self.op("Unsqueeze", self.op("Cast", pos, to=TensorProto.FLOAT), self.const([-1], np.int64)),
                    self.w("rope_inv_freq"))
        emb = self.op("Concat", f, f, axis=-1)
        cos, sin = self.op("Cos", emb), self.op("Sin", emb)
        scale = float(c.rope_attention_scaling)
        if scale != 1.0:
            s = self.const(np.float32(scale))
            cos, sin = self.op("Mul", cos, s), self.op("Mul", sin, s)
        if self.dtype != np.float32:
            cos, sin = self.op("Cast", cos, to=self.onnx_dtype), self.op("Cast", sin, to=self.onnx_dtype)
        return cos, sin

    def mask(self, pos: str, total: str) -> str:
        """Additive [seq, total] mask: 0 where key position <= query position (and inside the window)."""
        q_pos = self.op("Unsqueeze", pos, self.const([-1], np.int64))
        k_pos = self.op("Range", self.const(0, np.int64), total, self.const(1, np.int64))
        allowed = self.op("LessOrEqual", k_pos, q_pos)
        if self.c.sliding_window is not None:
            lo = self.op("Sub", q_pos, self.const(int(self.c.sliding_window), np.int64))
            allowed = self.op("And", allowed, self.op("Greater", k_pos, lo))
        return self.op("Where", allowed, self.const(np.array(0.0, self.dtype)),
                       self.const(np.array(-np.inf, self.dtype)))

    def to_model(self) -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, self.name.replace(".", "_"), self.inputs, self.outputs)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                                  producer_name="speccompile", ir_version=IR_VERSION)
        return model


def _elem_name(elem: int) -> str:
    return {TensorProto.FLOAT: "float32", TensorProto.FLOAT16: "float16", TensorProto.INT64: "int64"}[elem]


def _build(kind: str, name: str, config: ArchConfig, dtype: np.dtype, weights: dict[str, np.ndarray], start: int,
           stop: int, skip_attn=frozenset(), skip_mlp=frozenset()) -> _Graph:
    """kind: 'full' (input_ids -> logits), 'prefix' (input_ids -> hidden), 'suffix' (hidden -> logits),
    'head' (hidden -> logits). Blocks start..stop-1 run, minus skipped sublayers."""
    c = config
    g = _Graph(name, config, dtype, weights)
    d = c.hidden_size
    attn_layers = [i for i in range(start, stop) if i not in skip_attn]
    if kind in ("full", "prefix"):
        ids = g.add_input("input_ids", TensorProto.INT64, ["batch", "seq"])
        g.bt_shape = g.op("Shape", ids)
    else:
        hidden_in = g.add_input("hidden", g.onnx_dtype, ["batch", "seq", d])
        g.bt_shape = g.op("Shape", hidden_in, end=2)
    needs_pos = bool(attn_layers) or (kind in ("full", "prefix") and c.positions == "learned")
    pos = past_len = position_ids = None
    if needs_pos:
        if attn_layers:
            # The KV input of the first running attention layer is declared here (first) so the
            # graph's input order is: ids/hidden, then past KV by layer.
            first = attn_layers[0]
            past_k = g.add_input(f"past_key_values.{first}.key", g.onnx_dtype, ["batch", c.num_kv_heads, "past_len", c.head_dim])
            past_len = g.op("Gather", g.op("Shape", past_k), g.const(2, np.int64), axis=0)
        else:
            position_ids = g.add_input("position_ids", TensorProto.INT64, ["batch", "seq"])
        pos = g.positions(past_len, position_ids)
    # embeddings
    if kind in ("full", "prefix"):
        h = g.op("Gather", g.w("embed.weight"), ids, axis=0)
        if c.embed_scale is not None:
            h = g.op("Mul", h, g.const(np.array(c.embed_scale, dtype)))
        if c.positions == "learned":
            pid = g.op("Add", pos, g.const(int(c.position_offset), np.int64)) if c.position_offset else pos
            h = g.op("Add", h, g.op("Gather", g.w("pos_embed.weight"), pid, axis=0))
    else:
        h = hidden_in
    rope = mask = None
    if attn_layers:
        if c.positions == "rotary":
            rope = g.rope(pos)
        seq = g.op("Gather", g.bt_shape, g.const(1, np.int64), axis=0)
        mask = g.mask(pos, g.op("Add", past_len, seq))
    if kind != "head":
        for i in range(start, stop):
            attn_out = None
            if i not in skip_attn:
                attn_out = g.attention(i, h, rope, mask)
            if c.parallel_residual:
                mlp_out = None if i in skip_mlp else g.mlp(i, h)
                if attn_out is not None:
                    h = g.op("Add", h, attn_out)
                if mlp_out is not None:
                    h = g.op("Add", h, mlp_out)
            else:
                if attn_out is not None:
                    h = g.op("Add", h, attn_out)
                if i not in skip_mlp:
                    h = g.op("Add", h, g.mlp(i, h))
    if kind == "prefix":
        g.add_output(h, "hidden", g.onnx_dtype, ["batch", "seq", d])
    else:
        head_w = "embed.weight" if c.tie_word_embeddings else "lm_head.weight"
        x = g.norm(h, "norm")
        x2 = g.op("Reshape", x, g.const([-1, d], np.int64))
        logits = g.op("Reshape", g.op("Gemm", x2, g.w(head_w), transB=1), g.out_shape(c.vocab_size))
        g.add_output(logits, "logits", g.onnx_dtype, ["batch", "seq", c.vocab_size])
    # The first past key was declared early; the rest of its layer's inputs follow by construction.
    _dedupe_inputs(g)
    return g


def _dedupe_inputs(g: _Graph) -> None:
    """attention() declares both past inputs of each layer; drop the duplicate early-declared key."""
    seen, inputs, records = set(), [], []
    for vi, rec in zip(g.inputs, g.input_records):
        if vi.name in seen:
            continue
        seen.add(vi.name)
        inputs.append(vi)
        records.append(rec)
    g.inputs, g.input_records = inputs, records


def _numpy_weights(state, dtype: np.dtype) -> dict[str, np.ndarray]:
    """Canonical weights (torch tensors or numpy arrays) -> numpy in ``dtype``; rope_inv_freq stays float32."""
    out = {}
    for name, tensor in state.items():
        if not isinstance(tensor, np.ndarray):
            import torch

            tensor = tensor.detach().to("cpu", torch.float32).numpy()
        target = np.float32 if name == "rope_inv_freq" else dtype
        out[name] = np.array(tensor, dtype=target, copy=True)
    return out


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)


def export_onnx(decoder, plans: dict[str, DraftPlan], out_dir: Path, dtype: str = "float32",
                relative_to: Path | None = None) -> dict[str, Any]:
    """Write the ONNX graphs of ``decoder`` (a ``runtime.decoder.Decoder``; its ``config`` and
    ``state_dict()`` are used) and of ``plans``' drafts, plus one shared ``weights.bin``, into
    ``out_dir``; return the manifest record for ``backends["onnx"]``.

    File paths in the record are relative to ``relative_to`` (default: ``out_dir.parent``, i.e. the
    artifact root when ``out_dir`` is ``<artifact>/onnx``).
    """
    return export_onnx_weights(decoder.config, decoder.state_dict(), plans, out_dir, dtype, relative_to)


def export_onnx_weights(config: ArchConfig, weights, plans: dict[str, DraftPlan], out_dir: Path,
                        dtype: str = "float32", relative_to: Path | None = None) -> dict[str, Any]:
    """``export_onnx`` from an ``ArchConfig`` and canonical weights (name -> torch tensor or numpy array,
    as in weights/model.safetensors; a tied lm_head may be absent). No torch needed for numpy weights."""
    if dtype not in ("float32", "float16"):
        raise ValueError(f"ONNX export supports float32 and float16, not {dtype!r}")
    np_dtype = np.dtype(dtype)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    root = Path(relative_to) if relative_to is not None else out_dir.parent
    rel = lambda p: Path(p).resolve().relative_to(root.resolve()).as_posix()  # noqa: E731
    weights = _numpy_weights(weights, np_dtype)
    L = config.num_layers

    graphs: dict[str, _Graph] = {"verify": _build("full", "verify", config, np_dtype, weights, 0, L)}
    plan_records: dict[str, dict[str, Any]] = {}
    skip_graphs: dict[tuple, str] = {}
    for plan_name, plan in plans.items():
        plan.validate(L)
        if plan.is_early_exit:
            e = plan.exit_layer
            if f"prefix.{e}" not in graphs:
                graphs[f"prefix.{e}"] = _build("prefix", f"prefix.{e}", config, np_dtype, weights, 0, e)
                graphs[f"suffix.{e}"] = _build("suffix", f"suffix.{e}", config, np_dtype, weights, e, L)
            if "head" not in graphs:
                graphs["head"] = _build("head", "head", config, np_dtype, weights, L, L)
            plan_records[plan_name] = {"kind": "early_exit", "prefix": f"prefix.{e}", "suffix": f"suffix.{e}",
                                       "head": "head", "exit_layer": e}
        else:
            skips = (tuple(sorted(set(plan.skip_attn))), tuple(sorted(set(plan.skip_mlp))))
            key = skip_graphs.get(skips)
            if key is None:  # plans that skip the same sublayers share one graph
                key = skip_graphs[skips] = f"skip.{_safe(plan_name)}"
                graphs[key] = _build("full", key, config, np_dtype, weights, 0, L, frozenset(skips[0]),
                                     frozenset(skips[1]))
            plan_records[plan_name] = {"kind": "layer_skip", "draft": key, "verify": "verify"}

    # One weights file: every tensor any graph uses, de-duplicated by content.
    used = []
    for g in graphs.values():
        used.extend(n for n in g.used if n not in used)
    tensors: dict[str, dict[str, Any]] = {}
    by_content: dict[tuple, dict[str, Any]] = {}
    weights_path = out_dir / WEIGHTS_NAME
    offset = 0
    with open(weights_path, "wb") as f:
        for name in used:
            arr = np.ascontiguousarray(weights[name])
            data = arr.tobytes()
            key = (str(arr.dtype), arr.shape, hashlib.sha256(data).hexdigest())
            if key not in by_content:
                pad = (-offset) % ALIGN
                f.write(b"\0" * pad)
                offset += pad
                f.write(data)
                by_content[key] = {"offset": offset, "nbytes": len(data), "dtype": _DTYPE_NAMES[arr.dtype],
                                   "shape": list(arr.shape)}
                offset += len(data)
            tensors[name] = dict(by_content[key])
    total_bytes = offset

    graph_records = {}
    for key, g in graphs.items():
        model = g.to_model()
        for name in g.used:
            t = tensors[name]
            tp = TensorProto()
            tp.name = name
            tp.data_type = _NP_TO_ONNX[np.dtype(t["dtype"])]
            tp.dims.extend(t["shape"])
            tp.data_location = TensorProto.EXTERNAL
            for k, v in (("location", WEIGHTS_NAME), ("offset", str(t["offset"])), ("length", str(t["nbytes"]))):
                entry = tp.external_data.add()
                entry.key, entry.value = k, v
            model.graph.initializer.append(tp)
        path = out_dir / f"{_safe(key)}.onnx"
        onnx.save_model(model, str(path))
        onnx.checker.check_model(str(path), full_check=True)
        graph_records[key] = {
            "file": rel(path), "inputs": g.input_records, "outputs": g.output_records, "initializers": list(g.used),
        }

    return {
        "format_version": FORMAT_VERSION,
        "opset": OPSET,
        "dtype": dtype,
        "exporter": "speccompile.export_onnx (onnx.helper)",
        "weights": rel(weights_path),
        "weights_bytes": total_bytes,
        "tensors": tensors,
        "graphs": graph_records,
        "plans": plan_records,
    }


__all__ = ["OPSET", "export_onnx", "export_onnx_weights"]
