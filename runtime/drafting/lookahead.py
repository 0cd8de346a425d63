"""Lookahead decoding (Fu et al., 2024) as a draft source: a Jacobi window refined inside the verify call.

No draft model and no text to look things up in: the verifier's own call carries a window of ``W``
guesses for the positions after the round's input token. The verifier's output at every window row is
one Jacobi step (the model's token for the next position, given the guesses before it), so the window
converges over rounds the way Jacobi iteration does, and every round the guesses it verified are
accepted as far as they are right, exactly (``runtime/tree.py``: the window is one branch of the round's
tree, and every row's logits are the full model's for its own root path). What Jacobi alone rarely gets
right in place it often gets right somewhere else: each row adds the n-gram it produced (the guesses
before it, then its output) to a pool keyed by first token, and later rounds whose input token starts a
pooled n-gram verify it as another branch: lookahead decoding's lookahead and verification branches, in
one call. The rows of the other branches are Jacobi steps for their inputs too, and their n-grams are pooled
as well: pooling every row's n-grams, not the window's alone, made lookahead alone faster
(``benchmarks/experiments/trees.py``; measured: docs/history.md, 'Figures behind the code's constants').

Plan fields: ``lookahead_window`` is the window ``W``; ``lookahead_ngram`` the pooled n-gram length ``N``
(2..4); ``lookup_branches`` how many continuations a round verifies per source (a tree, on a backend that
verifies trees: the pooled n-grams and the window). As a chain source, or behind n-gram lookup and
retrieval in a plan's ``lookup`` list, it drafts its most recent pooled n-gram, else the window: what a
round drafts when the text offers nothing to look up.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from ..artifact.manifest import DraftPlan
from ..errors import ArtifactError
from .drafter import Draft, LookupSource, RoundContext, SourceOptions, remember
from .plan import ReadPlan

POOL_PER_KEY = 8  # pooled n-grams kept per first token, most recent first


@dataclass
class LookaheadOptions(SourceOptions):
    """``window``: the Jacobi window's length; ``ngram``: the length of the n-grams it pools."""

    window: int = 4
    ngram: int = 2

    def check(self, plan: DraftPlan) -> None:
        if not (1 <= self.window <= 32 and 2 <= self.ngram <= 4):
            raise ArtifactError(
                f"plan '{plan.name}': sources.lookahead.window must be in 1..32 and "
                f"sources.lookahead.ngram in 2..4, got {self.window} and {self.ngram}"
            )


class LookaheadDrafter(LookupSource):
    Options = LookaheadOptions
    name = "lookahead"
    observes = True  # it learns from the verifier's outputs: rounds stay on the host (``speculative.decode``)

    def __init__(self, window: int = 4, ngram: int = 3, branches: int = 1):
        self.window_size, self.ngram, self.branches = window, max(2, ngram), branches
        self.window: list[int] = []
        self.prompt: list[int] = []
        self._fill = 0
        self.pool: dict[int, list[tuple[int, ...]]] = {}
        self._proposed: tuple[int, list[int]] | None = None  # (input token, window) drafted this round

    @classmethod
    def from_plan(cls, plan: ReadPlan, root: Path | None = None) -> "LookaheadDrafter":
        lookahead = plan.options("lookahead")
        return cls(lookahead.window, lookahead.ngram, plan.lookup_branches)

    @staticmethod
    def describe(lookahead: LookaheadOptions, plan: DraftPlan) -> str:
        return f"lookahead decoding (window {lookahead.window}, pooled {lookahead.ngram}-grams)"

    def start(self, prompt: Sequence[int]) -> None:
        # The first window: the prompt's last tokens (a guess like any other; Jacobi corrects it).
        self.prompt = [int(t) for t in prompt]
        self.window = self.prompt[-self.window_size :]
        self._fill = 0
        self.pool = {}
        self._proposed = None

    # -- what a round drafts ---------------------------------------------------------------------
    def pooled(self, token: int, most: int) -> list[list[int]]:
        """Up to ``most`` pooled continuations of ``token`` (the n-gram less its first token)."""
        return [list(gram[1:]) for gram in self.pool.get(int(token), [])[:most]]

    def continuations(self, history: Sequence[int], limit: int, most: int) -> list[list[int]]:
        """The pooled n-grams that start with the round's input token, then the Jacobi window."""
        found = [g[:limit] for g in self.pooled(history[-1], max(most - 1, 0))]
        window = self.window[:limit]
        if window and window not in found:
            found.append(window)
        self._proposed = (int(history[-1]), window)
        return found

    def lookup(self, history: Sequence[int], tail: Sequence[int], limit: int) -> list[int]:
        found = self.pooled(tail[-1], 1)
        return found[0][:limit] if found else []

    def propose(self, ctx: RoundContext) -> Draft:
        """A chain: the most recent pooled n-gram of the input token, else the window."""
        found = self.continuations(ctx.history, ctx.limit, 2)
        tokens = found[0] if found else []
        return self.draft_of(tokens)

    # -- what a round teaches it -------------------------------------------------------------------
    def observe(
        self, draft: Draft, logits: np.ndarray, committed: Sequence[int], ctx: RoundContext | None = None
    ) -> None:
        """After the verify: the window's rows' outputs become the next window (one Jacobi step) and pooled
        n-grams; ``committed`` are the tokens the round kept (its accepted path, then the verifier's)."""
        token, window = self._proposed if self._proposed is not None else (None, [])  # not asked: nothing verified
        self._proposed = None
        history = ctx.history if ctx is not None else ([] if token is None else [token])
        row_outputs = np.argmax(logits[: len(draft.tokens) + 1], axis=-1).tolist()  # every row's token, once
        for tail, out in zip(self._row_tails(draft, history), row_outputs):
            self._add(tuple(tail) + (out,))
        # outputs[j]: the model's token after window[j] (its verify row), as far as the window was drafted
        outputs = [row_outputs[node + 1] for node in draft.nodes_of(window)]
        # Jacobi: outputs[j] guesses the position after window[j]; the round moved len(committed) positions on,
        # so outputs[step - 1:] guess the positions after the new input token.
        step = len(committed)
        nxt = outputs[step - 1 :] if step - 1 < len(outputs) else self.window[step:]
        last = nxt[-1] if nxt else int(committed[-1])
        while len(nxt) < self.window_size:  # refill: pooled n-grams, else the prompt's tokens (fresh guesses)
            more = self.pooled(last, 1)
            if not more:
                fill = self.window_size - len(nxt)
                nxt = (
                    nxt + [self.prompt[(self._fill + i) % len(self.prompt)] for i in range(fill)]
                    if self.prompt
                    else nxt
                )
                self._fill += fill
                break
            nxt = nxt + more[0]
            last = nxt[-1]
        self.window = nxt[: self.window_size]

    def _row_tails(self, draft: Draft, history: Sequence[int]) -> list[list[int]]:
        """The ``N - 1`` tokens ending in each verify row's input (row 0: the round's input token; row ``r``: the
        draft's node ``r - 1``, on its root path). Every row is a Jacobi step for its own input, the window's
        and the other branches' alike: each output, after those tokens, is an n-gram the model produced."""
        keep = self.ngram - 1
        tails = [list(history[-keep:])]
        for token, parent in zip(draft.tokens, draft.tree_parents):
            tails.append((tails[parent + 1] + [int(token)])[-keep:])
        return tails

    def _add(self, gram: tuple[int, ...]) -> None:
        remember(self.pool.setdefault(gram[0], []), gram, POOL_PER_KEY)

    def feedback(self, draft: Draft, accepted: int) -> None:
        pass


__all__ = ["LookaheadDrafter"]
