"""CUDA graphs for the torch backend (gpt-fast style): fixed-shape segments over the static KV cache.

A CUDA graph replays kernels with the pointers and shapes they had at capture, so nothing a captured
step does may depend on a Python-side position. The decoder therefore takes the *positions as a device
tensor* (``Decoder.run_blocks``): KV entries are written with ``index_copy_`` at those positions,
attention reads the whole preallocated cache under a ``[T, max_len]`` mask built from the positions,
rotary tables are gathered by position. It is the same decoder and the same ``run_segment`` the eager
backend runs, with a tensor where eager calls pass an int: no second copy of the block's math. Token
ids and positions live in static input buffers (one pair per token count T) that each call overwrites
before replaying.

One graph per (segment, T), captured on first use: the full model on T tokens (the decode step and
the verify of a layer-skip or lookup round; prompts longer than ``max_tokens`` run eagerly), a token
tree's verify of T rows (its depths and row mask are static inputs too), a
layer-skip or early-exit draft step, an early exit's prefix on the round's fresh tokens and its suffix
on the kept hidden states. Segments that end in a draft head run eagerly. Batched rows of several
sequences (chains of up to ``max_tokens`` tokens, from token ids, in the first slots) replay one graph per
(segment, batch bucket, width), the batch padded to the bucket (``run_rows``). A sequence alone's device
round and plain blocks capture their own graphs over these buffers (``device_round.py``, ``device_plain.py``).

``capture(fn)`` turns a step into a replayable callable. On CUDA it is ``cuda_capture`` (warm-up on a
side stream, then ``torch.cuda.graph`` into one memory pool per backend). It is injected so that the
whole static-buffer / position bookkeeping runs and is tested on CPU with ``eager_capture``, which
calls the step each time, exactly as a replay would, reading the same static buffers.

Imported only by the torch backend.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import Tensor

from ...segments import Segment, full_model
from .decoder import KVCache, Positions, run_segment

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
    """Fixed-shape segments over one static cache, each captured once and replayed after. ``cache`` is slot 0's
    view (a sequence alone); ``slot_cache`` every slot's (batched rows, ``run_rows``)."""

    def __init__(
        self,
        decoder,
        cache: KVCache,
        hidden: Tensor,
        capture: Callable[[Step], Step],
        max_tokens: int = 32,
        slot_cache: KVCache | None = None,
    ):
        self.decoder, self.cache, self.hidden, self.slot_cache = decoder, cache, hidden, slot_cache or cache
        self.capture, self.max_tokens = capture, max_tokens
        self.max_len = cache.max_len
        if decoder.config.positions == "rotary":  # computed before any capture, gathered by position after
            decoder.rope_table(self.max_len)
            if decoder.config.local_rope:
                decoder.rope_table(self.max_len, local=True)
        self.buffers: dict[int, tuple[Tensor, Tensor]] = {}  # T -> (token ids [1, T], positions [T])
        self.offsets = torch.arange(max_tokens, dtype=torch.long, device=cache.k.device)  # positions = pos + these
        self.graphs: dict[tuple, Step] = {}  # (segment, T) or ("tree", T) -> replay
        self.tree_buffers: dict[int, tuple[Tensor, Tensor]] = {}  # T -> (depths [T], row mask [T, T])
        self.row_buffers: dict[tuple[int, int], tuple[Tensor, Tensor]] = {}  # (rows, T) -> (ids, first positions)
        self.captures = 0

    def _inputs(self, tokens: "Sequence[int] | Tensor | None", t: int, pos: int) -> tuple[Tensor, Tensor]:
        """Write ``tokens`` (when the segment embeds tokens: host ints, or ids ``[T]`` already on the device,
        copied there without a host round trip) and their positions (computed on the device from ``pos``)
        into the buffers for T."""
        self.check_room(pos, t)
        if t not in self.buffers:
            device = self.cache.k.device
            self.buffers[t] = (
                torch.zeros(1, t, dtype=torch.long, device=device),
                torch.zeros(t, dtype=torch.long, device=device),
            )
        ids, positions = self.buffers[t]
        if isinstance(tokens, Tensor):
            ids.copy_(tokens.reshape(1, t))
        elif tokens is not None:
            ids.copy_(torch.tensor([list(tokens)], dtype=torch.long))
        if t > self.offsets.shape[0]:  # a step longer than graphs take (called directly, not via the backend)
            self.offsets = torch.arange(t, dtype=torch.long, device=positions.device)
        torch.add(self.offsets[:t], pos, out=positions)
        return ids, positions

    def check_room(self, pos: int, t: int) -> None:
        """A ``ValueError`` unless positions ``pos .. pos + t - 1`` lie in the static cache (a replay writes there)."""
        if pos < 0 or pos + t > self.max_len:
            raise ValueError(
                f"positions {pos}..{pos + t - 1} are outside the static cache (0..{self.max_len - 1}); "
                "reserve() a longer cache first"
            )

    def fits(self, t: int) -> bool:
        """Whether a step of ``t`` tokens is graphed (longer ones, prompts, run eagerly)."""
        return t <= self.max_tokens

    def run(
        self, segment: Segment, pos: int, tokens: "Sequence[int] | Tensor | None" = None, count: int = 0
    ) -> Tensor | None:
        t = len(tokens) if tokens is not None else count
        ids, positions = self._inputs(tokens, t, pos)
        key = (segment, t)
        step = self.graphs.get(key)
        if step is None:
            d, cache, hidden = self.decoder, self.cache, self.hidden
            step = self.graphs[key] = self.capture(
                lambda: run_segment(d, segment, ids, positions, cache, hidden, d.head)
            )
            self.captures += 1
        return step()

    def forward(self, tokens: Sequence[int], pos: int) -> Tensor:
        return self.run(full_model(self.decoder.config.num_layers), pos, tokens)

    def run_rows(self, segment: Segment, rows: Sequence, bucket: int, width: int, pad_start: int) -> Tensor | None:
        """Chain rows of several sequences in slots ``0 .. len(rows) - 1`` (``TorchBackend.run_rows``) as one replayed
        call of ``bucket`` rows of ``width`` tokens: the logits ``[bucket, width, vocab]`` (rows past the batch are
        padding: they write their KV at ``pad_start`` onwards in their own slots, past every sequence's end, and
        their logits mean nothing). One graph per (segment, bucket, width), as vLLM captures its decode steps per
        batch size, so the few bucket sizes serve every batch."""
        buffers = self.row_buffers.get((bucket, width))
        if buffers is None:
            device = self.cache.k.device
            buffers = self.row_buffers[bucket, width] = (
                torch.zeros(bucket, width, dtype=torch.long, device=device),
                torch.zeros(bucket, dtype=torch.long, device=device),
            )
        ids, starts = buffers
        host_ids = torch.zeros(bucket, width, dtype=torch.long)
        host_starts = torch.full((bucket,), pad_start, dtype=torch.long)
        for b, row in enumerate(rows):
            host_ids[b, : row.width] = torch.tensor(list(row.tokens), dtype=torch.long)
            host_ids[b, row.width :] = int(row.tokens[-1])  # pads after the row's tokens, as the eager call's
            host_starts[b] = row.pos
        ids.copy_(host_ids)
        starts.copy_(host_starts)
        key = ("rows", segment, bucket, width)
        step = self.graphs.get(key)
        if step is None:
            d, cache = self.decoder, self.slot_cache.view(0, bucket)

            def rows_step() -> Tensor | None:
                where = Positions.fixed_rows(starts, width, self.max_len)
                h = d.embed_tokens(ids, where.ids)
                h = d.run_blocks(
                    h, None, cache, segment.start, segment.stop, segment.skip_attn, segment.skip_mlp, where=where
                )
                return None if segment.head is None else d.head(h)

            step = self.graphs[key] = self.capture(rows_step)
            self.captures += 1
        return step()

    def forward_tree(self, tokens: Sequence[int], depth: Tensor, rows: Tensor, pos: int) -> Tensor:
        """A token tree's verify (``Decoder.forward_tree``) over fixed shapes: one graph per tree size T,
        the tree's depths ``[T]`` and row mask ``[T, T]`` copied into static buffers before each replay.
        Without this the verify of every tree round ran eagerly, and on a GPU a tree round cost several
        graphed plain steps."""
        t = len(tokens)
        ids, slots = self._inputs(tokens, t, pos)
        if t not in self.tree_buffers:
            self.tree_buffers[t] = (torch.zeros_like(depth), torch.zeros_like(rows))
        depth_buffer, rows_buffer = self.tree_buffers[t]
        depth_buffer.copy_(depth)
        rows_buffer.copy_(rows)
        step = self.graphs.get(("tree", t))
        if step is None:
            d, cache = self.decoder, self.cache
            step = self.graphs[("tree", t)] = self.capture(
                lambda: d.forward_tree(ids, slots, cache, depth_buffer, rows_buffer)
            )
            self.captures += 1
        return step()


__all__ = ["StaticSteps", "cuda_capture_with", "eager_capture"]
