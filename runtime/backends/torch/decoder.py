"""The canonical decoder, written once (gpt-fast style), for every supported family.

Families differ only through ``ArchConfig`` switches: RMSNorm or LayerNorm, gated or plain MLP,
rotary (full or partial) or learned positions, sequential or parallel residual, q/k norm, embedding
scale, biases, sliding window. Weights arrive already converted to the canonical names below, so this
file knows nothing about Hugging Face layouts (fused qkv, Conv1D, Gemma's ``1 + w`` norms are all
resolved by the converter).

The forward pass is exposed in pieces the draft-and-verify loop needs: ``run_blocks`` over any range
of blocks with any sublayers skipped, writing the static KV cache at absolute positions, and ``head``
(final norm + lm_head, shared by every exit).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ...artifact.manifest import ArchConfig
from ...errors import ArtifactError, quote
from ...memory import drop_file_pages

_ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


class KVCache:
    """Static per-layer KV cache, preallocated once: ``[layers, batch, kv_heads, max_len, head_dim]``.

    There is no length field to roll back: attention reads positions ``< pos + T`` of the call that is
    running, so rejecting drafted tokens is just starting the next call at an earlier ``pos``; the stale
    entries are overwritten when those positions are written again. Nothing is copied or cloned.
    """

    def __init__(self, config: ArchConfig, max_len: int, batch: int = 1, dtype=torch.float32, device="cpu"):
        shape = (config.num_layers, batch, config.num_kv_heads, max_len, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len

    def view(self, first: int, count: int = 1) -> "KVCache":
        """Slots ``first .. first + count - 1`` as a cache of their own, sharing this one's memory."""
        view = KVCache.__new__(KVCache)
        view.k, view.v, view.max_len = self.k[:, first : first + count], self.v[:, first : first + count], self.max_len
        return view


