"""CUDA graphs for the torch backend (gpt-fast style): fixed-shape steps over the static KV cache.

A CUDA graph replays kernels with the pointers and shapes they had at capture, so nothing a captured
step does may depend on a Python-side position. ``StaticSteps`` therefore runs the decoder with the
*positions as a device tensor*: KV entries are written with ``index_copy_`` at those positions,
attention reads the whole preallocated cache under a ``[T, max_len]`` mask built from the positions,
rotary tables are gathered by position. Token ids and positions live in static input buffers (one pair
per token count T) that each call overwrites before replaying.

One graph per step kind and token count, captured on first use:

- ``("forward", T)``: the full model on T tokens (the 1-token decode step and the k-token verify of a
  layer-skip or lookup round); prompts longer than ``max_tokens`` run eagerly;
- ``("skip", attn, mlp)``: one layer-skip draft token;
- ``("exit", E)``: one early-exit draft token (blocks 0..E-1, hidden state kept at its position, head);
- ``("exit-verify", E, T, reuse)``: an early-exit verify: blocks 0..E-1 on the ``T - reuse`` fresh
  tokens, then blocks E..L-1 on the kept hidden states of the ``reuse`` drafted ones plus those.

``capture(fn)`` turns a step into a replayable callable. On CUDA it is ``cuda_capture`` (warm-up on a
side stream, then ``torch.cuda.graph`` into one memory pool per backend). It is injected so that the
whole static-buffer / position bookkeeping runs and is tested on CPU with ``eager_capture``, which
calls the step each time, exactly as a replay would, reading the same static buffers.

Imported only by ``runtime/torch_backend.py``.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from .decoder import Decoder, KVCache
from .manifest import DraftPlan

Step = Callable[[], Tensor]


def eager_capture(fn: Step) -> Step:
    """No graph: every "replay" runs ``fn`` again over the static buffers (CPU, and tests)."""
    return fn


def cuda_capture_with(pool) -> Callable[[Step], Step]:
    """Capture ``fn`` into a CUDA graph sharing ``pool`` with the backend's other graphs.

    Warm-up runs on a side stream first (as the PyTorch CUDA-graph docs require, so lazy kernel and
    workspace initialisation happen outside the capture). Warm-up runs the very call being served,
    with its inputs already in the static buffers, so the KV entries it writes are the ones the replay
    writes again. Graphs of one backend never run concurrently and their inputs and outputs stay
    referenced, so sharing one pool is safe.
    """

    def capture(fn: Step) -> Step:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = fn()

        def replay() -> Tensor:
            graph.replay()
            return out

        replay.graph = graph  # keep it alive with the callable
        return replay

    return capture


class StaticSteps:
    """Fixed-shape decoder steps over one static cache, each captured once and replayed after."""

    def __init__(self, decoder: Decoder, cache: KVCache, exit_hidden: Tensor, capture: Callable[[Step], Step],
                 max_tokens: int = 32):
        self.decoder, self.cache, self.exit_hidden = decoder, cache, exit_hidden
        self.capture, self.max_tokens = capture, max_tokens
        self.max_len = cache.max_len
        device = cache.k.device
        self.key_positions = torch.arange(self.max_len, device=device)
        rotary = decoder.config.positions == "rotary"
        self.rope = decoder.rope_table(self.max_len) if rotary else None
        self.rope_local = decoder.rope_table(self.max_len, local=True) if rotary and decoder.config.local_rope else None
        self.buffers: dict[int, tuple[Tensor, Tensor]] = {}  # T -> (token ids [1, T], positions [T])
        self.graphs: dict[tuple, Step] = {}
        self.captures = 0

    # -- static inputs -----------------------------------------------------------------------------
    def _inputs(self, tokens: Sequence[int], pos: int) -> tuple[Tensor, Tensor]:
        """Write ``tokens`` and their positions into the static buffers for ``len(tokens)``."""
        t = len(tokens)
        if pos < 0 or pos + t > self.max_len:
            raise ValueError(f"positions {pos}..{pos + t - 1} are outside the static cache (0..{self.max_len - 1}); "
                             "reserve() a longer cache first")
        if t not in self.buffers:
            device = self.cache.k.device
            self.buffers[t] = (torch.zeros(1, t, dtype=torch.long, device=device),
                               torch.zeros(t, dtype=torch.long, device=device))
        ids, positions = self.buffers[t]
        ids.copy_(torch.tensor([list(tokens)], dtype=torch.long))
        positions.copy_(torch.arange(pos, pos + t, dtype=torch.long))
        return ids, positions

    def _run(self, key: tuple, tokens: Sequence[int], pos: int, make: Callable[[Tensor, Tensor], Step]) -> Tensor:
        ids, positions = self._inputs(tokens, pos)
        step = self.graphs.get(key)
        if step is None:
            step = self.graphs[key] = self.capture(make(ids, positions))
            self.captures += 1
        return step()

    # -- decoder pieces with tensor positions ------------------------------------------------------
    def _embed(self, ids: Tensor, positions: Tensor) -> Tensor:
        d, c = self.decoder, self.decoder.config
        h = d.embed(ids)
        if c.embed_scale is not None:
            h = h * torch.tensor(c.embed_scale, dtype=h.dtype)  # a CPU scalar: no host copy during capture
        if d.pos_embed is not None:
            h = h + d.pos_embed(positions + c.position_offset)
        return h

    def _rope(self, positions: Tensor, table=None):
        table = table or self.rope
        if table is None:
            return None
        cos, sin = table
        return cos.index_select(0, positions), sin.index_select(0, positions)

    def _mask(self, positions: Tensor, window: int | None) -> Tensor:
        """``[T, max_len]``: key positions up to each query's own (and inside the sliding window)."""
        q = positions[:, None]
        k = self.key_positions[None, :]
        mask = k <= q
        if window is not None:
            mask = mask & (k > q - window)
        return mask

    def _attention(self, i: int, h: Tensor, positions: Tensor, rope, mask: Tensor) -> Tensor:
        block = self.decoder.layers[i]
        q, k, v = block.attn.project(block.attn_input(h), rope)
        keys, values = self.cache.k[i], self.cache.v[i]  # views: [B, kv_heads, max_len, head_dim]
        keys.index_copy_(2, positions, k)
        values.index_copy_(2, positions, v)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.decoder.config.scale,
                                             enable_gqa=block.attn.n_kv != block.attn.n_heads)
        b, t = h.shape[0], h.shape[1]
        return block.attn_output(out.transpose(1, 2).reshape(b, t, -1))

    def _blocks(self, h: Tensor, positions: Tensor, start: int, stop: int, skip_attn=frozenset(),
                skip_mlp=frozenset()) -> Tensor:
        """``Decoder.run_blocks`` with tensor positions (same residual rules, same sublayer skipping)."""
        d = self.decoder
        ropes = (self._rope(positions), self._rope(positions, self.rope_local) if self.rope_local else None)
        masks = {w: self._mask(positions, w) for w in {d.config.window_of(i) for i in range(start, stop)}}
        for i in range(start, stop):
            attn_out = None if i in skip_attn else self._attention(i, h, positions, d.layer_rope(i, *ropes),
                                                                    masks[d.config.window_of(i)])
            if d.config.parallel_residual:
                mlp_out = None if i in skip_mlp else d.mlp_sublayer(i, h)
                if attn_out is not None:
                    h = h + attn_out
                if mlp_out is not None:
                    h = h + mlp_out
            else:
                if attn_out is not None:
                    h = h + attn_out
                if i not in skip_mlp:
                    h = h + d.mlp_sublayer(i, h)
        return h

    # -- the backend's calls -----------------------------------------------------------------------
    def fits(self, t: int) -> bool:
        """Whether a step of ``t`` tokens is graphed (longer ones, prompts, run eagerly)."""
        return t <= self.max_tokens

    def forward(self, tokens: Sequence[int], pos: int) -> Tensor:
        L = self.decoder.config.num_layers

        def make(ids, positions):
            return lambda: self.decoder.head(self._blocks(self._embed(ids, positions), positions, 0, L))

        return self._run(("forward", len(tokens)), tokens, pos, make)

    def draft(self, plan: DraftPlan, token: int, pos: int) -> Tensor:
        d, L = self.decoder, self.decoder.config.num_layers
        if plan.is_early_exit:
            e = plan.exit_layer

            def make(ids, positions):
                def step():
                    h = self._blocks(self._embed(ids, positions), positions, 0, e)
                    self.exit_hidden.index_copy_(1, positions, h)
                    return d.head(h)
                return step

            return self._run(("exit", e), [token], pos, make)
        skip_attn, skip_mlp = frozenset(plan.skip_attn), frozenset(plan.skip_mlp)

        def make(ids, positions):
            return lambda: d.head(self._blocks(self._embed(ids, positions), positions, 0, L, skip_attn, skip_mlp))

        return self._run(("skip", skip_attn, skip_mlp), [token], pos, make)

    def verify_exit(self, plan: DraftPlan, tokens: Sequence[int], pos: int, n_reuse: int) -> Tensor:
        d, L, e = self.decoder, self.decoder.config.num_layers, plan.exit_layer

        def make(ids, positions):
            def step():
                fresh = positions[n_reuse:]
                h_new = self._blocks(self._embed(ids[:, n_reuse:], fresh), fresh, 0, e)
                h = torch.cat((self.exit_hidden.index_select(1, positions[:n_reuse]), h_new), dim=1)
                return d.head(self._blocks(h, positions, e, L))
            return step

        return self._run(("exit-verify", e, len(tokens), n_reuse), tokens, pos, make)


__all__ = ["StaticSteps", "cuda_capture_with", "eager_capture"]
