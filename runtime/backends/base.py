"""The backend interface: run segments on a static KV cache; nothing about draft plans.

Draft-and-verify needs four things from a backend (docs/design.md sections 2-3): run blocks ``a..b`` with
a set of sublayers skipped at given positions, optionally keeping the hidden states there (``run``,
``runtime/segments.py``); a head, the shared one or a plan's draft head (part of a segment, loaded
by ``load_draft_head``); a static cache sized by ``reserve`` and rolled back by starting the next
call at an earlier position; and ``replica`` (one cache per concurrent sequence over shared weights).
What a plan is, which segments its draft step and verify run, and whether the verify reuses the
draft's prefix, is decided once, by its draft kind (``runtime/drafting/kinds/``).

``draft``, ``verify`` and ``check_plans`` below are conveniences that hand the call to the plan's
kind; a backend does not override them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Sequence

import numpy as np

from ..artifact.manifest import ArchConfig
from ..errors import ArtifactError
from ..segments import Row, Segment, full_model


class Backend(ABC):
    name: str = "backend"
    config: ArchConfig
    max_len: int = 0
    slots: int = 0  # sequences the cache holds (``reserve``); 0 before the first reserve

    @property
    def reuses_prefix(self) -> bool:
        """Whether hidden states kept by one call (``Segment.keep_hidden``) can feed a later call's
        blocks; a backend that cannot (a model whose cache must be rebuilt from block 0) says False."""
        return True

    # -- what every backend implements --------------------------------------------------------------
    @abstractmethod
    def reserve(self, max_len: int, slots: int = 1) -> None:
        """Make sure the static cache holds ``max_len`` positions (reused across requests), for ``slots``
        sequences where the backend is ``batched`` (others keep one)."""

    @abstractmethod
    def replica(self) -> "Backend":
        """Another backend over the same weights with a cache of its own (one per concurrent sequence)."""

    @abstractmethod
    def run(self, segment: Segment, pos: int, tokens: Sequence[int] | None = None, count: int = 0) -> np.ndarray | None:
        """Run ``segment`` at positions ``pos..``: on ``tokens`` when it starts at block 0, else on the
        ``count`` hidden states kept at those positions. The KV of every attention sublayer that runs is
        written at its positions; returns the logits ``[T, vocab]`` (float32) or None without a head."""

    @abstractmethod
    def unsupported(self, segment: Segment) -> str | None:
        """None when ``run(segment)`` can work here, else why not (a short phrase for an error line)."""

    @abstractmethod
    def load_draft_head(self, head_file: str, root: Path | None) -> None:
        """Make the draft head file ``head_file`` (artifact-relative, under ``root``) ready for segments
        whose ``head`` names it."""

    def prepare(self, segment: Segment) -> None:
        """Make ready now whatever ``segment`` builds on its first run (the torch int8 twin: a second or more), so
        that cost falls at load and not inside the first request's decode. Default: nothing."""

    def device_round(self, drafter, seed: int | None):
        """A round that stays on this backend's device for ``drafter`` (called as ``round(ctx, stats)``; with no
        drafter, plain steps), or None: the host round of ``runtime/decoding/batch.py`` runs. Only the torch
        backend on CUDA has one."""
        return None

    # -- batches: several sequences in one call -------------------------------------------------------
    batched: bool = False
    """Whether the cache has a slot per sequence and ``run_rows`` runs rows of several slots in one call (ONNX
    Runtime, the canonical torch decoder). Other backends serve a batch through ``slots.ReplicaSlots``: one
    replica per sequence, rows run one by one (exact, not faster)."""

    slots_copy: bool = False
    """Whether ``move_slot`` copies a slot's cache and the source slot keeps it (one buffer with a slot dimension:
    ONNX Runtime, the canonical torch decoder); replicas trade places instead. A batch keeps a shared prompt
    prefix's KV in a spare slot only where slots copy (``runtime/decoding/batch.py``)."""

    rows_in_one_call: bool = False
    """How a batched call prices its rows (``runtime/decoding/load.py``): True when every row shares one call whose
    products run on all the rows' tokens (torch packs rows of different widths; ONNX Runtime's packed graphs);
    False when one-token rows share a call and wider rows run alone (ONNX Runtime's older graphs)."""

    def run_rows(self, segment: Segment, rows: Sequence[Row]) -> list[np.ndarray | None]:
        """``run`` on several sequences at once: each ``Row`` its own slot, position and tokens (or kept hidden
        states, or a token tree); one logits array ``[row.width, vocab]`` (or None) per row, in order. A backend
        that is not ``batched`` has slot 0 only and runs one row."""
        if len(rows) != 1 or rows[0].slot != 0:
            raise NotImplementedError(f"the {self.name} backend runs one sequence at a time (ReplicaSlots batches it)")
        row = rows[0]
        if row.parents is not None:
            return [self.forward_tree(row.tokens, row.parents, row.pos)]
        return [self.run(segment, row.pos, tokens=row.tokens, count=row.count)]

    def move_slot(self, source: int, target: int, length: int) -> None:
        """Copy slot ``source``'s cache below ``length`` into slot ``target`` (batched backends)."""
        raise NotImplementedError(f"the {self.name} backend has one slot")

    # -- token trees (``runtime/tree.py``): backends that can verify them override these three ----------
    def tree_unsupported(self) -> str | None:
        """None when ``forward_tree`` works here, else why not (a short phrase)."""
        return "this backend has no tree attention"

    def tree_fits(self, pos: int, t: int) -> bool:
        """Whether a tree call of ``t`` rows at ``pos`` computes exactly here (a kernel may only see trees within
        some positions); when not, the round verifies the tree's first branch as a chain."""
        return True

    def forward_tree(self, tokens: Sequence[int], parents: Sequence[int], pos: int) -> np.ndarray:
        """Full-model logits ``[T, vocab]`` for a round's input token (``tokens[0]``, at ``pos``) and a token
        tree below it (``tokens[1:]``, ``parents`` as in ``runtime/tree.py``): row ``r`` sits at cache slot
        ``pos + r`` and position ``pos + depth`` and attends to the past and its ancestors only."""
        raise NotImplementedError(self.tree_unsupported())

    def keep_rows(self, pos: int, moves: Sequence[tuple[int, int]], slot: int = 0) -> None:
        """After ``forward_tree``: move the KV of call row ``a`` (cache position ``pos + a``) to row ``b`` for each
        ``(a, b)`` of ``moves`` (``tree.kv_moves``: the accepted path; the rest is overwritten later), in every
        layer, in the sequence's ``slot``."""
        raise NotImplementedError(self.tree_unsupported())

    # -- conveniences on top ------------------------------------------------------------------------
    def forward(self, tokens: Sequence[int], pos: int) -> np.ndarray:
        """Full-model logits ``[T, vocab]`` for ``tokens`` at ``pos..`` (prefill, plain steps, verify)."""
        return self.run(full_model(self.config.num_layers), pos, tokens=tokens)

    def draft(self, plan, token: int, pos: int) -> np.ndarray:
        """One draft step of ``plan`` (a plan read for this backend's layer count, ``drafting.read_plan``: its
        kind decides the segments): logits ``[vocab]``."""
        return plan.kind.draft(self, token, pos)

    def verify(self, plan, tokens: Sequence[int], pos: int, n_reuse: int = 0) -> np.ndarray:
        """Full-model logits for a round's ``tokens``; ``n_reuse`` of them already ran ``plan``'s prefix (a read
        plan, or None: a plain verify)."""
        if plan is None:
            return self.forward(tokens, pos)
        return plan.kind.verify(self, tokens, pos, n_reuse)

    def _plan_segments(self, plans: dict):
        """(name, plan, segment, why this backend cannot run it or None) for every segment of ``plans``."""
        for name, plan in plans.items():
            for segment in plan.kind.segments():
                yield name, plan, segment, self.unsupported(segment)

    def prepare_plans(self, plans: dict) -> None:
        """``prepare`` every segment of ``plans`` that this backend can run (the rest are refused when used)."""
        for _, _, segment, reason in self._plan_segments(plans):
            if reason is None:
                self.prepare(segment)

    def check_plans(self, plans: dict) -> None:
        """Refuse, before any work, a plan whose segments this backend cannot run (one line each). ``plans``: read
        plans by name (``drafting.check_plans``)."""
        for name, plan, _, reason in self._plan_segments(plans):
            if reason is not None:
                raise ArtifactError(
                    f"plan {name!r} ({plan.describe()}) cannot run on the {self.name} backend: {reason}"
                )


__all__ = ["Backend", "Segment"]
