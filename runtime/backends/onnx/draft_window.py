"""A model draft that attends to a window of the cache at long context, on ONNX Runtime: the first ``sinks``
positions and the most recent ones (``runtime/backends/window_shape.py`` says why and how many).

GroupQueryAttention's ``local_window_size`` does not make this cheaper: its CPU kernel computes the whole product
and masks it in the softmax (measured: docs/long_inputs.md), and its past must be one contiguous buffer per head.
So the draft's attention runs on a buffer of its own, ``[slots, kv_heads, capacity, head_dim]`` per layer, that
holds the sinks at ``[0, sinks)`` and the window ``[start, p)`` of real positions after them, bound as the draft
graph's past and present (in place, as the main cache is); the graph takes each row's real positions
(``position_ids``: GroupQueryAttention's rotary at those positions), so the cached keys, rotated at their own
positions when they were written, meet a query rotated at its own.

The buffer mirrors the main cache: a draft call first copies the positions the main cache gained since the last
sync (a few per round: what the verifier accepted), runs on the window, then copies the positions it wrote back
into the main cache, so the main cache holds exactly what a draft on the whole past would have left there
(the verifier rewrites those positions, as always). Any other call that writes the main cache (a verify, a plain
step, a prompt chunk, a moved or reordered row) marks the mirror stale from its first position. The window
starts ``window`` positions before the draft and stays put until it spans ``2 * window``; then the most recent
``window`` positions move to its front (one copy per ``window`` tokens), so the graph's bindings never change.

The output stays the full model's: the verifier decides every token; the window changes only which tokens
are proposed, and so the acceptance.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ...segments import Row
from ..window_shape import WindowShape


@dataclass
class _SlotWindow:
    start: int  # the real position at buffer index ``sinks``
    synced: int  # real positions [start, synced) of the buffer equal the main cache's


class DraftWindow:
    """The window buffers of one backend and each slot's place in them (see the module docstring)."""

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, dtype, shape: WindowShape | None = None):
        self.shape = shape or WindowShape()
        self.num_layers, self.kv_heads, self.head_dim, self.dtype = num_layers, kv_heads, head_dim, dtype
        self.k: list[np.ndarray] = []
        self.v: list[np.ndarray] = []
        self.slots: dict[int, _SlotWindow] = {}

    def applies(self, rows: Sequence[Row]) -> bool:
        """Whether these draft rows (one call) run on the window: each far enough into its context, none wider
        than the margin, no token tree."""
        s = self.shape
        return all(row.pos >= s.min_context and row.width < s.margin and row.parents is None for row in rows)

    def stale_from(self, slot: int, pos: int) -> None:
        """The main cache of ``slot`` changed from ``pos`` on: the mirror holds nothing after it; at 0, the slot
        begins a new sequence (its sinks are copied again)."""
        state = self.slots.get(slot)
        if state is None:
            return
        if pos < self.shape.sinks:
            del self.slots[slot]
        else:
            state.synced = min(state.synced, pos)

    def forget(self, slot: int | None = None) -> None:
        if slot is None:
            self.slots.clear()
        else:
            self.slots.pop(slot, None)

    @property
    def nbytes(self) -> int:
        return sum(buf.nbytes for buf in self.k + self.v)

    def _ensure(self, slots: int) -> bool:
        """Buffers for ``slots`` slots; True when they were (re)allocated (bindings over them are then stale)."""
        if self.k and self.k[0].shape[0] >= slots:
            return False
        shape = (slots, self.kv_heads, self.shape.capacity, self.head_dim)
        old_k, old_v = self.k, self.v
        self.k = [np.zeros(shape, self.dtype) for _ in range(self.num_layers)]
        self.v = [np.zeros(shape, self.dtype) for _ in range(self.num_layers)]
        for new, old in zip(self.k + self.v, old_k + old_v):
            new[: old.shape[0]] = old
        return True

    def prepare(
        self, main_k: list[np.ndarray], main_v: list[np.ndarray], rows: Sequence[Row]
    ) -> tuple[list[Row], bool]:
        """Bring each row's window up to date with the main cache and give the rows as the draft graph sees them
        (their positions in the window buffer), and whether the buffers were reallocated."""
        s = self.shape
        grown = self._ensure(max(row.slot for row in rows) + 1)
        views = []
        for row in rows:
            state = self.slots.get(row.slot)
            if state is None or row.pos < state.start:  # a new sequence in the slot: its sinks, an empty window
                state = self.slots[row.slot] = _SlotWindow(start=row.pos - s.window, synced=row.pos - s.window)
                for buf, main in zip(self.k + self.v, main_k + main_v):
                    buf[row.slot, :, : s.sinks] = main[row.slot, :, : s.sinks]
            elif row.pos - state.start > 2 * s.window:  # slide: the most recent ``window`` positions to the front
                start = row.pos - s.window
                kept = max(state.synced - start, 0)
                if kept:
                    src = s.sinks + start - state.start
                    for buf in self.k + self.v:
                        buf[row.slot, :, s.sinks : s.sinks + kept] = buf[row.slot, :, src : src + kept].copy()
                state.start, state.synced = start, max(state.synced, start)
            low = max(state.synced, state.start)  # (a rewrite before the window leaves it stale from its start)
            if low < row.pos:  # what the main cache gained: the verifier's accepted positions
                a, b = s.sinks + low - state.start, s.sinks + row.pos - state.start
                for buf, main in zip(self.k + self.v, main_k + main_v):
                    buf[row.slot, :, a:b] = main[row.slot, :, low : row.pos]
                state.synced = row.pos
            views.append(Row(row.slot, s.sinks + row.pos - state.start, row.tokens, row.count))
        return views, grown

    def write_back(self, main_k: list[np.ndarray], main_v: list[np.ndarray], rows: Sequence[Row]) -> None:
        """Copy what the draft wrote into the window (its rows' positions) into the main cache, where a draft on
        the whole past would have written it."""
        s = self.shape
        for row in rows:
            state = self.slots[row.slot]
            a = s.sinks + row.pos - state.start
            for buf, main in zip(self.k + self.v, main_k + main_v):
                main[row.slot, :, row.pos : row.pos + row.width] = buf[row.slot, :, a : a + row.width]
            state.synced = max(state.synced, row.pos + row.width)


__all__ = ["DraftWindow", "WindowShape"]
