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

from speccompile.runtime.backends.graph_index import segments_from_plan_records
from speccompile.runtime.manifest import ArchConfig, DraftPlan

OPSET = 18
IR_VERSION = 8
WEIGHTS_NAME = "weights.bin"
ALIGN = 64
FORMAT_VERSION = 1
DEFAULT_BLOCK_SIZE = 32
DEFAULT_ACCURACY_LEVEL = 4  # int8 activations: onnxruntime's fast CPU MatMulNBits path (int8 at level 0 has none);
# lossless only because the fused graphs make a k-row call compute what k one-row calls do (_FusedGraph.padding)

CONTRIB = "com.microsoft"
VARIANTS = ("standard", "fused")
QUANT_BITS = {"int8": 8, "int4": 4}

_NP_TO_ONNX = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.float16): TensorProto.FLOAT16,
               np.dtype(np.int64): TensorProto.INT64, np.dtype(np.uint8): TensorProto.UINT8,
               np.dtype(np.int32): TensorProto.INT32}
_DTYPE_NAMES = {np.dtype(np.float32): "float32", np.dtype(np.float16): "float16", np.dtype(np.int64): "int64",
                np.dtype(np.uint8): "uint8"}


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
        """Block ``i``'s MLP residual branch: pre-norm, MLP, post-norm as the config says (``Block``)."""
        out = self.mlp_on(i, self.norm(h, f"layers.{i}.mlp_norm") if self.c.pre_norm else h)
        return self.norm(out, f"layers.{i}.mlp_post_norm") if self.c.post_norm else out

    def mlp_on(self, i: int, x: str) -> str:
        """The MLP of block ``i`` on its already-normed input."""
        if self.c.num_experts:
            return self.experts(i, x)
        return self.expert(f"layers.{i}.mlp", x)

    def experts(self, i: int, x: str) -> str:
        """Mixtral's routed experts (``MixtureOfExperts``), computed densely: every expert runs on every token
        and adds its output times the token's routing weight, zero where the router did not pick it. Exact,
        and branch-free as a graph must be; it reads every expert's weights at every step."""
        c, p = self.c, f"layers.{i}.mlp"
        probs = self.op("Softmax", self.linear(x, f"{p}.router", c.num_experts), axis=-1)
        top_w, top_i = self.op("TopK", probs, self.const([c.experts_per_token], np.int64), axis=-1, n_out=2)
        top_w = self.op("Div", top_w, self.op("ReduceSum", top_w, self.const([-1], np.int64), keepdims=1))
        routing = self.op("ScatterElements", self.op("Mul", probs, self.const(np.array(0.0, self.dtype))), top_i, top_w,
                          axis=-1)
        out = None
        for e in range(c.num_experts):
            weight = self.op("Slice", routing, self.const([e], np.int64), self.const([e + 1], np.int64),
                             self.const([-1], np.int64))
            term = self.op("Mul", self.expert(f"{p}.experts.{e}", x), weight)
            out = term if out is None else self.op("Add", out, term)
        return out

    def expert(self, p: str, x: str) -> str:
        """A (gated or plain) MLP whose weights are under ``p`` (``layers.i.mlp``, or one expert of it)."""
        c = self.c
        up = self.linear(x, f"{p}.up", c.intermediate_size)
        if c.mlp == "gated":
            inner = self.op("Mul", self.act(self.linear(x, f"{p}.gate", c.intermediate_size)), up)
        else:
            inner = self.act(up)
        return self.linear(inner, f"{p}.down", c.hidden_size)

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
        x = self.norm(h, f"layers.{i}.attn_norm") if c.pre_norm else h
        hd, nh, nkv = c.head_dim, c.num_heads, c.num_kv_heads
        over_proj = c.qk_norm_over == "proj"

        def heads(name: str, n: int, norm: str | None) -> str:
            t = self.linear(x, f"{p}.{name}", n * hd)
            if norm is not None and over_proj:
                t = self.norm(t, norm)
            t = self.op("Reshape", t, self.const([0, 0, n, hd], np.int64))
            if norm is not None and not over_proj:
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
        out = self.linear(out, f"{p}.o", c.hidden_size)
        return self.norm(out, f"layers.{i}.attn_post_norm") if c.post_norm else out

    def positions(self, past_len: str | None, position_ids: str | None) -> str:
        """Absolute positions [seq] (or [batch, seq] when given as an input), int64."""
        if position_ids is not None:
            return position_ids
        seq = self.op("Gather", self.bt_shape, self.const(1, np.int64), axis=0)
        return self.op("Range", past_len, self.op("Add", past_len, seq), self.const(1, np.int64))

    def rope(self, pos: str, table: str = "global") -> tuple[str, str]:
        c = self.c
        inv_freq = "rope_local_inv_freq" if table == "local" else "rope_inv_freq"
        f = self.op("Mul", self.op("Unsqueeze", self.op("Cast", pos, to=TensorProto.FLOAT), self.const([-1], np.int64)),
                    self.w(inv_freq))
        emb = self.op("Concat", f, f, axis=-1)
        cos, sin = self.op("Cos", emb), self.op("Sin", emb)
        scale = float(c.rope_attention_scaling) if table == "global" else 1.0
        if scale != 1.0:
            s = self.const(np.float32(scale))
            cos, sin = self.op("Mul", cos, s), self.op("Mul", sin, s)
        if self.dtype != np.float32:
            cos, sin = self.op("Cast", cos, to=self.onnx_dtype), self.op("Cast", sin, to=self.onnx_dtype)
        return cos, sin

    def mask(self, pos: str, total: str, window: int | None) -> str:
        """Additive [seq, total] mask: 0 where key position <= query position (and inside the window)."""
        q_pos = self.op("Unsqueeze", pos, self.const([-1], np.int64))
        k_pos = self.op("Range", self.const(0, np.int64), total, self.const(1, np.int64))
        allowed = self.op("LessOrEqual", k_pos, q_pos)
        if window is not None:
            lo = self.op("Sub", q_pos, self.const(int(window), np.int64))
            allowed = self.op("And", allowed, self.op("Greater", k_pos, lo))
        return self.op("Where", allowed, self.const(np.array(0.0, self.dtype)),
                       self.const(np.array(-np.inf, self.dtype)))

    def logit_post(self, logits: str) -> str:
        """What a family does to the head's logits: a scale (Cohere), a softcap (Gemma 2/3)."""
        c = self.c
        if c.logit_scale is not None:
            logits = self.op("Mul", logits, self.const(np.array(c.logit_scale, self.dtype)))
        if c.final_softcap is not None:
            cap = self.const(np.array(c.final_softcap, self.dtype))
            logits = self.op("Mul", self.op("Tanh", self.op("Div", logits, cap)), cap)
        return logits

    def to_model(self) -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, self.name.replace(".", "_"), self.inputs, self.outputs)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                                  producer_name="speccompile", ir_version=IR_VERSION)
        return model


