"""The ONNX graph builder: the ops every variant shares, and the standard variant (ONNX ops only).

Graphs are **built directly with ``onnx.helper``** from the decoder's ``ArchConfig`` and canonical state
dict, not traced with ``torch.onnx.export``:

- every graph names its initializers with the canonical weight names (``layers.3.attn.q.weight``), so one
  weights file written once serves every graph: no renaming, no per-graph constant folding, no
  after-the-fact de-duplication of exporter output;
- linear layers use the canonical ``[out, in]`` weights transposed inside the op (``Gemm(transB=1)``,
  ``FusedMatMul(transB=1)``), so no exporter-made transposed copies appear;
- the families differ only by ``ArchConfig`` switches, exactly as in ``runtime/backends/torch/decoder.py``, whose forward
  pass this mirrors op for op; export is instant and independent of the torch exporter's behaviour.

As in onnxruntime-genai's ``builder.py``, a layer is described once (``onnx_blocks.build_blocks``) and the
variant chooses the op inside ``linear``, ``norm``, ``add_norm``, ``attention`` and the position inputs
(``declare_positions``). ``GraphBuilder`` here is the standard variant; ``onnx_fused.FusedGraph`` the
other.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper

from speccompile.runtime.artifact.manifest import ArchConfig

OPSET = 18
IR_VERSION = 8

NP_TO_ONNX = {
    np.dtype(np.float32): TensorProto.FLOAT,
    np.dtype(np.float16): TensorProto.FLOAT16,
    np.dtype(np.int64): TensorProto.INT64,
    np.dtype(np.uint8): TensorProto.UINT8,
    np.dtype(np.int32): TensorProto.INT32,
}


def elem_name(elem: int) -> str:
    return {
        TensorProto.FLOAT: "float32",
        TensorProto.FLOAT16: "float16",
        TensorProto.INT64: "int64",
        TensorProto.INT32: "int32",
    }[elem]


class GraphBuilder:
    """A graph under construction (nodes with generated output names, constants as Constant nodes), with
    the standard variant's ops: past KV in as ``[batch, kv_heads, past_len, head_dim]`` and present out
    (concatenated), positions from the past length, attention from MatMul / Softmax on an additive mask.
    Passes ``onnx.checker`` and runs on any execution provider."""

    variant = "standard"
    head_after_hidden = True  # a graph that starts from a hidden state may end in the head (see FusedGraph)

    def __init__(self, name: str, config: ArchConfig, dtype: np.dtype, weights: dict[str, np.ndarray]):
        self.name, self.c, self.dtype, self.weights = name, config, dtype, weights
        self.onnx_dtype = NP_TO_ONNX[dtype]
        self.nodes: list[onnx.NodeProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self.used: list[str] = []
        self.input_records: list[dict[str, Any]] = []
        self.output_records: list[dict[str, Any]] = []
        self._n = 0
        self._shape_cache: dict[int, str] = {}
        self.bt_shape: str | None = None  # [batch, seq] as int64
        self.pos: str | None = None  # the call's absolute positions, where a variant needs them
        self.ropes: dict[str | None, Any] = {None: None}  # rotary table (ArchConfig.rotary_of) -> what attention takes
        self.masks: dict[int | None, str] = {}  # window -> additive mask

    # -- graph plumbing ----------------------------------------------------------------------------
    def op(self, op_type: str, *inputs: str, n_out: int = 1, **attrs) -> Any:
        self._n += 1
        outs = [f"{op_type.lower()}_{self._n}" + (f"_{k}" if n_out > 1 else "") for k in range(n_out)]
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, name=f"n{self._n}", **attrs))
        return outs[0] if n_out == 1 else outs

    def const(self, value, dtype=None) -> str:
        arr = np.asarray(value, dtype=dtype)
        self._n += 1
        name = f"const_{self._n}"
        self.nodes.append(
            helper.make_node(
                "Constant",
                [],
                [name],
                value=helper.make_tensor(name, NP_TO_ONNX[arr.dtype], arr.shape, arr.flatten().tolist()),
            )
        )
        return name

    def ints(self, *values: int) -> str:
        return self.const(list(values), np.int64)

    def w(self, name: str) -> str:
        if name not in self.weights:
            raise KeyError(f"decoder has no weight {name!r}")
        if name not in self.used:
            self.used.append(name)
        return name

    def add_input(self, name: str, elem: int, shape: list) -> str:
        if any(vi.name == name for vi in self.inputs):
            return name
        self.inputs.append(helper.make_tensor_value_info(name, elem, shape))
        self.input_records.append({"name": name, "dtype": elem_name(elem), "shape": shape})
        return name

    def declare_output(self, name: str, elem: int, shape: list) -> None:
        self.outputs.append(helper.make_tensor_value_info(name, elem, shape))
        self.output_records.append({"name": name, "dtype": elem_name(elem), "shape": shape})

    def add_output(self, src: str, name: str, elem: int, shape: list) -> None:
        self.nodes.append(helper.make_node("Identity", [src], [name], name=f"out_{name}"))
        self.declare_output(name, elem, shape)

    def out_shape(self, last: int) -> str:
        if last not in self._shape_cache:
            self._shape_cache[last] = self.op("Concat", self.bt_shape, self.ints(last), axis=0)
        return self._shape_cache[last]

    def to_model(self) -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, self.name.replace(".", "_"), self.inputs, self.outputs)
        return helper.make_model(
            graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="speccompile", ir_version=IR_VERSION
        )

    # -- inputs ------------------------------------------------------------------------------------
    def tokens_input(self) -> str:
        ids = self.add_input("input_ids", TensorProto.INT64, ["batch", "seq"])
        self.bt_shape = self.op("Shape", ids)
        return ids

    def hidden_input(self) -> str:
        hidden = self.add_input("hidden", self.onnx_dtype, ["batch", "seq", self.c.hidden_size])
        self.bt_shape = self.op("Shape", hidden, end=2)
        return hidden

    def past_shape(self) -> list:
        return ["batch", self.c.num_kv_heads, "past_len", self.c.head_dim]

    def declare_positions(self, attn_layers: list[int], learned_from_tokens: bool) -> None:
        """Positions ``past_len .. past_len + seq - 1``, ``past_len`` read from the first running attention
        layer's past key (declared first, so inputs are ids/hidden, then past KV by layer); a graph with no
        attention that still needs positions (learned positions, every attention skipped) takes
        ``position_ids [batch, seq]``. Then each rotary table and each window's mask, built once."""
        c = self.c
        if attn_layers:
            past_k = self.add_input(f"past_key_values.{attn_layers[0]}.key", self.onnx_dtype, self.past_shape())
            past_len = self.op("Gather", self.op("Shape", past_k), self.const(2, np.int64), axis=0)
            seq = self.op("Gather", self.bt_shape, self.const(1, np.int64), axis=0)
            self.pos = self.op("Range", past_len, self.op("Add", past_len, seq), self.const(1, np.int64))
            for table in {c.rotary_of(i) for i in attn_layers} - {None}:
                self.ropes[table] = self.rope(self.pos, table)
            total = self.op("Add", past_len, seq)
            self.masks = {
                window: self.mask(self.pos, total, window) for window in {c.window_of(i) for i in attn_layers}
            }
        elif learned_from_tokens:
            self.pos = self.add_input("position_ids", TensorProto.INT64, ["batch", "seq"])

    def residual_start(self, h: str) -> str | None:
        """The pending residual branch of a graph that starts from another graph's hidden state (None: none)."""
        return None

    # -- ops shared by every variant ---------------------------------------------------------------
    def embed(self, ids: str) -> str:
        c = self.c
        h = self.op("Gather", self.w("embed.weight"), ids, axis=0)
        if c.embed_scale is not None:
            h = self.op("Mul", h, self.const(np.array(c.embed_scale, self.dtype)))
        if c.positions == "learned":
            pid = (
                self.op("Add", self.pos, self.const(int(c.position_offset), np.int64))
                if c.position_offset
                else self.pos
            )
            h = self.op("Add", h, self.op("Gather", self.w("pos_embed.weight"), pid, axis=0))
        return h

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

    def mlp(self, i: int, x: str) -> str:
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
        top_w, top_i = self.op("TopK", probs, self.ints(c.experts_per_token), axis=-1, n_out=2)
        top_w = self.op("Div", top_w, self.op("ReduceSum", top_w, self.ints(-1), keepdims=1))
        routing = self.op(
            "ScatterElements", self.op("Mul", probs, self.const(np.array(0.0, self.dtype))), top_i, top_w, axis=-1
        )
        out = None
        for e in range(c.num_experts):
            weight = self.op("Slice", routing, self.ints(e), self.ints(e + 1), self.ints(-1))
            term = self.op("Mul", self.expert(f"{p}.experts.{e}", x), weight)
            out = term if out is None else self.op("Add", out, term)
        return out

    def expert(self, p: str, x: str) -> str:
        """A (gated or plain) MLP whose weights are under ``p`` (``layers.i.mlp``, or one expert of it)."""
        c = self.c
        if c.mlp == "gated":
            return self.gated_mlp(p, x, c.intermediate_size, c.hidden_size)
        return self.linear(self.act(self.linear(x, f"{p}.up", c.intermediate_size)), f"{p}.down", c.hidden_size)

    def gated_mlp(self, p: str, x: str, width: int, out: int) -> str:
        """down(act(gate(x)) * up(x)) on the weights under ``p`` (an MLP, an expert, an exit adapter)."""
        up = self.linear(x, f"{p}.up", width)
        inner = self.op("Mul", self.act(self.linear(x, f"{p}.gate", width)), up)
        return self.linear(inner, f"{p}.down", out)

    def rope(self, pos: str, table: str = "global") -> tuple[str, str]:
        """cos/sin ``[seq, rotary_dim]`` at positions ``pos``, from the ``rope_inv_freq`` weight."""
        inv_freq = "rope_local_inv_freq" if table == "local" else "rope_inv_freq"
        f = self.op(
            "Mul", self.op("Unsqueeze", self.op("Cast", pos, to=TensorProto.FLOAT), self.ints(-1)), self.w(inv_freq)
        )
        return self.rope_scaled(self.op("Concat", f, f, axis=-1), table)

    def rope_scaled(self, angles: str, table: str) -> tuple[str, str]:
        """cos/sin of ``angles``, scaled as the table says (``rope_attention_scaling``) and cast to the graph's dtype."""
        cos, sin = self.op("Cos", angles), self.op("Sin", angles)
        scale = float(self.c.rope_attention_scaling) if table == "global" else 1.0
        if scale != 1.0:
            s = self.const(np.float32(scale))
            cos, sin = self.op("Mul", cos, s), self.op("Mul", sin, s)
        if self.dtype != np.float32:
            cos, sin = self.op("Cast", cos, to=self.onnx_dtype), self.op("Cast", sin, to=self.onnx_dtype)
        return cos, sin

    def rotary(self, x: str, rope: tuple[str, str]) -> str:
        """Rotary on the first ``rotary_dim`` dims of the last axis of ``x`` (``decoder.apply_rotary``)."""
        c = self.c
        cos, sin = rope
        rot, half = c.rotary_dim, c.rotary_dim // 2
        if rot == c.head_dim:
            x_rot, x_pass = x, None
        else:
            x_rot = self.op("Slice", x, self.ints(0), self.ints(rot), self.ints(-1))
            x_pass = self.op("Slice", x, self.ints(rot), self.ints(c.head_dim), self.ints(-1))
        x1 = self.op("Slice", x_rot, self.ints(0), self.ints(half), self.ints(-1))
        x2 = self.op("Slice", x_rot, self.ints(half), self.ints(rot), self.ints(-1))
        rotated = self.op("Concat", self.op("Neg", x2), x1, axis=-1)
        out = self.op("Add", self.op("Mul", x_rot, cos), self.op("Mul", rotated, sin))
        return out if x_pass is None else self.op("Concat", out, x_pass, axis=-1)

    def mask(self, pos: str, total: str, window: int | None) -> str:
        """Additive [seq, total] mask: 0 where key position <= query position (and inside the window)."""
        q_pos = self.op("Unsqueeze", pos, self.ints(-1))
        k_pos = self.op("Range", self.const(0, np.int64), total, self.const(1, np.int64))
        allowed = self.op("LessOrEqual", k_pos, q_pos)
        if window is not None:
            lo = self.op("Sub", q_pos, self.const(int(window), np.int64))
            allowed = self.op("And", allowed, self.op("Greater", k_pos, lo))
        return self.op(
            "Where", allowed, self.const(np.array(0.0, self.dtype)), self.const(np.array(-np.inf, self.dtype))
        )

    def head(self, h: str, delta: str | None) -> str:
        """Final norm and lm_head (+ its bias, logit scale, softcap: ``Decoder.head``) on the stream ``h + delta``."""
        c = self.c
        x, _ = self.add_norm(h, delta, "norm")
        logits = self.linear(x, "embed" if c.tie_word_embeddings else "lm_head", c.vocab_size)  # + lm_head.bias untied
        if c.lm_head_bias and c.tie_word_embeddings:
            logits = self.op("Add", logits, self.w("lm_head.bias"))
        if c.logit_scale is not None:
            logits = self.op("Mul", logits, self.const(np.array(c.logit_scale, self.dtype)))
        if c.final_softcap is not None:
            cap = self.const(np.array(c.final_softcap, self.dtype))
            logits = self.op("Mul", self.op("Tanh", self.op("Div", logits, cap)), cap)
        return logits

    # -- the variant's ops -------------------------------------------------------------------------
    def linear(self, x: str, prefix: str, out_features: int) -> str:
        """x [B, T, in] @ W[out, in]^T + b, as Gemm on the canonical weight (no transposed copy)."""
        in_features = self.weights[f"{prefix}.weight"].shape[1]
        x2 = self.op("Reshape", x, self.ints(-1, in_features))
        args = [x2, self.w(f"{prefix}.weight")]
        if f"{prefix}.bias" in self.weights:
            args.append(self.w(f"{prefix}.bias"))
        return self.op("Reshape", self.op("Gemm", *args, transB=1), self.out_shape(out_features))

    def norm(self, x: str, prefix: str) -> str:
        c = self.c
        if c.norm == "layer":
            return self.op(
                "LayerNormalization",
                x,
                self.w(f"{prefix}.weight"),
                self.w(f"{prefix}.bias"),
                axis=-1,
                epsilon=float(c.norm_eps),
            )
        x32 = x if self.dtype == np.float32 else self.op("Cast", x, to=TensorProto.FLOAT)
        ms = self.op("ReduceMean", self.op("Mul", x32, x32), self.ints(-1), keepdims=1)
        inv = self.op("Reciprocal", self.op("Sqrt", self.op("Add", ms, self.const(np.float32(c.norm_eps)))))
        y = self.op("Mul", x32, inv)
        if self.dtype != np.float32:
            y = self.op("Cast", y, to=self.onnx_dtype)
        return self.op("Mul", self.w(f"{prefix}.weight"), y)

    def add_norm(self, h: str, delta: str | None, prefix: str | None) -> tuple[str, str]:
        """(norm(h + delta), h + delta): the residual add and the norm that follows it (no norm: ``prefix`` None)."""
        total = h if delta is None else self.op("Add", h, delta)
        return (self.norm(total, prefix) if prefix is not None else total), total

    def add_branches(self, h: str, branches: list[str]) -> tuple[str, str | None]:
        """A parallel block's residual: the stream ``h`` plus its branches, as (stream, pending branch). Here
        added one by one, as ``Decoder.run_blocks`` does."""
        for branch in branches:
            h = self.op("Add", h, branch)
        return h, None

    def attention(self, i: int, x: str) -> str:
        """Block ``i``'s attention on its normed input ``x`` [batch, seq, d], up to the o projection."""
        c = self.c
        p = f"layers.{i}.attn"
        hd, nh, nkv = c.head_dim, c.num_heads, c.num_kv_heads
        over_proj = c.qk_norm_over == "proj"

        def heads(name: str, n: int, norm: str | None) -> str:
            t = self.linear(x, f"{p}.{name}", n * hd)
            if norm is not None and over_proj:
                t = self.norm(t, norm)
            t = self.op("Reshape", t, self.ints(0, 0, n, hd))
            if norm is not None and not over_proj:
                t = self.norm(t, norm)
            return self.op("Transpose", t, perm=[0, 2, 1, 3])

        q = heads("q", nh, f"{p}.q_norm" if c.qk_norm else None)
        k = heads("k", nkv, f"{p}.k_norm" if c.qk_norm else None)
        v = heads("v", nkv, None)
        rope = self.ropes[c.rotary_of(i)]
        if rope is not None:
            q, k = self.rotary(q, rope), self.rotary(k, rope)
        past_k = self.add_input(f"past_key_values.{i}.key", self.onnx_dtype, self.past_shape())
        past_v = self.add_input(f"past_key_values.{i}.value", self.onnx_dtype, self.past_shape())
        k_all = self.op("Concat", past_k, k, axis=2)
        v_all = self.op("Concat", past_v, v, axis=2)
        present = ["batch", nkv, "total_len", hd]
        self.add_output(k_all, f"present.{i}.key", self.onnx_dtype, present)
        self.add_output(v_all, f"present.{i}.value", self.onnx_dtype, present)
        if nh != nkv:  # GQA: query head h reads kv head h // groups
            q = self.op("Reshape", q, self.ints(0, nkv, nh // nkv, -1, hd))
            k_t = self.op("Unsqueeze", self.op("Transpose", k_all, perm=[0, 1, 3, 2]), self.ints(2))
            v_use = self.op("Unsqueeze", v_all, self.ints(2))
        else:
            k_t, v_use = self.op("Transpose", k_all, perm=[0, 1, 3, 2]), v_all
        scale = self.const(np.array(c.scale, self.dtype))
        scores = self.op("Add", self.op("Mul", self.op("MatMul", q, k_t), scale), self.masks[c.window_of(i)])
        out = self.op("MatMul", self.op("Softmax", scores, axis=-1), v_use)
        if nh != nkv:
            out = self.op("Reshape", out, self.ints(0, nh, -1, hd))
        out = self.op("Reshape", self.op("Transpose", out, perm=[0, 2, 1, 3]), self.ints(0, 0, nh * hd))
        return self.linear(out, f"{p}.o", c.hidden_size)


__all__ = ["GraphBuilder", "IR_VERSION", "NP_TO_ONNX", "OPSET", "elem_name"]
