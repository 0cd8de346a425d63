"""LogitSpec (Findings of ACL 2026): the last verified logits guess the *next-next* token and seed lookups.

A round ends with the verifier's own token ``t``, the argmax (or a sample) of its last row. That row's
other top tokens are often the token *after* ``t`` (the model looks slightly ahead): each of the ``k``
best, ``c``, becomes a branch of the next round's tree, extended by an n-gram lookup of ``... t c`` over
the prompt and output, so one call verifies several guesses that no lookup alone would have made. As a
chain source (behind n-gram lookup in a plan's ``lookup`` list) it drafts its best branch when the text
offers nothing else.

Plan fields: ``logitspec_top_k`` guesses; the extension uses the plan's n-gram sizes and draft length.
How often the token after ``t`` is among the last row's top k (other than ``t``): docs/history.md, 'Figures
behind the code's constants' (``benchmarks/experiments/trees.py`` times the plans).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from ..artifact.manifest import DraftPlan
from ..errors import ArtifactError
from .drafter import Draft, LookupSource, RoundContext, SourceOptions
from .ngram import NgramDrafter
from .plan import ReadPlan


@dataclass
class LogitSpecOptions(SourceOptions):
    """``top_k``: how many of the last verified row's top tokens are kept as next-next guesses."""

    top_k: int = 4

    def check(self, plan: DraftPlan) -> None:
        if not 1 <= self.top_k <= 64:
            raise ArtifactError(f"plan '{plan.name}': sources.logitspec.top_k must be in 1..64, got {self.top_k}")


class LogitSpecDrafter(LookupSource):
    Options = LogitSpecOptions
    name = "logitspec"
    observes = True  # it reads the verifier's last row: rounds stay on the host (``speculative.decode``)

    def __init__(self, top_k: int, extend: NgramDrafter):
        self.top_k, self.extend = top_k, extend
        self.guesses: list[int] = []
        self._for: tuple[int, int] | None = None  # (history length, input token) the guesses are for

    @classmethod
    def from_plan(cls, plan: ReadPlan, root: Path | None = None) -> "LogitSpecDrafter":
        return cls(plan.options("logitspec").top_k, NgramDrafter.from_plan(plan))

    @staticmethod
    def describe(logitspec: LogitSpecOptions, plan: DraftPlan) -> str:
        return f"LogitSpec (top {logitspec.top_k} next-next guesses, extended by lookup)"

    def start(self, prompt: Sequence[int]) -> None:
        self.extend.start(prompt)
        self.guesses, self._for = [], None

    def continuations(self, history: Sequence[int], limit: int, most: int) -> list[list[int]]:
        """Each guess for the token after the input token, extended by a lookup of the text ending in it."""
        if self._for != (len(history), int(history[-1])) or limit < 1:
            return []
        out = []
        for guess in self.guesses[:most]:
            tail = list(history[-8:]) + [guess]
            out.append([guess] + self.extend.lookup(history, tail, limit - 1))
        return out

    def lookup(self, history: Sequence[int], tail: Sequence[int], limit: int) -> list[int]:
        return []

    def propose(self, ctx: RoundContext) -> Draft:
        found = self.continuations(ctx.history, ctx.limit, 1)
        tokens = found[0] if found else []
        return Draft(tokens=tokens, q=[None] * len(tokens), sources=[self.name] * len(tokens))

    def observe(self, draft: Draft, logits: np.ndarray, committed: Sequence[int], ctx: RoundContext) -> None:
        """The round kept ``committed``; its last token came from the verify row after the accepted path."""
        path = draft.nodes_of(committed[:-1])
        row = logits[path[-1] + 1 if path else 0]
        final = int(committed[-1])
        top = np.argpartition(row, -(self.top_k + 1))[-(self.top_k + 1) :]
        top = top[np.argsort(-row[top], kind="stable")]
        self.guesses = [int(t) for t in top if int(t) != final][: self.top_k]
        self._for = (len(ctx.history) + len(committed), final)

    def feedback(self, draft: Draft, accepted: int) -> None:
        pass


__all__ = ["LogitSpecDrafter"]
