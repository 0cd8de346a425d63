"""One sequence's view of a batched backend, and a batch made of replicas for backends without slots.

The decode loop (``runtime/decoding/batch.py``) runs a batch of sequences on one backend: every sequence owns
a cache *slot*, and one round's rows go to ``Backend.run_rows`` together. Two adapters make every backend
fit that shape:

- ``SlotView``: the single-sequence ``Backend`` interface (``run``, ``forward``, ``draft``, ``verify``, trees)
  on one slot of a batched backend. A sequence's drafter (model drafts, ``drafting/model_draft.py``) and its draft
  kind call it exactly as they would call a backend of their own, so nothing in drafting knows about batches.
- ``ReplicaSlots``: a batch on a backend whose cache has no slot dimension (TensorRT, the generic torch
  path): one ``replica()`` per slot, rows run one by one (exact; the weights are read once per row, so a
  batch is no faster there than its sequences one after another).
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from ..segments import Row, Segment, full_model
from .base import Backend


class SlotView(Backend):
    """Slot ``slot`` of ``backend`` as a backend of its own (``slot`` may change: a batch moves sequences
    into its first slots when one leaves)."""

    def __init__(self, backend: Backend, slot: int):
        self.backend, self.slot = backend, slot
        self.name, self.config = backend.name, backend.config

    @property
    def max_len(self) -> int:  # type: ignore[override]
        return self.backend.max_len

    @property
    def reuses_prefix(self) -> bool:
        return self.backend.reuses_prefix

    def reserve(self, max_len: int, slots: int = 1) -> None:
        if max_len > self.backend.max_len:
            raise ValueError(f"slot {self.slot} holds {self.backend.max_len} positions, {max_len} asked")

    def replica(self) -> Backend:
        return self.backend.replica()

    def run(self, segment: Segment, pos: int, tokens: Sequence[int] | None = None, count: int = 0) -> np.ndarray | None:
        return self.backend.run_rows(segment, [Row(self.slot, pos, tokens, count)])[0]

    def unsupported(self, segment: Segment) -> str | None:
        return self.backend.unsupported(segment)

    def load_draft_head(self, head_file: str, root: Path | None) -> None:
        self.backend.load_draft_head(head_file, root)

    def prepare(self, segment: Segment) -> None:
        self.backend.prepare(segment)

    def device_round(self, drafter, seed: int | None):
        """The device's own round, for a sequence alone in slot 0 (the torch backend on CUDA)."""
        return self.backend.device_round(drafter, seed) if self.slot == 0 else None

    def tree_unsupported(self) -> str | None:
        return self.backend.tree_unsupported()

    def tree_fits(self, pos: int, t: int) -> bool:
        return self.backend.tree_fits(pos, t)

    def forward_tree(self, tokens: Sequence[int], parents: Sequence[int], pos: int) -> np.ndarray:
        full = full_model(self.config.num_layers)
        return self.backend.run_rows(full, [Row(self.slot, pos, list(tokens), parents=list(parents))])[0]

    def keep_rows(self, pos: int, moves: Sequence[tuple[int, int]], slot: int = 0) -> None:
        self.backend.keep_rows(pos, moves, slot=self.slot)


class ReplicaSlots(Backend):
    """A batch on a backend without slots: slot ``s`` is replica ``s`` (slot 0 the backend itself)."""

    batched = True

    def __init__(self, backend: Backend):
        self.backend, self.replicas = backend, [backend]
        self.name, self.config = backend.name, backend.config
        self.max_len, self.slots = 0, 1

    @property
    def reuses_prefix(self) -> bool:
        return self.backend.reuses_prefix

    def reserve(self, max_len: int, slots: int = 1) -> None:
        while len(self.replicas) < slots:
            self.replicas.append(self.backend.replica())
        for replica in self.replicas:
            replica.reserve(max_len)
        self.max_len, self.slots = max_len, len(self.replicas)

    def replica(self) -> Backend:
        return self.backend.replica()

    def run(self, segment: Segment, pos: int, tokens: Sequence[int] | None = None, count: int = 0) -> np.ndarray | None:
        return self.replicas[0].run(segment, pos, tokens, count)

    def run_rows(self, segment: Segment, rows: Sequence[Row]) -> list[np.ndarray | None]:
        out = []
        for row in rows:
            replica = self.replicas[row.slot]
            if row.parents is not None:
                out.append(replica.forward_tree(row.tokens, row.parents, row.pos))
            else:
                out.append(replica.run(segment, row.pos, tokens=row.tokens, count=row.count))
        return out

    def move_slot(self, source: int, target: int, length: int) -> None:
        """No copy: the replicas trade places."""
        self.replicas[target], self.replicas[source] = self.replicas[source], self.replicas[target]

    def unsupported(self, segment: Segment) -> str | None:
        return self.backend.unsupported(segment)

    def load_draft_head(self, head_file: str, root: Path | None) -> None:
        for replica in self.replicas:
            replica.load_draft_head(head_file, root)

    def prepare(self, segment: Segment) -> None:
        self.backend.prepare(segment)

    def device_round(self, drafter, seed: int | None):
        return self.backend.device_round(drafter, seed)

    def tree_unsupported(self) -> str | None:
        return self.backend.tree_unsupported()

    def tree_fits(self, pos: int, t: int) -> bool:
        return self.backend.tree_fits(pos, t)

    def keep_rows(self, pos: int, moves: Sequence[tuple[int, int]], slot: int = 0) -> None:
        self.replicas[slot].keep_rows(pos, moves)


def batch_of(backend: Backend) -> Backend:
    """``backend`` itself when it batches rows, else a ``ReplicaSlots`` over it."""
    return backend if backend.batched else ReplicaSlots(backend)


__all__ = ["ReplicaSlots", "SlotView", "batch_of"]