def _elem_name(elem: int) -> str:
    return {TensorProto.FLOAT: "float32", TensorProto.FLOAT16: "float16", TensorProto.INT64: "int64",
            TensorProto.INT32: "int32"}[elem]


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
    ropes, masks = {None: None}, {}  # per rotary table and per window, each built once (ArchConfig.rotary_of / window_of)
    if attn_layers:
        for table in {c.rotary_of(i) for i in attn_layers} - {None}:
            ropes[table] = g.rope(pos, table)
        seq = g.op("Gather", g.bt_shape, g.const(1, np.int64), axis=0)
        total = g.op("Add", past_len, seq)
        masks = {window: g.mask(pos, total, window) for window in {c.window_of(i) for i in attn_layers}}
    if kind != "head":
        for i in range(start, stop):
            attn_out = None
            if i not in skip_attn:
                attn_out = g.attention(i, h, ropes[c.rotary_of(i)], masks[c.window_of(i)])
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
        bias = [g.w("lm_head.bias")] if c.lm_head_bias else []
        logits = g.op("Reshape", g.op("Gemm", x2, g.w(head_w), *bias, transB=1), g.out_shape(c.vocab_size))
        g.add_output(g.logit_post(logits), "logits", g.onnx_dtype, ["batch", "seq", c.vocab_size])
    # The first past key was declared early; the rest of its layer's inputs follow by construction.
    _dedupe_inputs(g)
    return g


