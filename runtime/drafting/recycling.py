"""Token Recycling (Luo et al., 2024): the verifier's runner-up tokens, kept and drafted again.

Every verify row computes the full model's distribution of the token after the row's input token; decoding
keeps one token of it and throws the rest away. Token Recycling keeps each row's ``RECYCLED`` best tokens in a
table keyed by the row's input token (the latest row seen for a token replaces the older one) and drafts from
it: the round's input token's best successors, each followed greedily through the table (its successor's best
successor, ...). The table is a first-order model of what *this* model says after a token, learned for free
from the rows every round verifies anyway, rejected branches included; it is seeded with the prompt's own
successions, so the first rounds have something to draft.

As a tree source (a plan with ``lookup_branches > 1``) it offers the input token's ``lookup_branches`` best
successors, each continued greedily; as a chain source, the greedy path; as the extension of another source's
draft, the greedy path from the draft's last token; each at most the plan's ``lookup_max_draft`` tokens. What
it drafts comes from earlier verifier outputs only, never from this round's random draws, so the rejection rule
keeps the full model's distribution when sampling.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import numpy as np

from ..artifact.manifest import DraftPlan
from .drafter import Draft, LookupSource, RoundContext, remember

if TYPE_CHECKING:
    from .plan import ReadPlan

RECYCLED = 8  # successors kept per token, best first (the paper's adjacency matrix keeps 8)


class RecyclingDrafter(LookupSource):
    """No options of its own (``SourceOptions``): it drafts at most the plan's ``lookup_max_draft`` tokens."""

    name = "recycling"
    observes = True  # it reads every verify row: rounds stay on the host (``speculative.decode``)

    def __init__(self, max_draft: int = 8):
        self.max_draft = max_draft
        self.table: dict[int, list[int]] = {}

    @classmethod
    def from_plan(cls, plan: "ReadPlan", root: Path | None = None) -> "RecyclingDrafter":
        return cls(plan.lookup_max_draft)

    @staticmethod
    def describe(options, plan: DraftPlan) -> str:
        return "token recycling (the verifier's earlier top tokens after each token)"

    def start(self, prompt: Sequence[int]) -> None:
        """A new table, seeded with the prompt's successions (the latest first)."""
        self.table = {}
        for token, after in zip(prompt, prompt[1:]):
            remember(self.table.setdefault(int(token), []), int(after), RECYCLED)

    # -- what a round drafts ---------------------------------------------------------------------
    def _greedy(self, token: int, limit: int) -> list[int]:
        path: list[int] = []
        while len(path) < limit:
            successors = self.table.get(token)
            if not successors:
                break
            token = successors[0]
            path.append(token)
        return path

    def continuations(self, history: Sequence[int], limit: int, most: int) -> list[list[int]]:
        """The input token's ``most`` best successors, each followed by the table's greedy path (at most the
        plan's ``lookup_max_draft`` tokens each)."""
        limit = min(limit, self.max_draft)
        if limit < 1:
            return []
        return [[first] + self._greedy(first, limit - 1) for first in self.table.get(int(history[-1]), [])[:most]]

    def lookup(self, history: Sequence[int], tail: Sequence[int], limit: int) -> list[int]:
        return self._greedy(int(tail[-1]), min(limit, self.max_draft))

    def propose(self, ctx: RoundContext) -> Draft:
        found = self.continuations(ctx.history, ctx.limit, 1)
        tokens = found[0] if found else []
        return Draft(tokens=tokens, q=[None] * len(tokens), sources=[self.name] * len(tokens))

    # -- what a round teaches it -------------------------------------------------------------------
    def observe(
        self, draft: Draft, logits: np.ndarray, committed: Sequence[int], ctx: RoundContext | None = None
    ) -> None:
        """Every verify row's best tokens become its input token's successors: row 0's input is the round's
        input token, row ``r``'s the draft's node ``r - 1`` (chain or tree alike)."""
        if ctx is None:
            return
        inputs = [int(ctx.history[-1])] + [int(t) for t in draft.tokens]
        rows = np.asarray(logits)[: len(inputs)]
        k = min(RECYCLED, rows.shape[-1])
        top = np.argpartition(rows, -k, axis=-1)[:, -k:]
        order = np.argsort(-np.take_along_axis(rows, top, axis=-1), axis=-1, kind="stable")
        for token, best in zip(inputs, np.take_along_axis(top, order, axis=-1).tolist()):
            self.table[token] = best  # the latest row for a token replaces what an older one said

    def feedback(self, draft: Draft, accepted: int) -> None:
        pass


__all__ = ["RECYCLED", "RecyclingDrafter"]
