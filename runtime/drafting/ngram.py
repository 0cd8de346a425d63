"""Prompt lookup decoding: draft the continuation of the latest earlier occurrence of the last n tokens.

Model-free and almost free: the prompt and the text generated so far are indexed incrementally (one
dict per n-gram size, n-gram -> where its most recent continuation starts), so a lookup is a few dict
probes per round. Longest match first: sizes ``max_n`` down to ``min_n``; a match of at most ``short_n``
tokens drafts a single token. Its q is one-hot, so speculative sampling stays exact (rejection accepts a
looked-up token with probability p(token)).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from ..artifact.manifest import DraftPlan
from ..errors import ArtifactError
from .drafter import Draft, LookupSource, RoundContext, SourceOptions
from .plan import ReadPlan


class NgramIndex:
    """Every n-gram (``min_n <= n <= max_n``) of a growing token list -> start of its latest continuation."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self.latest: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_n, max_n + 1)}
        self.earlier: dict[int, dict[tuple[int, ...], list[int]]] = {n: {} for n in range(min_n, max_n + 1)}

    def append(self, token: int) -> None:
        i = len(self.tokens)
        self.tokens.append(token)
        for n, table in self.latest.items():
            if i >= n:  # the n-gram ending just before token i is continued by token i
                gram = tuple(self.tokens[i - n : i])
                previous = table.get(gram)
                if previous is not None:  # every earlier occurrence, for trees (``continuations``)
                    self.earlier[n].setdefault(gram, []).append(previous)
                table[gram] = i

    def sync(self, history: Sequence[int]) -> None:
        """Index the tokens of ``history`` (which only ever grows) not indexed yet."""
        for token in history[len(self.tokens) :]:
            self.append(int(token))

    def continuation(self, tail: Sequence[int], limit: int, short: int = 0) -> list[int]:
        """Up to ``limit`` tokens that followed the longest indexed match of the end of ``tail``; one token
        when that match is at most ``short`` tokens long."""
        found = self.continuations(tail, limit, short, most=1)
        return found[0] if found else []

    def continuations(self, tail: Sequence[int], limit: int, short: int = 0, most: int = 4) -> list[list[int]]:
        """Up to ``most`` different continuations of the end of ``tail``: longest match first, most recent
        occurrence first within a match length (the first one is ``continuation``'s)."""
        found: list[list[int]] = []
        for n in range(min(self.max_n, len(tail)), self.min_n - 1, -1):
            gram = tuple(tail[-n:])
            latest = self.latest[n].get(gram)
            if latest is None:
                continue
            for start in itertools.chain([latest], reversed(self.earlier[n].get(gram, ()))):
                cont = self.tokens[start : start + (1 if n <= short else limit)]
                if cont and not any(f[: len(cont)] == cont for f in found):  # not a prefix of one already found
                    found.append(cont)
                    if len(found) >= most:
                        return found
        return found


@dataclass
class NgramOptions(SourceOptions):
    """n-gram sizes ``max`` down to ``min`` are tried, longest first; a match of at most ``short`` tokens drafts
    one token (0: none). Retrieval and LogitSpec match suffixes from ``min`` tokens too."""

    min: int = 2
    max: int = 4
    short: int = 0

    @property
    def drafts_after_short_match(self) -> bool:
        """Whether ``short`` changes anything: matches are at least ``min`` tokens long."""
        return self.short >= self.min

    def check(self, plan: DraftPlan) -> None:
        if not 1 <= self.min <= self.max:
            raise ArtifactError(
                f"plan '{plan.name}': n-gram sizes must satisfy 1 <= sources.ngram.min <= "
                f"sources.ngram.max, got {self.min}..{self.max}"
            )
        if not 0 <= self.short <= self.max:
            raise ArtifactError(
                f"plan '{plan.name}': sources.ngram.short must be in 0..max ({self.max}), got {self.short}"
            )


class NgramDrafter(LookupSource):
    name = "ngram"
    Options = NgramOptions

    def __init__(self, min_n: int = 2, max_n: int = 4, max_draft: int = 8, short_n: int = 0):
        """A match of at most ``short_n`` tokens drafts one token: a short match often predicts the next
        token (worth a verify that costs about one step) but rarely the ones after it (a longer verify)."""
        self.min_n, self.max_n, self.max_draft, self.short_n = min_n, max_n, max_draft, short_n
        self.index = NgramIndex(min_n, max_n)

    @classmethod
    def from_plan(cls, plan: ReadPlan, root: Path | None = None) -> "NgramDrafter":
        ngram = plan.options("ngram")
        return cls(ngram.min, ngram.max, plan.lookup_max_draft, ngram.short)

    @staticmethod
    def describe(ngram: NgramOptions, plan: DraftPlan) -> str:
        short = f", 1 token after a match of <= {ngram.short}" if ngram.drafts_after_short_match else ""
        return f"n-gram lookup (n {ngram.max}..{ngram.min}{short})"

    def start(self, prompt: Sequence[int]) -> None:
        self.index = NgramIndex(self.min_n, self.max_n)

    def lookup(self, history: Sequence[int], tail: Sequence[int], limit: int) -> list[int]:
        """Continuation of ``tail`` (the committed ``history`` plus uncommitted drafts) from ``history``."""
        self.index.sync(history)
        return self.index.continuation(tail, min(limit, self.max_draft), self.short_n)

    def continuations(self, history: Sequence[int], limit: int, most: int) -> list[list[int]]:
        """Up to ``most`` different continuations of ``history`` (the first is ``lookup``'s)."""
        self.index.sync(history)
        return self.index.continuations(history, min(limit, self.max_draft), self.short_n, most)

    def propose(self, ctx: RoundContext) -> Draft:
        tokens = self.lookup(ctx.history, ctx.history, ctx.limit)
        return Draft(tokens=list(tokens), q=[None] * len(tokens), sources=[self.name] * len(tokens))

    def feedback(self, draft: Draft, accepted: int) -> None:
        pass