class _Quantizer:
    """Weight-only block quantization of linear weights for ``MatMulNBits``, with onnxruntime's own
    kernels (``quantize_matmul_4bits`` / ``quantize_matmul_8bits``: what
    ``onnxruntime.quantization.matmul_nbits_quantizer`` calls, without its onnx_ir dependency).

    Each quantized weight is added to the shared weights under a derived name
    (``<canonical>.int4``, ``.int4.scales``, ``.int4.zero_points``), so it is written once to
    ``weights.bin`` however many graphs use it; the float weight is then used by no graph (except the
    embedding table, which stays a float ``Gather``)."""

    def __init__(self, scheme: str, block_size: int, accuracy_level: int, symmetric: bool = False):
        if scheme not in QUANT_BITS:
            raise ValueError(f"unknown quantization {scheme!r}; use one of {sorted(QUANT_BITS)}")
        if block_size < 16 or block_size & (block_size - 1):
            raise ValueError(f"quantization block size must be a power of two >= 16, not {block_size}")
        self.scheme, self.bits, self.block_size = scheme, QUANT_BITS[scheme], block_size
        self.accuracy_level, self.symmetric = accuracy_level, symmetric

    def record(self) -> dict[str, Any]:
        return {"scheme": self.scheme, "bits": self.bits, "block_size": self.block_size, "symmetric": self.symmetric,
                "accuracy_level": self.accuracy_level, "op": f"{CONTRIB}.MatMulNBits",
                "quantizer": "onnxruntime quantize_matmul_%dbits" % self.bits}

    def tensors(self, weights: dict[str, np.ndarray], name: str) -> tuple[str, str, str | None]:
        """Names of (packed, scales, zero_points or None) for canonical weight ``name`` [out, in]."""
        from onnxruntime.capi._pybind_state import quantize_matmul_4bits, quantize_matmul_8bits

        base = f"{name}.{self.scheme}"
        zp_name = None if self.symmetric else f"{base}.zero_points"
        if base not in weights:
            w = weights[name]
            n, k = w.shape
            bs = self.block_size
            k_blocks = (k + bs - 1) // bs
            wt = np.zeros((k_blocks * bs, n), np.float32)  # [K, N] as MatMul sees it, zero-padded to whole blocks
            wt[:k] = w.T
            kpack = 8 // self.bits
            packed = np.zeros((n, k_blocks, bs // kpack), np.uint8)
            scales = np.zeros((n, k_blocks), np.float32)
            zero_points = np.zeros((n, (k_blocks + kpack - 1) // kpack), np.uint8)
            quantize = quantize_matmul_4bits if self.bits == 4 else quantize_matmul_8bits
            quantize(packed, wt, scales, zero_points, bs, n, k, self.symmetric)
            weights[base], weights[f"{base}.scales"] = packed, scales.astype(w.dtype)
            if zp_name is not None:
                weights[zp_name] = zero_points
        return base, f"{base}.scales", zp_name


class _FusedGraph(_Graph):
    """The graph variant built for ONNX Runtime's CPU kernels (com.microsoft contrib ops).

    - attention is one ``GroupQueryAttention`` per layer in its shared past/present buffer mode: the
      past KV input is the whole preallocated cache ``[batch, kv_heads, max_len, head_dim]``, the new
      entries are written into it at ``seqlens_k + 1 - seq .. seqlens_k`` and the present output is the
      same buffer, so a runtime that binds one buffer to both copies nothing (rollback: a smaller
      ``seqlens_k`` next call). Rotary runs inside the op when its kernel can (``rotary_dim / 2`` a
      multiple of 8), on a cos/sin table computed in-graph from ``rope_inv_freq``; otherwise with
      standard ops on q and k before it. Sliding windows are ``local_window_size``;
    - RMS norms are ``SimplifiedLayerNormalization``, and each residual add is fused into the next
      norm (``SkipSimplifiedLayerNormalization`` / ``SkipLayerNormalization``, whose fourth output is
      the sum);
    - linear layers are ``FusedMatMul(transB=1)`` on the canonical ``[out, in]`` weight (no transposed
      copy, no reshapes), or ``MatMulNBits`` on its quantized form;
    - a k-token call computes exactly what k 1-token calls compute (the speculative output then is the plain
      output, bit for bit, even with int8 activations): attention runs on one padding row more than the call
      has (``padding``), and a graph that starts from another graph's hidden state (an early exit's suffix,
      the head) norms it with the same fused kernel the full graph uses there;
    - an early exit's ``suffix`` graph ends at the last block's hidden state (``last_hidden``); the runtime
      finishes it with the ``head`` graph the drafts use. ONNX Runtime pre-packs each session's matmul
      weights separately, so a head inside both graphs would be packed twice (SmolLM2's tied head:
      +113 MB, 1.105x the plain decoder's resident memory); this way it is packed once.
    """

    def __init__(self, *args, quantizer: _Quantizer | None = None, pack: bool = True, pad_rows: bool = True):
        super().__init__(*args)
        self.quantizer, self.pack, self.pad_rows = quantizer, pack, pad_rows
        self.seqlens_k = self.total_len = None  # int32 [batch], int32 scalar
        self._padding: tuple[str, str, str, str] | None = None  # see padding()
        self.gqa_rotary = False

    def linear(self, x: str, prefix: str, out_features: int) -> str:
        wname, bias = f"{prefix}.weight", f"{prefix}.bias"
        bias = self.w(bias) if bias in self.weights else ""
        in_features = self.weights[wname].shape[1]
        if self.quantizer is not None:
            q = self.quantizer
            packed, scales, zp = q.tensors(self.weights, wname)
            args = [x, self.w(packed), self.w(scales), self.w(zp) if zp else "", "", bias]
            while args[-1] == "":
                args.pop()
            return self.op("MatMulNBits", *args, domain=CONTRIB, K=in_features, N=out_features, bits=q.bits,
                           block_size=q.block_size, accuracy_level=q.accuracy_level)
        y = self.op("FusedMatMul", x, self.w(wname), domain=CONTRIB, transB=1)
        return self.op("Add", y, bias) if bias else y

    def linear_cat(self, x: str, prefixes: list[str], out_features: int) -> str:
        """One matmul for several linear layers reading the same input (q/k/v, gate/up), ``out_features`` in
        all. Their canonical weights are concatenated in the graph (a Concat of initializers: ONNX Runtime
        folds it into one constant when the session loads and pre-packs that), so the weights file keeps
        only canonical tensors while each step dispatches one kernel instead of three (or two)."""
        biases = [f"{p}.bias" in self.weights for p in prefixes]
        if not self.pack or len(set(biases)) > 1:
            return self.op("Concat", *[self.linear(x, p, self.weights[f"{p}.weight"].shape[0]) for p in prefixes],
                           axis=-1)

        def cat(names: list[str]) -> str:
            return self.op("Concat", *[self.w(n) for n in names], axis=0)

        in_features = self.weights[f"{prefixes[0]}.weight"].shape[1]
        bias = cat([f"{p}.bias" for p in prefixes]) if biases[0] else ""
        if self.quantizer is not None:
            q = self.quantizer
            parts = [q.tensors(self.weights, f"{p}.weight") for p in prefixes]
            args = [x, cat([t[0] for t in parts]), cat([t[1] for t in parts]),
                    cat([t[2] for t in parts]) if parts[0][2] else "", "", bias]
            while args[-1] == "":
                args.pop()
            return self.op("MatMulNBits", *args, domain=CONTRIB, K=in_features, N=out_features, bits=q.bits,
                           block_size=q.block_size, accuracy_level=q.accuracy_level)
        y = self.op("FusedMatMul", x, cat([f"{p}.weight" for p in prefixes]), domain=CONTRIB, transB=1)
        return self.op("Add", y, bias) if bias else y

    def mlp_on(self, i: int, x: str) -> str:
        c = self.c
        if c.mlp != "gated" or not self.pack or c.num_experts:
            return super().mlp_on(i, x)
        both = self.linear_cat(x, [f"layers.{i}.mlp.gate", f"layers.{i}.mlp.up"], 2 * c.intermediate_size)
        gate, up = self.op("Split", both, axis=-1, num_outputs=2, n_out=2)
        return self.linear(self.op("Mul", self.act(gate), up), f"layers.{i}.mlp.down", c.hidden_size)

    def norm(self, x: str, prefix: str) -> str:
        c = self.c
        if c.norm == "layer":
            return super().norm(x, prefix)
        return self.op("SimplifiedLayerNormalization", x, self.w(f"{prefix}.weight"), axis=-1,
                       epsilon=float(c.norm_eps))

    def add_norm(self, h: str, delta: str | None, prefix: str) -> tuple[str, str]:
        """(norm(h + delta), h + delta): the residual add fused into the norm that follows it."""
        if delta is None:
            return self.norm(h, prefix), h
        c = self.c
        if c.norm == "layer":
            outs = self.op("SkipLayerNormalization", delta, h, self.w(f"{prefix}.weight"), self.w(f"{prefix}.bias"),
                           n_out=4, domain=CONTRIB, epsilon=float(c.norm_eps))
        else:
            outs = self.op("SkipSimplifiedLayerNormalization", delta, h, self.w(f"{prefix}.weight"), n_out=4,
                           domain=CONTRIB, epsilon=float(c.norm_eps))
        return outs[0], outs[3]

    def fused_attention(self, i: int, x: str, rope) -> str:
        """Attention of layer ``i`` on the normed input ``x`` [batch, seq, d]."""
        c = self.c
        p = f"layers.{i}.attn"
        hd, nh, nkv = c.head_dim, c.num_heads, c.num_kv_heads
        rope = rope[c.rotary_of(i)]  # the block's table: none for a NoPE block (SmolLM3), local or global
        do_rotary = self.gqa_rotary and rope is not None

        def proj(name: str, n: int) -> str:
            t = self.linear(x, f"{p}.{name}", n * hd)
            norm = f"{p}.{name}_norm" if c.qk_norm and name != "v" else None
            fallback_rope = name != "v" and rope is not None and not self.gqa_rotary
            if norm is None and not fallback_rope:
                return t
            t = self.op("Reshape", t, self.const([0, 0, n, hd], np.int64))
            if norm is not None:
                t = self.norm(t, norm)
            if fallback_rope:
                t = self.rotary(t, rope)
            return self.op("Reshape", t, self.const([0, 0, n * hd], np.int64))

        if self.pack and not c.qk_norm and (rope is None or self.gqa_rotary):
            # packed QKV: GroupQueryAttention splits it itself
            q, k, v = self.linear_cat(x, [f"{p}.q", f"{p}.k", f"{p}.v"], (nh + 2 * nkv) * hd), "", ""
        else:
            q, k, v = proj("q", nh), proj("k", nkv), proj("v", nkv)
        shape = ["batch", nkv, "max_len", hd]
        past_k = self.add_input(f"past_key_values.{i}.key", self.onnx_dtype, shape)
        past_v = self.add_input(f"past_key_values.{i}.value", self.onnx_dtype, shape)
        args = [q, k, v, past_k, past_v, self.seqlens_k, self.total_len]
        if do_rotary:
            args += list(rope)
        out_name = f"gqa_{i}"
        if self.pad_rows:  # one more query row after the real ones (see padding())
            pads, seqlens_k, total_len, _ = self.padding(past_k)
            args[:3] = [self.op("Pad", t, pads, mode="edge") if t else "" for t in args[:3]]
            args[5:7] = [seqlens_k, total_len]
            out_name = f"gqa_{i}_padded"
        present = [f"present.{i}.key", f"present.{i}.value"]
        self._n += 1
        self.nodes.append(helper.make_node(
            "GroupQueryAttention", args, [out_name] + present, name=f"n{self._n}", domain=CONTRIB, num_heads=nh,
            kv_num_heads=nkv, scale=float(c.scale), do_rotary=int(do_rotary),
            local_window_size=int(c.window_of(i)) if c.window_of(i) is not None else -1))
        if self.pad_rows:
            out_name = self.op("Slice", out_name, self.const([0], np.int64), self.padding(past_k)[3],
                               self.const([1], np.int64))
        for name in present:
            self.outputs.append(helper.make_tensor_value_info(name, self.onnx_dtype, shape))
            self.output_records.append({"name": name, "dtype": _elem_name(self.onnx_dtype), "shape": shape})
        return self.linear(out_name, f"{p}.o", c.hidden_size)

    def padding(self, past_k: str) -> tuple[str, str, str, str]:
        """What every GroupQueryAttention of the graph needs to run on one more query row than the call has
        (built once per graph): (``Pad`` pads for q/k/v [batch, seq, hidden], ``seqlens_k`` and
        ``total_sequence_length`` counting that row, the call's ``seq`` as a 1-D end for slicing it off).

        Why: GroupQueryAttention's CPU kernel multiplies attention probabilities by V with MLAS's SGEMM,
        which takes a separate one-row kernel (another summation order) when a call has one query row. So
        a 1-token step and the same position inside a k-token verify round differently (about 1e-6 in
        fp32), and with int8 activations (MatMulNBits ``accuracy_level`` 4) such a difference moves an
        activation across an int8 rounding boundary: SmolLM2's int4/int8 logits then differ by 0.5 to 1
        between the two paths, and speculative output is not the plain output. Every other kernel here
        computes a row the same way whatever the row count (``tests/test_real_shapes.py``). The extra row
        is a copy of the last one, one position later: causal attention keeps it out of every real row's
        result, its KV entry lands in the slot after the call's last position, which the next call
        rewrites before anything reads it, and its output row is sliced off. A call that fills the cache
        to its last slot has no room for it and runs unpadded (only at the context limit: the runtime
        reserves a slot beyond every round). With the past given as a slice (``kv_in_place=False``,
        GroupQueryAttention's growing-cache mode) the padding row always fits."""
        if self._padding is None:
            total64 = self.op("Cast", self.op("Unsqueeze", self.total_len, self.const([0], np.int64)), to=TensorProto.INT64)
            full = self.op("Equal", self.op("Shape", past_k, start=2, end=3), total64)  # a static cache with no slot left
            extra = self.op("Cast", self.op("Not", full), to=TensorProto.INT64)  # [1]: 1, or 0 when full
            pads = self.op("Mul", self.const([0, 0, 0, 0, 1, 0], np.int64), extra)  # after the last row of seq
            extra32 = self.op("Cast", extra, to=TensorProto.INT32)
            total = self.op("Add", self.total_len, self.op("Squeeze", extra32, self.const([0], np.int64)))
            seq = self.op("Slice", self.bt_shape, self.const([1], np.int64), self.const([2], np.int64))
            self._padding = pads, self.op("Add", self.seqlens_k, extra32), total, seq
        return self._padding

    def gqa_rope_cache(self, table: str = "global") -> tuple[str, str]:
        """cos/sin tables [total_len, rotary_dim / 2] for positions 0..total_len-1 (GQA indexes them)."""
        c = self.c
        total = self.op("Cast", self.total_len, to=TensorProto.INT64)
        if self.pad_rows:  # room for the padding row's position (see padding())
            total = self.op("Add", total, self.const(1, np.int64))
        pos = self.op("Range", self.const(0, np.int64), total, self.const(1, np.int64))
        inv_freq = "rope_local_inv_freq" if table == "local" else "rope_inv_freq"
        f = self.op("Mul", self.op("Unsqueeze", self.op("Cast", pos, to=TensorProto.FLOAT), self.const([-1], np.int64)),
                    self.w(inv_freq))
        cos, sin = self.op("Cos", f), self.op("Sin", f)
        scale = float(c.rope_attention_scaling) if table == "global" else 1.0
        if scale != 1.0:
            s = self.const(np.float32(scale))
            cos, sin = self.op("Mul", cos, s), self.op("Mul", sin, s)
        if self.dtype != np.float32:
            cos, sin = self.op("Cast", cos, to=self.onnx_dtype), self.op("Cast", sin, to=self.onnx_dtype)
        return cos, sin

    def to_model(self) -> onnx.ModelProto:
        model = super().to_model()
        model.opset_import.append(helper.make_opsetid(CONTRIB, 1))
        return model


def fused_supports(config: ArchConfig) -> bool:
    """Whether ``_build_fused`` covers this block: pre-norms only and per-head q/k norm (OLMo 2's post-norms
    and whole-projection q/k norm get the standard graphs)."""
    return config.pre_norm and not config.post_norm and config.qk_norm_over == "head"


def gqa_rotary_ok(config: ArchConfig) -> bool:
    """Whether GroupQueryAttention's CPU kernel can apply this model's rotary itself."""
    half = config.rotary_dim // 2
    return config.positions == "rotary" and half % 8 == 0 and config.rotary_dim <= config.head_dim


def _build_fused(kind: str, name: str, config: ArchConfig, dtype: np.dtype, weights: dict[str, np.ndarray],
                 start: int, stop: int, skip_attn=frozenset(), skip_mlp=frozenset(),
                 quantizer: _Quantizer | None = None, pack: bool = True, pad_rows: bool = True) -> _FusedGraph:
    """``_build`` for the fused variant: same kinds, same blocks, same names of weights, inputs and outputs,
    except that past KV inputs are the whole cache buffers and the graph also takes ``seqlens_k``
    ([batch] int32: total length - 1) and ``total_sequence_length`` (int32 scalar), as
    GroupQueryAttention does."""
    c = config
    g = _FusedGraph(name, config, dtype, weights, quantizer=quantizer, pack=pack, pad_rows=pad_rows)
    d = c.hidden_size
    attn_layers = [i for i in range(start, stop) if i not in skip_attn]
    if kind in ("full", "prefix"):
        ids = g.add_input("input_ids", TensorProto.INT64, ["batch", "seq"])
        g.bt_shape = g.op("Shape", ids)
    else:
        hidden_in = g.add_input("hidden", g.onnx_dtype, ["batch", "seq", d])
        g.bt_shape = g.op("Shape", hidden_in, end=2)
    pos = None
    if attn_layers:
        g.seqlens_k = g.add_input("seqlens_k", TensorProto.INT32, ["batch"])
        g.total_len = g.add_input("total_sequence_length", TensorProto.INT32, [])
        g.gqa_rotary = gqa_rotary_ok(c)
        if c.positions == "learned" or not g.gqa_rotary:
            seq = g.op("Gather", g.bt_shape, g.const(1, np.int64), axis=0)
            total = g.op("Cast", g.total_len, to=TensorProto.INT64)
            pos = g.op("Range", g.op("Sub", total, seq), total, g.const(1, np.int64))
    elif kind in ("full", "prefix") and c.positions == "learned":
        pos = g.add_input("position_ids", TensorProto.INT64, ["batch", "seq"])
    if kind in ("full", "prefix"):
        h = g.op("Gather", g.w("embed.weight"), ids, axis=0)
        if c.embed_scale is not None:
            h = g.op("Mul", h, g.const(np.array(c.embed_scale, dtype)))
        if c.positions == "learned":
            pid = g.op("Add", pos, g.const(int(c.position_offset), np.int64)) if c.position_offset else pos
            h = g.op("Add", h, g.op("Gather", g.w("pos_embed.weight"), pid, axis=0))
    else:
        h = hidden_in
    rope = {None: None}  # per rotary table (ArchConfig.rotary_of), each built once
    for table in {c.rotary_of(i) for i in attn_layers} - {None}:
        if g.gqa_rotary:
            rope[table] = g.gqa_rope_cache(table)
        else:
            cos, sin = g.rope(pos, table)  # [seq, rot]; broadcast over heads of [batch, seq, heads, head_dim]
            axis = g.const([1], np.int64)
            rope[table] = g.op("Unsqueeze", cos, axis), g.op("Unsqueeze", sin, axis)
    delta = None  # the pending residual branch: the stream is h + delta
    if kind in ("suffix", "head"):
        # The hidden state comes from another graph (an early exit's prefix or suffix), where the full graph
        # has h + delta and a fused residual-add norm. A zero branch gives the same: the skip norm's sum is h
        # itself and its normed output comes from the same kernel, so the split graphs compute the full
        # graph's function to the bit (a plain norm kernel rounds differently, and int8 activations turn
        # that into logits about 1e-2 apart: tests/test_real_shapes.py).
        delta = g.op("Mul", h, g.const(np.array(0.0, dtype)))
    if kind != "head":
        for i in range(start, stop):
            run_attn, run_mlp = i not in skip_attn, i not in skip_mlp
            if c.parallel_residual:
                if not (run_attn or run_mlp):
                    continue
                x, h = g.add_norm(h, delta, f"layers.{i}.attn_norm" if run_attn else f"layers.{i}.mlp_norm")
                branches = []
                if run_attn:
                    branches.append(g.fused_attention(i, x, rope))
                if run_mlp:
                    branches.append(g.mlp_on(i, g.norm(h, f"layers.{i}.mlp_norm") if run_attn else x))
                delta = branches[0] if len(branches) == 1 else g.op("Add", *branches)
                continue
            if run_attn:
                x, h = g.add_norm(h, delta, f"layers.{i}.attn_norm")
                delta = g.fused_attention(i, x, rope)
            if run_mlp:
                x, h = g.add_norm(h, delta, f"layers.{i}.mlp_norm")
                delta = g.mlp_on(i, x)
    if kind in ("prefix", "suffix"):  # a fused suffix leaves the head to the head graph (see _FusedGraph)
        out = g.op("Add", h, delta) if delta is not None else h
        g.add_output(out, "hidden" if kind == "prefix" else "last_hidden", g.onnx_dtype, ["batch", "seq", d])
    else:
        head_w = "embed.weight" if c.tie_word_embeddings else "lm_head.weight"
        x, _ = g.add_norm(h, delta, "norm")
        logits = g.linear(x, head_w.removesuffix(".weight"), c.vocab_size)  # with lm_head.bias when untied
        if c.lm_head_bias and c.tie_word_embeddings:
            logits = g.op("Add", logits, g.w("lm_head.bias"))
        g.add_output(g.logit_post(logits), "logits", g.onnx_dtype, ["batch", "seq", c.vocab_size])
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


def export_options(record: dict[str, Any] | None) -> dict[str, Any]:
    """The ``export_onnx_weights`` options an ONNX record was written with, so that re-exporting an
    artifact (``tune``) writes the same kind of graphs: variant and quantization scheme."""
    if not record:
        return {}
    options: dict[str, Any] = {"variant": record.get("variant", "standard")}
    if options["variant"] == "fused":
        options["pack"] = record.get("packed_projections", True)
        options["pad_rows"] = record.get("padded_attention_rows", bool(record.get("quantization")))
    quant = record.get("quantization")
    if quant:
        options.update(quantize=quant["scheme"], block_size=quant["block_size"], accuracy_level=quant["accuracy_level"])
    return options


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
                relative_to: Path | None = None, **options) -> dict[str, Any]:
    """Write the ONNX graphs of ``decoder`` (a ``runtime.decoder.Decoder``; its ``config`` and
    ``state_dict()`` are used) and of ``plans``' drafts, plus one shared ``weights.bin``, into
    ``out_dir``; return the manifest record for ``backends["onnx"]``.

    File paths in the record are relative to ``relative_to`` (default: ``out_dir.parent``, i.e. the
    artifact root when ``out_dir`` is ``<artifact>/onnx``). ``options``: see ``export_onnx_weights``.
    """
    return export_onnx_weights(decoder.config, decoder.state_dict(), plans, out_dir, dtype, relative_to, **options)


def export_onnx_weights(config: ArchConfig, weights, plans: dict[str, DraftPlan], out_dir: Path,
                        dtype: str = "float32", relative_to: Path | None = None, variant: str = "standard",
                        quantize: str | None = None, block_size: int = DEFAULT_BLOCK_SIZE,
                        accuracy_level: int = DEFAULT_ACCURACY_LEVEL, pack: bool = True, pad_rows: bool | None = None,
                        draft_heads: dict[str, Path] | None = None) -> dict[str, Any]:
    """``export_onnx`` from an ``ArchConfig`` and canonical weights (name -> torch tensor or numpy array,
    as in weights/model.safetensors; a tied lm_head may be absent). No torch needed for numpy weights.

    ``variant``: "standard" (ONNX ops only, passes ``onnx.checker``, runs on any execution provider) or
    "fused" (ONNX Runtime contrib ops, KV cache updated in place; see ``_FusedGraph``). ``quantize``
    ("int8" / "int4", fused only): weight-only ``MatMulNBits`` for every linear layer and the head, in
    blocks of ``block_size`` along the input dimension; ``accuracy_level`` is MatMulNBits' (0: unset,
    4: int8 activations, ONNX Runtime's fast CPU path). ``pack`` (fused only): q/k/v and gate/up as one
    matmul each, on weights concatenated in the graph (see ``_FusedGraph.linear_cat``). ``pad_rows`` (fused
    only; default: with ``quantize``): attention always runs on one more query row than the call has, so that
    a k-token verify computes exactly the 1-token steps it replaces (see ``_FusedGraph.padding``). Quantized
    graphs need it (int8 activations turn MLAS's one-row rounding into whole quantization steps); fp32 graphs
    agree within the near-tie rule without it, and it costs their plain steps (about 0.88x measured).
    ``draft_heads`` maps
    plans' draft head files (exit adapters, reduced vocabularies) to where they are now; their graphs:
    ``speccompile/export_adapter.py``."""
    if dtype not in ("float32", "float16"):
        raise ValueError(f"ONNX export supports float32 and float16, not {dtype!r}")
    if variant not in VARIANTS:
        raise ValueError(f"unknown ONNX graph variant {variant!r}; use one of {VARIANTS}")
    quantizer = None
    if pad_rows is None:
        pad_rows = quantize is not None
    if quantize is not None:
        if variant != "fused" or dtype != "float32":
            raise ValueError("quantized ONNX export needs variant='fused' and float32 weights")
        quantizer = _Quantizer(quantize, block_size, accuracy_level)
    np_dtype = np.dtype(dtype)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    root = Path(relative_to) if relative_to is not None else out_dir.parent
    rel = lambda p: Path(p).resolve().relative_to(root.resolve()).as_posix()  # noqa: E731
    weights = _numpy_weights(weights, np_dtype)
    L = config.num_layers

    if variant == "fused" and not fused_supports(config):
        if quantizer is not None:
            raise ValueError(f"{config.model_type}: the fused graphs (which --quantize needs) do not support "
                             "this block's norms, NoPE layers or head yet; export without --quantize")
        variant = "standard"  # the portable graphs: ONNX Runtime runs them too, with the past KV copied per call
    if variant == "fused":
        def build(*args, **kwargs):
            return _build_fused(*args, **kwargs, quantizer=quantizer, pack=pack, pad_rows=pad_rows)
    else:
        build = _build
    graphs: dict[str, _Graph] = {"verify": build("full", "verify", config, np_dtype, weights, 0, L)}
    plan_records: dict[str, dict[str, Any]] = {}
    skip_graphs: dict[tuple, str] = {}
    for plan_name, plan in plans.items():
        plan.validate(L)
        if plan.is_early_exit:
            e = plan.exit_layer
            if f"prefix.{e}" not in graphs:
                graphs[f"prefix.{e}"] = build("prefix", f"prefix.{e}", config, np_dtype, weights, 0, e)
                graphs[f"suffix.{e}"] = build("suffix", f"suffix.{e}", config, np_dtype, weights, e, L)
            if "head" not in graphs:
                graphs["head"] = build("head", "head", config, np_dtype, weights, L, L)
            plan_records[plan_name] = {"kind": "early_exit", "prefix": f"prefix.{e}", "suffix": f"suffix.{e}",
                                       "head": "head", "exit_layer": e}
        else:
            skips = (tuple(sorted(set(plan.skip_attn))), tuple(sorted(set(plan.skip_mlp))))
            key = skip_graphs.get(skips)
            if key is None:  # plans that skip the same sublayers share one graph
                key = skip_graphs[skips] = f"skip.{_safe(plan_name)}"
                graphs[key] = build("full", key, config, np_dtype, weights, 0, L, frozenset(skips[0]),
                                    frozenset(skips[1]))
            plan_records[plan_name] = {"kind": "layer_skip", "draft": key, "verify": "verify"}
        if plan.draft_head_file is not None:  # exit adapter / reduced vocabulary: extra graphs, same weights file
            from speccompile.export_adapter import add_draft_head_graphs

            add_draft_head_graphs(graphs, plan_records[plan_name], plan, config, np_dtype, weights, draft_heads, build)

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

    # What each graph computes, for the backends' segment lookup (runtime/backends/graph_index.py).
    segments = segments_from_plan_records({"graphs": graphs, "plans": plan_records}, plans, L)
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
        if variant == "standard":  # the checker does not know ONNX Runtime's contrib ops
            onnx.checker.check_model(str(path), full_check=True)
        graph_records[key] = {
            "file": rel(path), "variant": getattr(g, "variant", variant), "inputs": g.input_records,
            "outputs": g.output_records,
            "initializers": list(g.used), "segment": segments.get(key),
        }

    return {
        "format_version": FORMAT_VERSION,
        "opset": OPSET,
        "dtype": dtype,
        "exporter": "speccompile.export_onnx (onnx.helper)",
        "variant": variant,
        "quantization": quantizer.record() if quantizer is not None else None,
        "packed_projections": pack if variant == "fused" else False,
        "padded_attention_rows": pad_rows if variant == "fused" else False,
        "weights": rel(weights_path),
        "weights_bytes": total_bytes,
        "tensors": tensors,
        "graphs": graph_records,
        "plans": plan_records,
    }


__all__ = ["OPSET", "QUANT_BITS", "VARIANTS", "export_onnx", "export_onnx_weights", "export_options"]