class Norm(nn.Module):
    def __init__(self, config: ArchConfig, dim: int):
        super().__init__()
        self.kind, self.eps = config.norm, config.norm_eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if config.norm == "layer" else None

    def forward(self, x: Tensor) -> Tensor:
        if self.kind == "layer":
            return F.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps)
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32 and x.device.type == "cpu":
            # one kernel instead of six calls (a step runs 2 per block); bitwise the formula below on CPU
            return F.rms_norm(x, x.shape[-1:], self.weight, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: ArchConfig):
        super().__init__()
        c = config
        self.n_heads, self.n_kv, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.q = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=c.attn_qkv_bias)
        self.k = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.attn_qkv_bias)
        self.v = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.attn_qkv_bias)
        self.o = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=c.attn_out_bias)
        self.over_proj = c.qk_norm_over == "proj"  # OLMo 2: one norm over all heads of the projection
        self.q_norm = Norm(c, c.num_heads * c.head_dim if self.over_proj else c.head_dim) if c.qk_norm else None
        self.k_norm = Norm(c, c.num_kv_heads * c.head_dim if self.over_proj else c.head_dim) if c.qk_norm else None

    def project(self, x: Tensor, rope: tuple[Tensor, Tensor] | None) -> tuple[Tensor, Tensor, Tensor]:
        """q, k, v as ``[B, heads, T, head_dim]``, with q/k norm and rotary applied."""
        b, t, _ = x.shape
        hq, hk, hd = self.n_heads, self.n_kv, self.head_dim
        packed = packed_output(self, "_qkv", x)
        if packed is not None and self.q_norm is None and rope is not None and rope[0].shape[-1] == hd:
            # q and k rotated together, as one [B, T, heads + kv_heads, head_dim] view of the packed output:
            # the same elementwise products, a third of the calls (a CPU draft step is bound by calls)
            qk = apply_rotary(
                packed[..., : (hq + hk) * hd].view(b, t, hq + hk, hd), (rope[0].unsqueeze(-2), rope[1].unsqueeze(-2))
            )
            v = packed[..., (hq + hk) * hd :].view(b, t, hk, hd)
            return qk[:, :, :hq].transpose(1, 2), qk[:, :, hq:].transpose(1, 2), v.transpose(1, 2)
        if packed is not None:
            q, k, v = packed.split(self.__dict__["_qkv"][1], dim=-1)
        else:
            q, k, v = self.q(x), self.k(x), self.v(x)
        if self.q_norm is not None and self.over_proj:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        v = v.reshape(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        if self.q_norm is not None and not self.over_proj:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            if rope[0].dim() == 3:  # per-row positions [B, T, rot] (a batch of sequences): over heads
                rope = (rope[0][:, None], rope[1][:, None])
            q, k = apply_rotary(q, rope), apply_rotary(k, rope)
        return q, k, v


class MLP(nn.Module):
    def __init__(self, config: ArchConfig):
        super().__init__()
        c = config
        self.gate = nn.Linear(c.hidden_size, c.intermediate_size, bias=c.mlp_bias) if c.mlp == "gated" else None
        self.up = nn.Linear(c.hidden_size, c.intermediate_size, bias=c.mlp_bias)
        self.down = nn.Linear(c.intermediate_size, c.hidden_size, bias=c.mlp_bias)
        self.act = _ACTIVATIONS[c.activation]

    def forward(self, x: Tensor) -> Tensor:
        if self.gate is not None:
            gate_up = packed_product(self, "_gate_up", x)
            gate, up = gate_up if gate_up is not None else (self.gate(x), self.up(x))
            return self.down(self.act(gate) * up)
        return self.down(self.act(self.up(x)))


def pack_projections(model: nn.Module) -> list[tuple[nn.Linear, tuple[nn.Linear, ...]]]:
    """Compute q/k/v, and gate/up, of every block as one product each instead of three and two.

    A decode step on CPU is dozens of small products plus the Python and dispatch work around each (seven
    per block and the head); packing removes three of every block's seven. The packed weight is one
    ``[q+k+v, d]`` matrix whose row slices become the q, k and v parameters (views: no second copy), so the
    state dict, checkpoints and the ONNX export still see the canonical names. The packed module has the
    class of the q (or gate) module, so the same product form (``cpu_linear``), and is not registered as
    a submodule (it has hooks, buffers and parameters of its own). Each output is the same dot product
    as before; like any change of kernel it may round differently, and plain and speculative decoding
    run the same modules. The parts' former tensors leave the resident set as each product is made, where
    they were clean pages of a mapped file (``runtime/memory.drop_file_pages``; the weights of a loaded
    artifact or of the model a build read). Returns the packed products made, each with the modules it replaces."""
    packed = []
    for module in model.modules():
        if isinstance(module, Attention):
            parts = (module.q, module.k, module.v)
            name = "_qkv"
        elif isinstance(module, MLP) and module.gate is not None:
            parts = (module.gate, module.up)
            name = "_gate_up"
        else:
            continue
        if name in module.__dict__ or len({(p.weight.dtype, p.weight.device, p.bias is None) for p in parts}) != 1:
            continue
        sizes = [p.out_features for p in parts]
        originals = [p.weight.detach() for p in parts]
        weight = torch.cat(originals)
        bias = torch.cat([p.bias.detach() for p in parts]) if parts[0].bias is not None else None
        for part, w, b in zip(
            parts, weight.split(sizes), bias.split(sizes) if bias is not None else [None] * len(parts)
        ):
            part.weight.data = w
            if b is not None:
                part.bias.data = b
        product = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
        product.__class__ = type(parts[0])  # the parts' product form (cpu_linear.StreamingLinear on CPU)
        product.weight = nn.Parameter(weight, requires_grad=False)
        if bias is not None:
            product.bias = nn.Parameter(bias, requires_grad=False)
        views = tuple(p.weight.data_ptr() for p in parts)
        object.__setattr__(module, name, (product, sizes, parts, views))  # not in state_dict or modules()
        packed.append((product, parts))
        # the parts now view the concatenation: their old tensors, pages of the mapped weights file where the
        # weights were loaded from one, are never read again (a third copy otherwise; its size: docs/backends.md,
        # "The torch backend on CPU")
        drop_file_pages(originals, whole_storage=False)
        del originals
    return packed


def packed_output(module: nn.Module, name: str, x: Tensor) -> Tensor | None:
    """``module``'s packed product ``name`` on ``x`` (its parts' outputs side by side), or None when it has
    none, or when its parts no longer view the packed weight (their weights were replaced or moved since
    packing)."""
    entry = module.__dict__.get(name)
    if entry is None:
        return None
    product, sizes, parts, views = entry
    if any(part.weight.data_ptr() != view for part, view in zip(parts, views)):
        return None
    return product(x)


def packed_product(module: nn.Module, name: str, x: Tensor) -> tuple[Tensor, ...] | None:
    """The parts of ``module``'s packed product ``name`` on ``x`` (``packed_output`` split), or None."""
    out = packed_output(module, name, x)
    return None if out is None else out.split(module.__dict__[name][1], dim=-1)


class MixtureOfExperts(nn.Module):
    """Mixtral's MLP: a router picks ``experts_per_token`` gated experts per token (softmax, top-k,
    renormalised weights) and sums their outputs, expert by expert in index order as transformers does.
    Experts that no token was routed to are skipped, except while a CUDA graph is being captured (a
    graph cannot branch on data; an expert then runs with all-zero weights, which adds exactly zero)."""

    def __init__(self, config: ArchConfig):
        super().__init__()
        self.top_k = config.experts_per_token
        self.router = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = nn.ModuleList(MLP(config) for _ in range(config.num_experts))

    def forward(self, x: Tensor) -> Tensor:
        weights = torch.softmax(self.router(x).float(), dim=-1)
        top_w, top_i = torch.topk(weights, self.top_k, dim=-1)
        top_w = (top_w / top_w.sum(dim=-1, keepdim=True)).to(x.dtype)
        capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            routed = top_i == e  # [..., top_k]
            if not capturing and not bool(routed.any()):
                continue
            out = out + expert(x) * (top_w * routed).sum(dim=-1, keepdim=True)
        return out


class Block(nn.Module):
    """One block's sublayers and norms. The residual schedule (which norm runs where) lives in the three
    methods below, the only place the torch decoder, its CUDA-graph steps and the acceptance estimator
    read it from: pre-norms (most families), post-norms (OLMo 2) or both (a sandwich)."""

    def __init__(self, config: ArchConfig):
        super().__init__()
        d = config.hidden_size
        self.attn_norm = Norm(config, d) if config.pre_norm else None
        self.attn = Attention(config)
        self.mlp_norm = Norm(config, d) if config.pre_norm else None
        self.mlp = MixtureOfExperts(config) if config.num_experts else MLP(config)
        self.attn_post_norm = Norm(config, d) if config.post_norm else None
        self.mlp_post_norm = Norm(config, d) if config.post_norm else None

    def attn_input(self, h: Tensor) -> Tensor:
        return self.attn_norm(h) if self.attn_norm is not None else h

    def attn_output(self, out: Tensor) -> Tensor:
        """Heads ``[B, T, heads * head_dim]`` -> the attention sublayer's residual branch."""
        out = self.attn.o(out)
        return self.attn_post_norm(out) if self.attn_post_norm is not None else out

    def mlp_branch(self, h: Tensor) -> Tensor:
        out = self.mlp(self.mlp_norm(h) if self.mlp_norm is not None else h)
        return self.mlp_post_norm(out) if self.mlp_post_norm is not None else out


def apply_rotary(x: Tensor, rope: tuple[Tensor, Tensor]) -> Tensor:
    """Rotary embedding on the first ``rotary_dim`` dims of ``x``'s last axis. ``rope`` is (cos, signed sin)
    (``Decoder.rope_table``): ``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = cat(-x2, x1)`` is
    computed as ``x * cos + roll(x) * cat(-sin1, sin2)``, bitwise the same (a sign moves between the factors
    exactly), with one roll where there were two slices, a negation and a concatenation."""
    cos, signed_sin = rope  # [T, rotary_dim], or broadcastable to x
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return x * cos + x.roll(rot // 2, -1) * signed_sin
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    return torch.cat((x_rot * cos + x_rot.roll(rot // 2, -1) * signed_sin, x_pass), dim=-1)


class Positions:
    """Where a call's T tokens sit, in the two forms ``Decoder.run_blocks`` takes.

    ``ids`` ``[T]``: their absolute positions (rotary, learned positions). ``slots``: the cache slots their
    K/V are written to (``ids`` except in a token tree, whose rows share positions). ``keys``: how many
    cache positions attention reads (the call's own T without a cache). ``exact``: the keys end at the
    call's last slot (an eager call, ``pos`` an int); False when they are the whole static cache (``pos``
    a tensor: fixed shapes for CUDA graphs). ``span``: an upper bound of the positions, known without
    reading the tensor (rotary tables are computed that far). ``query``: the positions the causal mask
    compares keys with (relative ones without a cache). ``tree_mask``: a token tree's ``[T, keys]``
    mask (``tree``), which replaces the causal one.
    """

    __slots__ = ("ids", "keys", "exact", "span", "query", "slots", "tree_mask", "key_ids", "packed", "window")

    def __init__(
        self,
        ids: Tensor,
        keys: int,
        exact: bool,
        span: int,
        query: Tensor,
        slots: Tensor | None = None,
        tree_mask: Tensor | None = None,
        key_ids: Tensor | None = None,
    ):
        self.ids, self.keys, self.exact, self.span, self.query = ids, keys, exact, span, query
        self.slots = ids if slots is None else slots
        self.tree_mask, self.key_ids = tree_mask, key_ids
        self.packed: PackedRows | None = None
        self.window: tuple[int, int] | None = None  # (sinks, start): attention reads those keys only (``windowed``)

    @classmethod
    def windowed(cls, pos: int, t: int, device, sinks: int, start: int) -> "Positions":
        """An eager call whose attention reads the cache's first ``sinks`` positions and ``start`` up to its own
        last one, nothing between (a model draft far into its context: ``runtime/backends/window_shape.py``)."""
        ids = torch.arange(pos, pos + t, device=device)
        key_ids = torch.cat((torch.arange(sinks, device=device), torch.arange(start, pos + t, device=device)))
        where = cls(ids, pos + t, True, pos + t, ids, key_ids=key_ids)
        where.window = (sinks, start)
        return where

    @classmethod
    def of(cls, pos: "int | Tensor", t: int, device, cache: "KVCache | None") -> "Positions":
        if isinstance(pos, Tensor):
            if cache is None:
                raise ValueError("tensor positions need a static cache (they are for fixed-shape steps)")
            return cls(pos, cache.max_len, False, cache.max_len, pos)
        ids = torch.arange(pos, pos + t, device=device)
        if cache is None:  # a parallel pass over a whole sequence: keys are the call's own tokens
            return cls(ids, t, True, pos + t, ids - pos)
        return cls(ids, pos + t, True, pos + t, ids)

    @classmethod
    def tree(cls, pos: int, depth: Tensor, rows: Tensor) -> "Positions":
        """A token tree's call (``runtime/tree.py``): row r at slot ``pos + r`` and position ``pos + depth[r]``,
        attending to every cached position before ``pos`` and to the rows ``rows[r]`` allows."""
        t = depth.shape[0]
        ids = pos + depth
        past = torch.ones(t, pos, dtype=torch.bool, device=depth.device)
        key_ids = torch.cat([torch.arange(pos, device=depth.device), ids])
        return cls(
            ids,
            pos + t,
            True,
            pos + t,
            ids,
            slots=torch.arange(pos, pos + t, device=depth.device),
            tree_mask=torch.cat([past, rows], dim=1),
            key_ids=key_ids,
        )

    @classmethod
    def rows(cls, starts: Sequence[int], parents: Sequence, width: int, device) -> "Positions":
        """Several sequences in one call (``TorchBackend.run_rows``): row ``b`` at cache positions
        ``starts[b] ..``, its tokens padded to ``width`` (a pad sits one position after the one before it, so
        causal attention keeps it out of every real token, and its KV lands past the row's length, where the
        row's next call writes before anything reads). ``parents[b]``: a token tree's parents for that row
        (``runtime/tree.py``: positions ``start + depth`` and the tree's mask over its rows), or None for a
        chain. Keys: every cache position up to the widest row's last; the mask is ``[B, T, keys]``."""
        from ...tree import attention_rows, depths

        n = len(starts)
        start = torch.tensor(list(starts), dtype=torch.long, device=device)[:, None]
        slots = start + torch.arange(width, device=device)[None, :]  # [n, width]
        keys = max(starts) + width
        key_pos = torch.arange(keys, device=device)
        mask = key_pos[None, None, :] <= slots[:, :, None]  # each row's causal mask over its own positions
        ids, key_ids = slots.clone(), key_pos.expand(n, keys).clone()
        for b, tree in enumerate(parents):
            if tree is None:
                continue
            s0, t = starts[b], len(tree) + 1
            depth = torch.tensor([0] + depths(tree), dtype=torch.long, device=device)
            ids[b, :t] = s0 + depth
            key_ids[b, s0 : s0 + t] = s0 + depth
            mask[b, :t, s0 : s0 + t] = torch.from_numpy(attention_rows(tree)).to(device)
        return cls(ids, keys, True, keys, ids, slots=slots, tree_mask=mask, key_ids=key_ids)

    @classmethod
    def packed_rows(cls, starts: Sequence[int], widths: Sequence[int], device) -> "Positions":
        """Several sequences' chains in one call with their tokens packed (``TorchBackend.run_rows``): the call's
        hidden states are ``[1, N, d]``, N the rows' real tokens end to end, so the products and the MLP cost what
        those tokens cost, not rows x the widest row. Only attention sees the rows padded to the widest
        (``PackedRows``). ``ids``: each packed token's position (rotary, learned positions); the mask is the
        padded rows' ``[B, W, keys]``, a pad repeating its row's last token (its output is dropped)."""
        n, width = len(starts), max(widths)
        first = torch.tensor(list(starts), dtype=torch.long, device=device)
        lengths = torch.tensor(list(widths), dtype=torch.long, device=device)
        column = torch.arange(width, device=device)[None, :].expand(n, width)
        real = column < lengths[:, None]
        offsets = torch.cumsum(lengths, 0) - lengths  # where each row's tokens begin in the packed call
        gather = offsets[:, None] + torch.minimum(column, lengths[:, None] - 1)  # [B, W] -> packed token
        positions = first[:, None] + torch.minimum(column, lengths[:, None] - 1)  # a pad: its row's last position
        ids = positions[real]  # [N], row by row
        rows = torch.arange(n, device=device)[:, None].expand(n, width)[real]
        keys = max(s + w for s, w in zip(starts, widths))
        key_pos = torch.arange(keys, device=device)
        mask = key_pos[None, None, :] <= positions[:, :, None]
        where = cls(ids, keys, True, keys, ids, slots=ids, tree_mask=mask, key_ids=key_pos.expand(n, keys))
        where.packed = PackedRows(rows, gather, real.reshape(-1).nonzero().reshape(-1), positions)
        return where

    @classmethod
    def fixed_rows(cls, starts: Tensor, width: int, max_len: int) -> "Positions":
        """``rows`` with fixed shapes (a batch replayed from a CUDA graph), chains only: the rows' first positions
        ``starts`` ``[B]`` a device tensor, and keys over the whole static cache, so the mask is
        ``[B, T, max_len]``. Same attention as ``rows`` (the extra keys are masked out)."""
        device = starts.device
        slots = starts[:, None] + torch.arange(width, device=device)[None, :]
        key_pos = torch.arange(max_len, device=device)
        mask = key_pos[None, None, :] <= slots[:, :, None]
        key_ids = key_pos.expand(starts.shape[0], max_len)
        return cls(slots, max_len, False, max_len, slots, slots=slots, tree_mask=mask, key_ids=key_ids)

    @classmethod
    def fixed_tree(cls, slots: Tensor, depth: Tensor, rows: Tensor, max_len: int) -> "Positions":
        """``tree`` with fixed shapes (a token tree's verify replayed from a CUDA graph): the call's slots
        ``[T]`` (``pos + r``, a device tensor) instead of an int ``pos``, and keys over the whole static
        cache, so the mask is ``[T, max_len]``: every slot before the tree, the rows ``rows`` allows inside
        it, nothing after it. Same attention as ``tree`` (the extra keys are masked out)."""
        t = depth.shape[0]
        start = slots[:1]
        relative = torch.arange(max_len, device=depth.device) - start  # each key's row in the tree, or outside
        inside = (relative >= 0) & (relative < t)
        row = relative.clamp(0, t - 1)
        mask = (relative < 0)[None, :] | (rows.index_select(1, row) & inside[None, :])
        ids = start + depth
        key_ids = torch.where(inside, start + depth.index_select(0, row), relative + start)
        return cls(ids, max_len, False, max_len, ids, slots=slots, tree_mask=mask, key_ids=key_ids)


class PackedRows:
    """How a packed call's tokens (``Positions.packed_rows``) map to the padded rows attention runs on: ``rows``
    ``[N]`` each token's row (its cache slot in the call's view), ``gather`` ``[B, W]`` the packed token in each
    padded cell, ``unpack`` ``[N]`` each packed token's cell in the flattened ``[B * W]``, ``positions`` ``[B, W]``
    each cell's position (the mask's queries)."""

    __slots__ = ("rows", "gather", "unpack", "positions")

    def __init__(self, rows: Tensor, gather: Tensor, unpack: Tensor, positions: Tensor):
        self.rows, self.gather, self.unpack, self.positions = rows, gather, unpack, positions


class Decoder(nn.Module):
    """Embedding, blocks, final norm and lm_head, with a static KV cache and sublayer skipping."""

    def __init__(self, config: ArchConfig):
        super().__init__()
        c = self.config = config
        self.embed = nn.Embedding(c.vocab_size, c.hidden_size)
        self.pos_embed = (
            nn.Embedding(c.max_position_embeddings + c.position_offset, c.hidden_size)
            if c.positions == "learned"
            else None
        )
        self.layers = nn.ModuleList(Block(c) for _ in range(c.num_layers))
        self.norm = Norm(c, c.hidden_size)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=c.lm_head_bias)
        if c.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        if c.positions == "rotary":
            self.register_buffer("rope_inv_freq", torch.zeros(c.rotary_dim // 2), persistent=True)
        if c.local_rope:
            self.register_buffer("rope_local_inv_freq", torch.zeros(c.rotary_dim // 2), persistent=True)
        self._rope_cache: dict | None = None

    # -- weights ---------------------------------------------------------------------------------
    def load_canonical(self, weights: dict[str, Tensor], assign: bool = False) -> "Decoder":
        """Load canonical-name weights (tied lm_head may be absent) and precompute the rotary table; ``assign``:
        the decoder's parameters become the given tensors (no copy)."""
        expected = set(self.state_dict())
        if self.config.tie_word_embeddings:
            expected.discard("lm_head.weight")
        missing = expected - set(weights)
        unexpected = set(weights) - expected
        if missing or unexpected:
            raise ValueError(
                f"weights do not fit the decoder: missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}"
            )
        self.load_state_dict(weights, strict=False, assign=assign)
        if assign and self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        self._rope_cache = None
        return self

    def rope_table(self, length: int, local: bool = False) -> tuple[Tensor, Tensor]:
        """cos and signed sin (``apply_rotary``: the sine's first half negated) for positions 0..length-1,
        computed once in float32 like transformers does; ``local``: the windowed blocks' own table (Gemma 3's
        local rotary base, unscaled)."""
        cached = self._rope_cache.get(local) if self._rope_cache else None
        if cached is None or cached[0].shape[0] < length:
            inv_freq = (self.rope_local_inv_freq if local else self.rope_inv_freq).float()
            positions = torch.arange(max(length, 64), device=inv_freq.device, dtype=torch.float32)
            freqs = torch.outer(positions, inv_freq)
            emb = torch.cat((freqs, freqs), dim=-1)
            scale = 1.0 if local else self.config.rope_attention_scaling
            dtype = self.embed.weight.dtype
            sin = (emb.sin() * scale).to(dtype)
            half = sin.shape[-1] // 2
            cached = ((emb.cos() * scale).to(dtype), torch.cat((-sin[:, :half], sin[:, half:]), dim=-1))
            self._rope_cache = {**(self._rope_cache or {}), local: cached}
        return cached

    def new_cache(self, max_len: int, dtype=None, device=None) -> KVCache:
        """A static KV cache for ``max_len`` positions (the generic path's decoder offers the same call)."""
        weight = self.embed.weight
        return KVCache(self.config, max_len, dtype=dtype or weight.dtype, device=device or weight.device)

    # -- forward pieces --------------------------------------------------------------------------
    def embed_tokens(self, tokens: Tensor, pos: "int | Tensor") -> Tensor:
        """tokens ``[B, T]`` at positions ``pos`` (the first one, or all of them as a tensor) -> ``[B, T, d]``."""
        h = self.embed(tokens)
        c = self.config
        if c.embed_scale is not None:
            h = h * torch.tensor(c.embed_scale, dtype=h.dtype)  # a CPU scalar: no host copy during graph capture
        if self.pos_embed is not None:
            ids = pos if isinstance(pos, Tensor) else torch.arange(pos, pos + tokens.shape[1], device=tokens.device)
            h = h + self.pos_embed(ids + c.position_offset)
        return h

    def rope_at(self, where: "Positions", local: bool = False) -> tuple[Tensor, Tensor] | None:
        """cos / signed sin ``[T, rotary_dim]`` at the call's positions (None without rotary)."""
        if self.config.positions != "rotary":
            return None
        cos, sin = self.rope_table(where.span, local)
        if where.ids.dim() == 2:  # a batch of rows, each at its own positions: [B, T, rotary_dim]
            return cos[where.ids], sin[where.ids]
        return cos.index_select(0, where.ids), sin.index_select(0, where.ids)

    def attention_mask(self, where: "Positions", window: int | None) -> Tensor | None:
        """Boolean ``[T, keys]`` mask (True = attend): each query sees the keys up to its own position,
        inside ``window`` (a block's ``ArchConfig.window_of``; None: no window). None when a one-token
        eager call sees every key it is given anyway."""
        if where.window is not None:  # keys: the sinks, then the window (``Positions.windowed``)
            if where.ids.shape[0] == 1 and window is None:
                return None
            mask = where.key_ids[None, :] <= where.query[:, None]
            return mask if window is None else mask & (where.key_ids[None, :] > where.query[:, None] - window)
        if where.tree_mask is not None:
            if window is None:
                return where.tree_mask
            queries = where.packed.positions if where.packed is not None else where.ids  # a packed call: its cells'
            return where.tree_mask & (where.key_ids[..., None, :] > queries[..., :, None] - window)
        if (
            where.exact
            and where.ids.dim() == 1
            and where.ids.shape[0] == 1
            and (window is None or where.keys <= window)
        ):
            return None
        q_pos = where.query[..., :, None]
        k_pos = torch.arange(where.keys, device=where.ids.device)[None, :]
        mask = k_pos <= q_pos
        if window is not None:
            mask &= k_pos > q_pos - window
        return mask

    def layer_rope(self, i: int, rope, local_rope=None):
        """Block ``i``'s rotary table (``ArchConfig.rotary_of``)."""
        return {"global": rope, "local": local_rope, None: None}[self.config.rotary_of(i)]

    def attention_sublayer(
        self, i: int, h: Tensor, where: "Positions", cache: KVCache | None, rope, mask, keys_values=None
    ) -> Tensor:
        """Block ``i``'s attention branch; ``rope`` and ``mask`` are the block's own (``layer_rope``,
        ``ArchConfig.window_of``). The call's K/V are written into ``cache`` at its positions (an index
        copy: the same code runs eagerly and inside a CUDA graph) and attention reads the cache's first
        ``where.keys`` positions. ``keys_values(i, k, v, mask) -> (keys, values, mask)`` replaces that
        (the acceptance estimator's mixed attention)."""
        block = self.layers[i]
        q, k, v = block.attn.project(block.attn_input(h), rope)
        t = h.shape[1]
        if keys_values is not None:
            k, v, mask = keys_values(i, k, v, mask)
        elif cache is not None and where.packed is not None:  # packed rows: real tokens' K/V, padded attention
            packed = where.packed
            cache.k[i][packed.rows, :, where.ids] = k[0].transpose(0, 1)
            cache.v[i][packed.rows, :, where.ids] = v[0].transpose(0, 1)
            q = q[0][:, packed.gather].transpose(0, 1)  # [heads, N, hd] -> [B, heads, W, hd]
            k, v = cache.k[i, :, :, : where.keys], cache.v[i, :, :, : where.keys]
            out = F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=mask[:, None],
                scale=self.config.scale,
                enable_gqa=block.attn.n_kv != block.attn.n_heads,
            )
            rows, heads, width, hd = out.shape
            out = out.transpose(1, 2).reshape(rows * width, heads * hd).index_select(0, packed.unpack)
            return block.attn_output(out[None])
        elif cache is not None:
            if where.slots.dim() == 2:  # a batch of rows, each writing its own slots' positions
                index = where.slots[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[3])
                cache.k[i].scatter_(2, index, k)
                cache.v[i].scatter_(2, index, v)
                mask = mask[:, None]  # [B, T, keys] over every head
            else:
                cache.k[i].index_copy_(2, where.slots, k)
                cache.v[i].index_copy_(2, where.slots, v)
            if where.window is not None:  # the sinks and the window only: a copy of those keys, not the whole past
                sinks, start = where.window
                k = torch.cat((cache.k[i, :, :, :sinks], cache.k[i, :, :, start : where.keys]), dim=2)
                v = torch.cat((cache.v[i, :, :, :sinks], cache.v[i, :, :, start : where.keys]), dim=2)
            else:
                k, v = cache.k[i, :, :, : where.keys], cache.v[i, :, :, : where.keys]
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=self.config.scale, enable_gqa=block.attn.n_kv != block.attn.n_heads
        )
        b = h.shape[0]
        return block.attn_output(out.transpose(1, 2).reshape(b, t, -1))

    def mlp_sublayer(self, i: int, h: Tensor) -> Tensor:
        return self.layers[i].mlp_branch(h)

    def run_blocks(
        self,
        h: Tensor,
        pos: "int | Tensor",
        cache: KVCache | None,
        start: int = 0,
        stop: int | None = None,
        skip_attn: frozenset[int] | set[int] = frozenset(),
        skip_mlp: frozenset[int] | set[int] = frozenset(),
        keys_values=None,
        observe=None,
        where: "Positions | None" = None,
    ) -> Tensor:
        """Blocks start..stop-1 on hidden ``[B, T, d]``; a skipped sublayer passes the residual stream
        through unchanged and writes no KV.

        ``pos`` is the first position (eager: attention reads the cache up to the call's last position)
        or every position as a tensor ``[T]`` (gpt-fast's ``input_pos``: attention reads the whole static
        cache under a mask built from the positions, so nothing depends on a Python-side position and the
        same code is captured into CUDA graphs, ``runtime/backends/torch/graphs.py``). ``keys_values``: see
        ``attention_sublayer``. ``observe(kind, i, h_in, branch)`` sees every sublayer that ran ("attn" /
        "mlp"), its input stream and its residual branch (the tuner's cosine similarities). ``where``
        replaces the positions made from ``pos`` (a token tree's, ``Positions.tree``)."""
        c = self.config
        stop = c.num_layers if stop is None else stop
        where = where if where is not None else Positions.of(pos, h.shape[1], h.device, cache)
        ropes = (self.rope_at(where), self.rope_at(where, local=True) if c.local_rope else None)
        masks: dict = {}  # window -> mask, built once per call

        def mask_of(i: int):
            window = c.window_of(i)
            if window not in masks:
                masks[window] = self.attention_mask(where, window)
            return masks[window]

        for i in range(start, stop):
            attn_out = None
            if i not in skip_attn:
                attn_out = self.attention_sublayer(
                    i, h, where, cache, self.layer_rope(i, *ropes), mask_of(i), keys_values
                )
                if observe is not None:
                    observe("attn", i, h, attn_out)
            if c.parallel_residual:  # GPT-NeoX: both branches read the block's input
                mlp_out = None if i in skip_mlp else self.mlp_sublayer(i, h)
                if observe is not None and mlp_out is not None:
                    observe("mlp", i, h, mlp_out)
                if attn_out is not None:
                    h = h + attn_out
                if mlp_out is not None:
                    h = h + mlp_out
            else:
                if attn_out is not None:
                    h = h + attn_out
                if i not in skip_mlp:
                    mlp_out = self.mlp_sublayer(i, h)
                    if observe is not None:
                        observe("mlp", i, h, mlp_out)
                    h = h + mlp_out
        return h

    def head(self, h: Tensor) -> Tensor:
        """Final norm + lm_head (+ its bias, logit scale): the one head shared by the full model and every exit."""
        logits = self.lm_head(self.norm(h))
        if self.config.logit_scale is not None:
            logits = logits * self.config.logit_scale
        if self.config.final_softcap is not None:
            logits = torch.tanh(logits / self.config.final_softcap) * self.config.final_softcap
        return logits

    def forward(self, tokens: Tensor, pos: int = 0, cache: KVCache | None = None) -> Tensor:
        """Full-model logits ``[B, T, vocab]`` for tokens at positions pos..pos+T-1."""
        return self.head(self.run_blocks(self.embed_tokens(tokens, pos), pos, cache))

    def forward_tree(self, tokens: Tensor, pos: "int | Tensor", cache: KVCache, depth: Tensor, rows: Tensor) -> Tensor:
        """Full-model logits ``[B, T, vocab]`` for a token tree's call (``Positions.tree``); ``pos`` the
        call's slots ``[T]`` as a tensor runs with fixed shapes (``Positions.fixed_tree``, CUDA graphs)."""
        if isinstance(pos, Tensor):
            where = Positions.fixed_tree(pos, depth, rows, cache.max_len)
        else:
            where = Positions.tree(pos, depth, rows)
        return self.head(self.run_blocks(self.embed_tokens(tokens, where.ids), pos, cache, where=where))


def build_decoder(
    config: ArchConfig, weights: dict[str, Tensor], dtype=torch.float32, device="cpu", copy: bool = True
) -> Decoder:
    """A ready-to-run decoder from canonical weights, without paying for a random initialisation. ``copy``
    False: the decoder holds the given tensors themselves where they already have its dtype and device (a
    build's conversion and a loaded artifact on CPU: memory-mapped tensors, held once; the products the torch
    backend re-stores drop the mapped pages they replace, ``pack_projections``); by default it copies them."""
    with torch.device("meta"):
        model = Decoder(config)
    model = model.to_empty(device=device)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed.weight
    model.load_canonical(weights, assign=not copy)
    model = model.to(device=device, dtype=dtype)
    if config.positions == "rotary":
        # The rotary frequencies stay float32 whatever the weights' dtype, as in transformers.
        model.rope_inv_freq.data = weights["rope_inv_freq"].to(device=device, dtype=torch.float32, copy=True)
    if config.local_rope:
        model.rope_local_inv_freq.data = weights["rope_local_inv_freq"].to(
            device=device, dtype=torch.float32, copy=True
        )
    return model.eval()


def run_segment(
    decoder,
    segment,
    ids: Tensor | None,
    pos: "int | Tensor",
    cache,
    hidden: Tensor | None,
    head,
    count: int = 0,
    where: "Positions | None" = None,
    last_only: bool = False,
) -> Tensor | None:
    """One ``Segment`` (``runtime/segments.py``) on a decoder (this module's, or the generic path's):
    embed ``ids`` (``[1, T]``) or read the ``count`` hidden states kept at the positions, run the
    segment's blocks, keep their output where asked, and apply ``head`` (a callable on hidden states)
    when the segment has one. ``pos`` an int runs eagerly; a tensor of positions runs with fixed shapes
    (CUDA graphs). ``where``: the call's positions, when not the ones ``pos`` makes (``Positions.windowed``).
    ``last_only``: the head on the last token alone (a prompt chunk: ``Row.last_only``)."""
    fixed = isinstance(pos, Tensor)
    whole = (
        segment.from_tokens
        and segment.stop == decoder.config.num_layers
        and not segment.skip_attn
        and not segment.skip_mlp
        and not segment.keep_hidden
        and segment.head is not None
    )
    if whole and head == decoder.head and where is None and not last_only:  # the full model: one call
        return decoder(ids, pos, cache)
    if segment.from_tokens:
        h = decoder.embed_tokens(ids, pos)
    elif fixed:
        h = hidden.index_select(1, pos)
    else:
        h = hidden[:, pos : pos + count]
    positions = {} if where is None else {"where": where}  # the generic path's decoder takes no ``where``
    h = decoder.run_blocks(h, pos, cache, segment.start, segment.stop, segment.skip_attn, segment.skip_mlp, **positions)
    if segment.keep_hidden:
        if fixed:
            hidden.index_copy_(1, pos, h)
        else:
            hidden[:, pos : pos + h.shape[1]] = h
    if segment.head is None:
        return None
    return head(h[:, -1:] if last_only else h)


def check_decoder_tensors(config: ArchConfig, shapes: dict[str, list[int]], source: str, rebuild: str) -> None:
    """Every tensor the canonical torch decoder of ``config`` loads, by name and shape, against the file:
    the decoder is built on torch's meta device (no memory), so this is exactly what loading checks."""
    with torch.device("meta"):
        expected = {name: list(t.shape) for name, t in Decoder(config).state_dict().items()}
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    missing = sorted(set(expected) - set(shapes))
    unexpected = sorted(set(shapes) - set(expected))
    if missing or unexpected:
        raise ArtifactError(
            f"{source} does not hold the tensors config describes (missing {quote(missing[:3], 120)}, "
            f"unexpected {quote(unexpected[:3], 120)}); {rebuild}"
        )
    for name, shape in expected.items():
        if list(shapes[name]) != shape:
            raise ArtifactError(
                f"{source}: tensor {quote(name)} has shape {quote(list(shapes[name]))} where config "
                f"gives {shape}; {rebuild}"
            )
