"""The fused graph variant: ONNX Runtime's CPU contrib ops, the KV cache updated in place.

- attention is one ``GroupQueryAttention`` per layer in its shared past/present buffer mode: the past KV
  input is the whole preallocated cache ``[batch, kv_heads, max_len, head_dim]``, the new entries are
  written into it at ``seqlens_k + 1 - seq .. seqlens_k`` and the present output is the same buffer, so a
  runtime that binds one buffer to both copies nothing (rollback: a smaller ``seqlens_k`` next call).
  Rotary runs inside the op when its kernel can (``rotary_dim / 2`` a multiple of 8), on a cos/sin table
  computed in-graph from ``rope_inv_freq``; otherwise with standard ops on q and k before it. Sliding
  windows are ``local_window_size``;
- RMS norms are ``SimplifiedLayerNormalization``, and each residual add is fused into the next norm
  (``SkipSimplifiedLayerNormalization`` / ``SkipLayerNormalization``, whose fourth output is the sum);
- linear layers are ``FusedMatMul(transB=1)`` on the canonical ``[out, in]`` weight (no transposed copy,
  no reshapes), or ``MatMulNBits`` on its quantized form (``onnx_quant.Quantizer``);
- a k-token call computes exactly what k 1-token calls compute (the speculative output then is the plain
  output, bit for bit, even with int8 activations): attention runs on one padding row more than the call
  has (``padding``), quantized products too where the CPU's one-row kernel rounds differently
  (``pad_products``), and a graph that starts from another graph's hidden state (an early exit's suffix, the
  head) norms it with the same fused kernel the full graph uses there (``residual_start``);
- a ``packed`` graph runs rows of several sequences, each of its own width (one-token steps, verifies, token trees,
  prompt chunks), in one call: their tokens come as one stream ``[1, tokens]`` on which the projections, norms
  and MLPs run, and only GroupQueryAttention sees them laid out per sequence, right-padded to the widest row
  (``query_seqlens``; ``packed_layout``);
- a graph that starts from a hidden state ends at its last block's hidden state (``last_hidden``), and the runtime
  finishes it with the ``head`` graph the drafts use (``head_after_hidden``): ONNX Runtime pre-packs each session's
  matmul weights separately, so a head inside both graphs would be packed twice (a noticeable share of a small
  model's resident memory; measured: docs/history.md, 'Figures behind the code's constants'); this way it is packed
  once.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from speccompile.runtime.artifact.manifest import ArchConfig

from .onnx_graph import GraphBuilder, elem_name
from .onnx_quant import CONTRIB, Quantizer


def gqa_rotary_ok(config: ArchConfig) -> bool:
    """Whether GroupQueryAttention's CPU kernel can apply this model's rotary itself."""
    half = config.rotary_dim // 2
    return config.positions == "rotary" and half % 8 == 0 and config.rotary_dim <= config.head_dim


class FusedGraph(GraphBuilder):
    """See the module docstring. ``pack``: q/k/v and gate/up as one matmul each (``linear_cat``);
    ``pad_rows``: attention on one more query row than the call has (``padding``; not in a ``packed`` graph,
    whose caller chooses the attention's width: ``packed_layout``); ``packed``: the rows of several sequences in
    one call, whatever their widths (``packed_layout``); ``pad_products``: every
    ``MatMulNBits`` on one more row than the call has (a copy of its last, sliced off after), so that a one-token
    step never takes a one-row kernel where the build's CPU has one that rounds differently
    (``Quantizer.one_row_path_differs``)."""

    variant = "fused"
    head_after_hidden = False

    def __init__(
        self,
        *args,
        quantizer: Quantizer | None = None,
        pack: bool = True,
        pad_rows: bool = True,
        tree: bool = False,
        pad_products: bool = False,
        packed: bool = False,
        positions: bool = False,
        logit_rows: bool = False,
    ):
        super().__init__(*args)
        self.quantizer, self.pack, self.tree, self.packed = quantizer, pack, tree, packed
        self.positions = positions or tree
        self.logit_rows = logit_rows
        self.pad_rows = pad_rows and not packed
        self.pad_products = pad_products
        self.query_seqlens = self.token_index = self.token_place = None  # a packed graph's layout (packed_layout)
        self._seq_end: str | None = None
        self.position_ids = self.attention_bias = None  # a tree-capable graph's inputs (``declare_positions``)
        self._tree_args: tuple[str, str] | None = None
        self.seqlens_k = self.total_len = None  # int32 [batch], int32 scalar
        self._padding: tuple[str, str, str, str] | None = None  # see padding()
        self.gqa_rotary = False

    def past_shape(self) -> list:
        return ["batch", self.c.num_kv_heads, "max_len", self.c.head_dim]

    def tokens_input(self) -> str:
        if not self.packed:
            return super().tokens_input()
        ids = self.add_input("input_ids", TensorProto.INT64, [1, "tokens"])  # every row's tokens, one after another
        self.bt_shape = self.op("Shape", ids)
        return ids

    def hidden_input(self) -> str:
        if not self.packed:
            return super().hidden_input()
        hidden = self.add_input("hidden", self.onnx_dtype, [1, "tokens", self.c.hidden_size])
        self.bt_shape = self.op("Shape", hidden, end=2)
        return hidden

    def declare_positions(self, attn_layers: list[int], learned_from_tokens: bool) -> None:
        """``seqlens_k`` ([batch] int32: total length - 1) and ``total_sequence_length`` (int32 scalar), as
        GroupQueryAttention takes them; absolute positions only where the graph needs them itself (learned
        positions, rotary the kernel cannot apply); each rotary table once."""
        c = self.c
        if attn_layers:
            self.seqlens_k = self.add_input("seqlens_k", TensorProto.INT32, ["batch"])
            self.total_len = self.add_input("total_sequence_length", TensorProto.INT32, [])
            self.gqa_rotary = gqa_rotary_ok(c)
            if self.packed:
                self.packed_layout()
            if self.positions:  # token trees (runtime/tree.py) and windowed drafts: each row's positions come in
                self.position_ids = self.add_input("position_ids", TensorProto.INT64, ["batch", "seq"])
                if self.tree:  # and a mask over the call's rows
                    self.attention_bias = self.add_input(
                        "attention_bias", self.onnx_dtype, ["batch", 1, "seq", "total"]
                    )
                if c.positions == "learned" or not self.gqa_rotary:
                    if self.packed:
                        self.pos = self.to_tokens(self.position_ids)
                    else:
                        self.pos = self.op("Reshape", self.position_ids, self.ints(-1))
            elif self.packed and (c.positions == "learned" or not self.gqa_rotary):
                # each row's positions from its own past length P = seqlens_k + 1 - query_seqlens
                one = self.const(np.array(1, np.int32))
                past = self.op("Sub", self.op("Add", self.seqlens_k, one), self.query_seqlens)
                past = self.op("Unsqueeze", self.op("Cast", past, to=TensorProto.INT64), self.ints(-1))
                width = self.op("Gather", self.op("Shape", self.token_index), self.const(1, np.int64), axis=0)
                steps = self.op("Range", self.const(0, np.int64), width, self.const(1, np.int64))
                self.pos = self.to_tokens(self.op("Add", past, steps))
            elif c.positions == "learned" or not self.gqa_rotary:
                seq = self.op("Gather", self.bt_shape, self.const(1, np.int64), axis=0)
                total = self.op("Cast", self.total_len, to=TensorProto.INT64)
                self.pos = self.op("Range", self.op("Sub", total, seq), total, self.const(1, np.int64))
        elif learned_from_tokens:
            self.pos = self.add_input("position_ids", TensorProto.INT64, ["batch", "seq"])
        for table in {c.rotary_of(i) for i in attn_layers} - {None}:
            if self.gqa_rotary:
                self.ropes[table] = self.gqa_rope_cache(table)
            else:
                cos, sin = self.rope(
                    self.pos, table
                )  # [seq, rot] ([1, tokens, rot] packed); broadcast over heads of [batch, seq, heads, head_dim]
                self.ropes[table] = self.op("Unsqueeze", cos, self.ints(-2)), self.op("Unsqueeze", sin, self.ints(-2))

    def packed_layout(self) -> None:
        """A packed graph's inputs that place its token stream in GroupQueryAttention's per-sequence layout:
        ``query_seqlens`` ([batch] int32: each sequence's count of new tokens, 0 for an idle slot), ``token_index``
        ([batch, seq] int64: the stream index of each place of the padded layout, a row's padding repeating its
        last token) and ``token_place`` ([tokens] int64: each token's place in the flattened layout).

        Why: every product, norm and MLP of the graph runs on the real tokens only, so a call costs what its
        tokens cost, not rows x the widest row; GroupQueryAttention, the one op that needs each sequence's rows
        together, gets them gathered before it and scattered back after (``to_rows`` / ``to_tokens``). With
        ``query_seqlens`` the kernel attends only to each row's own tokens and past, writes only those into the
        cache at ``[P, P + Q)`` and spends next to nothing on the padding. It computes a sequence with one new
        token (``Q = 1``) otherwise than one with several: in a call one place wide on MLAS's one-row kernel
        (another summation order), in a wider call on yet another path. So the runtime makes the layout at least
        two places wide, and a row computes the same, to the bit, in every call it can be in, a sequence alone
        included (``tests/test_packed_rows.py``). A one-token step and the same position inside a verify then
        still differ in the last bits (fp32: within the near-tie rule, as without packing). Where the export pads
        attention rows (``pad_rows``, quantized targets, whose int8 activations turn the last bits into whole
        quantization steps), the runtime also counts a one-token row's first pad as a query row (``Q = 2``; the
        pad repeats the row's last token one position later: causal attention keeps it out of the real token's
        result, and its KV lands where the row's next call writes first), as the older graphs' padding row did:
        then a step computes what the same position computes inside a verify, to the bit. It costs the steps'
        attention a second row (a few percent of a call of one-token rows at SmolLM2's shapes). The cache must
        have room for each row's past and the call's padded width (``P + seq <= max_len``): the runtime makes
        sure it has. Nothing of a pad reaches the stream: a pad place of the layout reads its row's last token,
        and no token's output is read from it."""
        self.query_seqlens = self.add_input("query_seqlens", TensorProto.INT32, ["batch"])
        self.token_index = self.add_input("token_index", TensorProto.INT64, ["batch", "seq"])
        self.token_place = self.add_input("token_place", TensorProto.INT64, ["tokens"])

    def to_rows(self, x: str) -> str:
        """[1, tokens, d] -> [batch, seq, d]: the token stream in GroupQueryAttention's padded layout."""
        return self.op("Squeeze", self.op("Gather", x, self.token_index, axis=1), self.ints(0))

    def to_tokens(self, x: str, size: int | None = None) -> str:
        """[batch, seq] or [batch, seq, size] -> [1, tokens] or [1, tokens, size]: each token's place of the
        padded layout, in stream order."""
        flat = self.op("Reshape", x, self.ints(1, -1) if size is None else self.ints(1, -1, size))
        return self.op("Gather", flat, self.token_place, axis=1)

    def residual_start(self, h: str) -> str:
        """The hidden state comes from another graph (an early exit's prefix or suffix), where the full graph
        has h + delta and a fused residual-add norm. A zero branch gives the same: the skip norm's sum is h
        itself and its normed output comes from the same kernel, so the split graphs compute the full
        graph's function to the bit (a plain norm kernel rounds differently, and int8 activations turn that
        into logits about 1e-2 apart: tests/test_real_shapes.py)."""
        return self.op("Mul", h, self.const(np.array(0.0, self.dtype)))

    # -- the variant's ops -------------------------------------------------------------------------
    def matmul(
        self, x: str, weights: str | tuple[str, str, str], in_features: int, out_features: int, bias: str = ""
    ) -> str:
        """``x @ W^T + bias``: FusedMatMul on a float weight, or MatMulNBits on quantized (packed, scales, zero
        points) weights."""
        if isinstance(weights, str):
            y = self.op("FusedMatMul", x, weights, domain=CONTRIB, transB=1)
            return self.op("Add", y, bias) if bias else y
        if self.pad_products:  # at least two rows, whatever the call has (see pad_products in the docstring)
            padded = self.op("Pad", x, self.ints(0, 0, 0, 0, 1, 0), mode="edge")
            y = self.matmul_nbits(padded, weights, in_features, out_features, bias)
            if self._seq_end is None:
                self._seq_end = self.op("Slice", self.bt_shape, self.ints(1), self.ints(2))
            return self.op("Slice", y, self.ints(0), self._seq_end, self.ints(1))
        return self.matmul_nbits(x, weights, in_features, out_features, bias)

    def matmul_nbits(self, x: str, weights: tuple[str, str, str], in_features: int, out_features: int, bias: str):
        """One ``MatMulNBits`` with the quantizer's scheme."""
        args = [x, *weights, "", bias]
        while args[-1] == "":
            args.pop()
        return self.op("MatMulNBits", *args, domain=CONTRIB, **self.quantizer.attributes(in_features, out_features))

    def linear(self, x: str, prefix: str, out_features: int) -> str:
        return self.linear_cat(x, [prefix], out_features)

    def linear_cat(self, x: str, prefixes: list[str], out_features: int) -> str:
        """One matmul for one or several linear layers reading the same input (q/k/v, gate/up),
        ``out_features`` in all. Several layers' canonical weights are concatenated in the graph (a Concat of
        initializers: ONNX Runtime folds it into one constant when the session loads and pre-packs that), so
        the weights file keeps only canonical tensors while each step dispatches one kernel instead of three
        (or two)."""
        biases = [f"{p}.bias" in self.weights for p in prefixes]
        if len(prefixes) > 1 and (not self.pack or len(set(biases)) > 1):
            return self.op(
                "Concat", *[self.linear(x, p, self.weights[f"{p}.weight"].shape[0]) for p in prefixes], axis=-1
            )

        def cat(names: list[str]) -> str:
            return self.w(names[0]) if len(names) == 1 else self.op("Concat", *[self.w(n) for n in names], axis=0)

        in_features = self.weights[f"{prefixes[0]}.weight"].shape[1]
        bias = cat([f"{p}.bias" for p in prefixes]) if biases[0] else ""
        if self.quantizer is None:
            return self.matmul(x, cat([f"{p}.weight" for p in prefixes]), in_features, out_features, bias)
        parts = [self.quantizer.tensors(self.weights, f"{p}.weight") for p in prefixes]
        zero_points = cat([t[2] for t in parts]) if parts[0][2] else ""
        quantized = (cat([t[0] for t in parts]), cat([t[1] for t in parts]), zero_points)
        return self.matmul(x, quantized, in_features, out_features, bias)

    def mlp(self, i: int, x: str) -> str:
        c = self.c
        if c.mlp != "gated" or not self.pack or c.num_experts:
            return super().mlp(i, x)
        both = self.linear_cat(x, [f"layers.{i}.mlp.gate", f"layers.{i}.mlp.up"], 2 * c.intermediate_size)
        gate, up = self.op("Split", both, axis=-1, num_outputs=2, n_out=2)
        return self.linear(self.op("Mul", self.act(gate), up), f"layers.{i}.mlp.down", c.hidden_size)

    def norm(self, x: str, prefix: str) -> str:
        c = self.c
        if c.norm == "layer":
            return super().norm(x, prefix)
        return self.op(
            "SimplifiedLayerNormalization", x, self.w(f"{prefix}.weight"), axis=-1, epsilon=float(c.norm_eps)
        )

    def add_norm(self, h: str, delta: str | None, prefix: str | None) -> tuple[str, str]:
        """(norm(h + delta), h + delta), the residual add fused into the norm that follows it."""
        if delta is None or prefix is None:
            return super().add_norm(h, delta, prefix)
        c = self.c
        if c.norm == "layer":
            outs = self.op(
                "SkipLayerNormalization",
                delta,
                h,
                self.w(f"{prefix}.weight"),
                self.w(f"{prefix}.bias"),
                n_out=4,
                domain=CONTRIB,
                epsilon=float(c.norm_eps),
            )
        else:
            outs = self.op(
                "SkipSimplifiedLayerNormalization",
                delta,
                h,
                self.w(f"{prefix}.weight"),
                n_out=4,
                domain=CONTRIB,
                epsilon=float(c.norm_eps),
            )
        return outs[0], outs[3]

    def add_branches(self, h: str, branches: list[str]) -> tuple[str, str | None]:
        """The branches summed into one pending branch, for the next fused residual-add norm."""
        return h, branches[0] if len(branches) == 1 else self.op("Add", *branches)

    def attention(self, i: int, x: str) -> str:
        """Block ``i``'s attention on its normed input ``x`` [batch, seq, d], up to the o projection."""
        c = self.c
        p = f"layers.{i}.attn"
        hd, nh, nkv = c.head_dim, c.num_heads, c.num_kv_heads
        rope = self.ropes[c.rotary_of(i)]  # the block's table: none for a NoPE block (SmolLM3), local or global
        do_rotary = self.gqa_rotary and rope is not None
        over_proj = c.qk_norm_over == "proj"

        def proj(name: str, n: int) -> str:
            t = self.linear(x, f"{p}.{name}", n * hd)
            norm = f"{p}.{name}_norm" if c.qk_norm and name != "v" else None
            fallback_rope = name != "v" and rope is not None and not self.gqa_rotary
            if norm is not None and over_proj:  # OLMo 2: one norm over all heads of the projection
                t, norm = self.norm(t, norm), None
            if norm is None and not fallback_rope:
                return t
            t = self.op("Reshape", t, self.ints(0, 0, n, hd))
            if norm is not None:
                t = self.norm(t, norm)
            if fallback_rope:
                t = self.rotary(t, rope)
            return self.op("Reshape", t, self.ints(0, 0, n * hd))

        if self.pack and not c.qk_norm and (rope is None or self.gqa_rotary):
            # packed QKV: GroupQueryAttention splits it itself
            q, k, v = self.linear_cat(x, [f"{p}.q", f"{p}.k", f"{p}.v"], (nh + 2 * nkv) * hd), "", ""
        else:
            q, k, v = proj("q", nh), proj("k", nkv), proj("v", nkv)
        past_k = self.add_input(f"past_key_values.{i}.key", self.onnx_dtype, self.past_shape())
        past_v = self.add_input(f"past_key_values.{i}.value", self.onnx_dtype, self.past_shape())
        args = [q, k, v, past_k, past_v, self.seqlens_k, self.total_len]
        if do_rotary:
            args += list(rope)
        if self.tree:
            args += ["", ""] if not do_rotary else []
            args += list(self.tree_args(past_k))
        elif self.positions and do_rotary:  # the kernel's rotary at the given positions, not at past + row
            args.append(self.position_ids)
        out_name = f"gqa_{i}"
        if self.packed:  # the stream in per-sequence rows, each row's count of new tokens (packed_layout)
            args[:3] = [self.to_rows(t) if t else "" for t in args[:3]]
            args += [""] * (16 - len(args)) + [self.query_seqlens]
            out_name = f"gqa_{i}_rows"
        if self.pad_rows:  # one more query row after the real ones (see padding())
            pads, seqlens_k, total_len, _ = self.padding(past_k)
            args[:3] = [self.op("Pad", t, pads, mode="edge") if t else "" for t in args[:3]]
            args[5:7] = [seqlens_k, total_len]
            out_name = f"gqa_{i}_padded"
        present = [f"present.{i}.key", f"present.{i}.value"]
        self._n += 1
        self.nodes.append(
            helper.make_node(
                "GroupQueryAttention",
                args,
                [out_name] + present,
                name=f"n{self._n}",
                domain=CONTRIB,
                num_heads=nh,
                kv_num_heads=nkv,
                scale=float(c.scale),
                do_rotary=int(do_rotary),
                local_window_size=int(c.window_of(i)) if c.window_of(i) is not None else -1,
            )
        )
        if self.pad_rows:
            out_name = self.op("Slice", out_name, self.ints(0), self.padding(past_k)[3], self.ints(1))
        elif self.packed:
            out_name = self.to_tokens(out_name, nh * hd)
        for name in present:
            self.declare_output(name, self.onnx_dtype, self.past_shape())
        return self.linear(out_name, f"{p}.o", c.hidden_size)

    def padding(self, past_k: str) -> tuple[str, str, str, str]:
        """What every GroupQueryAttention of the graph needs to run on one more query row than the call has
        (built once per graph): (``Pad`` pads for q/k/v [batch, seq, hidden], ``seqlens_k`` and
        ``total_sequence_length`` counting that row, the call's ``seq`` as a 1-D end for slicing it off).

        Why: GroupQueryAttention's CPU kernel multiplies attention probabilities by V with MLAS's SGEMM,
        which takes a separate one-row kernel (another summation order) when a call has one query row. So
        a 1-token step and the same position inside a k-token verify round differently (about 1e-6 in
        fp32), and with int8 activations (MatMulNBits ``accuracy_level`` 4) such a difference moves an
        activation across an int8 rounding boundary: a quantized model's logits then differ by whole
        quantization steps between the two paths (measured: docs/history.md, 'Figures behind the code's
        constants'), and speculative output is not the plain output. Every other kernel here
        computes a row the same way whatever the row count (``tests/test_real_shapes.py``). The extra row
        is a copy of the last one, one position later: causal attention keeps it out of every real row's
        result, its KV entry lands in the slot after the call's last position, which the next call
        rewrites before anything reads it, and its output row is sliced off. A call that fills the cache
        to its last slot has no room for it and runs unpadded (only at the context limit: the runtime
        reserves a slot beyond every round). With the past given as a slice (``kv_in_place=False``,
        GroupQueryAttention's growing-cache mode) the padding row always fits. A call of several sequences
        (batch > 1) has no padding row: GroupQueryAttention's CPU kernel takes a batch only for one token per
        sequence, so such a call is a batch of plain steps, each on the one-row path (the runtime's
        ``OnnxBackend.run_rows``)."""
        if self._padding is None:
            total64 = self.op("Cast", self.op("Unsqueeze", self.total_len, self.ints(0)), to=TensorProto.INT64)
            full = self.op(
                "Equal", self.op("Shape", past_k, start=2, end=3), total64
            )  # a static cache with no slot left
            # several sequences in one call (one token each: GroupQueryAttention takes a batch only then): no row
            batched = self.op("Greater", self.op("Shape", past_k, start=0, end=1), self.ints(1))
            extra = self.op("Cast", self.op("Not", self.op("Or", full, batched)), to=TensorProto.INT64)  # [1]: 1 or 0
            pads = self.op("Mul", self.ints(0, 0, 0, 0, 1, 0), extra)  # after the last row of seq
            extra32 = self.op("Cast", extra, to=TensorProto.INT32)
            total = self.op("Add", self.total_len, self.op("Squeeze", extra32, self.ints(0)))
            seq = self.op("Slice", self.bt_shape, self.ints(1), self.ints(2))
            self._padding = pads, self.op("Add", self.seqlens_k, extra32), total, seq
        return self._padding

    def tree_args(self, past_k: str) -> tuple[str, str]:
        """GroupQueryAttention's ``position_ids`` and ``attention_bias`` for a tree-capable graph, padded like
        q/k/v when ``pad_rows`` (the padding row repeats the last position and is masked by nothing: its
        output is sliced off, and no real row sees it)."""
        if self._tree_args is None:
            pos, bias = self.position_ids, self.attention_bias
            if self.pad_rows:
                extra = self.op("Slice", self.padding(past_k)[0], self.ints(4), self.ints(5))  # [1]: 1, or 0 when full
                zero = self.ints(0)
                pos = self.op("Pad", pos, self.op("Concat", zero, zero, zero, extra, axis=0), mode="edge")
                bias_pads = self.op("Concat", zero, zero, zero, zero, zero, zero, extra, extra, axis=0)
                bias = self.op("Pad", bias, bias_pads, self.const(np.array(0.0, self.dtype)))
            self._tree_args = pos, bias
        return self._tree_args

    def head(self, h: str, delta: str | None) -> str:
        """The final norm and lm_head on the rows the call asks for (``logit_rows``: indices along the call's token
        axis), where the graph takes them: a prompt chunk wants its last token's logits only, and on a small model
        with a large vocabulary the head is a fifth of a chunk's products."""
        if self.logit_rows:
            rows = self.add_input("logit_rows", TensorProto.INT64, ["logit_rows"])
            h = self.op("Gather", h, rows, axis=1)
            delta = self.op("Gather", delta, rows, axis=1) if delta is not None else None
        return super().head(h, delta)

    def gqa_rope_cache(self, table: str = "global") -> tuple[str, str]:
        """cos/sin tables [total_len, rotary_dim / 2] for positions 0..total_len-1 (GQA indexes them)."""
        total = self.op("Cast", self.total_len, to=TensorProto.INT64)
        if self.positions and not self.tree:  # a windowed draft's positions run past its cache's length
            total = self.op("Add", self.op("ReduceMax", self.position_ids, keepdims=0), self.const(1, np.int64))
        if self.pad_rows:  # room for the padding row's position (see padding())
            total = self.op("Add", total, self.const(1, np.int64))
        pos = self.op("Range", self.const(0, np.int64), total, self.const(1, np.int64))
        inv_freq = "rope_local_inv_freq" if table == "local" else "rope_inv_freq"
        angles = self.op(
            "Mul", self.op("Unsqueeze", self.op("Cast", pos, to=TensorProto.FLOAT), self.ints(-1)), self.w(inv_freq)
        )
        return self.rope_scaled(angles, table)

    def to_model(self) -> onnx.ModelProto:
        model = super().to_model()
        model.opset_import.append(helper.make_opsetid(CONTRIB, 1))
        return model


__all__ = ["FusedGraph", "elem_name", "gqa_rotary_ok"]
