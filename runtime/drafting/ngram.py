"""Prompt lookup decoding: draft the continuation of the latest earlier occurrence of the last n tokens.

Model-free and almost free: the prompt and the text generated so far are indexed incrementally (one
dict per n-gram size, n-gram -> where its most recent continuation starts; the prompt when decoding starts,
then each round's new tokens), so a lookup is a few dict probes per round, and a token tree's walk of
earlier occurrences is bounded: the cost of a round does not grow with the input's length (``NgramIndex``).
Longest match first: sizes ``max_n`` down to ``min_n``; a match of at most ``short_n``
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
    """Every n-gram (``min_n <= n <= max_n``) of a growing token list -> where its continuations start.

    - ``latest[n][gram]``: the start of the gram's latest continuation (what ``continuation`` drafts);
    - ``earlier[n][gram]``: for a gram seen more than once, the starts of its earlier occurrences, oldest
      first (a dict used as an ordered set), less each one that a more recent occurrence repeats for ``depth``
      tokens. Dropping it changes no answer of ``continuations`` for ``limit <= depth``: its continuation
      equals the more recent one's, which the walk (most recent first) has already offered or skipped as a
      prefix of an offered one;
    - ``nexts[n][gram]``: for a gram seen more than once, next token -> its latest occurrence's start, least
      recent first: the one-token continuations (a short match's) without walking the occurrences.

    So a lookup costs the same at any length: one dict probe per n-gram size, and a walk of at most
    ``2 * most + depth + 2`` occurrences per size (``walk_limit``), however often the gram recurs (code, tables,
    a long conversation: the old walk visited every occurrence). ``work`` counts the probes, occurrences visited
    and tokens copied by lookups and the tokens indexed: what the tests compare across lengths.

    Memory is linear in the tokens indexed: per token and n-gram size, at most one key tuple with its dict
    slot in ``latest``, one start in ``earlier`` and one in ``nexts``, one hashed ``(n + depth)``-gram in
    ``_completed``, and a new per-gram dict when a gram recurs: at most ``BYTES_PER_TOKEN`` bytes per token and
    size on 64-bit CPython, the token list included (``tests/test_lookup_length.py`` measures it).
    """

    BYTES_PER_TOKEN = 512

    def __init__(self, min_n: int, max_n: int, depth: int = 8):
        if not 1 <= min_n <= max_n or depth < 1:
            raise ValueError(f"n-gram index: need 1 <= min_n <= max_n and depth >= 1, got {min_n}, {max_n}, {depth}")
        self.min_n, self.max_n, self.depth = min_n, max_n, depth
        self.tokens: list[int] = []
        sizes = range(min_n, max_n + 1)
        self.latest: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in sizes}
        self.earlier: dict[int, dict[tuple[int, ...], dict[int, None]]] = {n: {} for n in sizes}
        self.nexts: dict[int, dict[tuple[int, ...], dict[int, int]]] = {n: {} for n in sizes}
        # hash of an occurrence's gram and its next ``depth`` tokens -> the latest such occurrence's start
        self._completed: dict[int, dict[int, int]] = {n: {} for n in sizes}
        self._sizes = [(n, self.latest[n], self.earlier[n], self.nexts[n]) for n in sizes]
        self.work = 0

    def append(self, token: int) -> None:
        i, tokens, depth = len(self.tokens), self.tokens, self.depth
        tokens.append(token)
        self.work += 1
        for n, table, earlier, nexts_of in self._sizes:
            if i >= n:  # the n-gram ending just before token i is continued by token i
                gram = tuple(tokens[i - n : i])
                previous = table.get(gram)
                if previous is not None:
                    earlier.setdefault(gram, {})[previous] = None
                    nexts = nexts_of.get(gram)
                    if nexts is None:
                        nexts = nexts_of[gram] = {tokens[previous]: previous}
                    nexts.pop(token, None)  # re-inserted last: the most recent
                    nexts[token] = i
                    if previous + depth <= i:  # its continuation was complete before this token
                        self._forget_repeat(n, gram, previous)
                table[gram] = i
            start = i + 1 - depth  # token i completes the ``depth``-token continuation starting here
            if start >= n:
                gram = tuple(tokens[start - n : start])
                if table[gram] != start:  # a gram seen once has nothing to forget (see above when it recurs)
                    self._forget_repeat(n, gram, start)

    def _forget_repeat(self, n: int, gram: tuple[int, ...], start: int) -> None:
        """Drop from ``earlier`` the latest older occurrence of ``gram`` whose next ``depth`` tokens equal those
        after ``start`` (each occurrence comes here once, when it is in ``earlier`` and its continuation
        complete; a hash collision is checked, and then drops nothing)."""
        tokens = self.tokens
        window = tokens[start - n : start + self.depth]
        key = hash(tuple(window))
        completed = self._completed[n]
        older = completed.get(key)
        completed[key] = start
        if older is None or tokens[older - n : older + self.depth] != window:
            return
        kept = self.earlier[n].get(gram)
        if kept is not None:
            kept.pop(older, None)
            if not kept:
                del self.earlier[n][gram]

    def sync(self, history: Sequence[int]) -> None:
        """Index the tokens of ``history`` (which only ever grows) not indexed yet."""
        for token in history[len(self.tokens) :]:
            self.append(int(token))

    def continuation(self, tail: Sequence[int], limit: int, short: int = 0) -> list[int]:
        """Up to ``limit`` tokens that followed the longest indexed match of the end of ``tail``; one token
        when that match is at most ``short`` tokens long."""
        found = self.continuations(tail, limit, short, most=1)
        return found[0] if found else []

    def walk_limit(self, most: int) -> int:
        """How many occurrences ``continuations`` visits per n-gram size at the most: the answer's ``most``, as
        many others that repeat an offered one, and the ``depth`` latest, whose continuations the text has not
        completed yet (no repeat of theirs is dropped)."""
        return 2 * most + self.depth + 2

    def continuations(self, tail: Sequence[int], limit: int, short: int = 0, most: int = 4) -> list[list[int]]:
        """Up to ``most`` different continuations of the end of ``tail``: longest match first, most recent
        occurrence first within a match length (the first one is ``continuation``'s). Exact for ``limit`` of 1
        or ``depth`` (a walk of every occurrence would find no other); for a limit in between (the last rounds
        of a request), the walk stops after ``walk_limit(most)`` occurrences per size."""
        if most > 1 and limit > self.depth:
            raise ValueError(f"n-gram index: continuations of {limit} tokens exceed the index's depth ({self.depth})")
        found: list[list[int]] = []
        for n in range(min(self.max_n, len(tail)), self.min_n - 1, -1):
            gram = tuple(tail[-n:])
            latest = self.latest[n].get(gram)
            self.work += 1
            if latest is None:
                continue
            length = 1 if n <= short else limit
            if length == 1:
                nexts = self.nexts[n].get(gram)
                starts = reversed(nexts.values()) if nexts is not None else iter((latest,))
            else:
                starts = itertools.chain([latest], reversed(self.earlier[n].get(gram, ())))
            for start in itertools.islice(starts, self.walk_limit(most)):
                cont = self.tokens[start : start + length]
                self.work += 1 + len(cont)
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
        self.index = NgramIndex(min_n, max_n, max_draft)

    @property
    def ngram_sizes(self) -> tuple[int, int, int, int]:  # type: ignore[override]
        return (self.min_n, self.max_n, self.max_draft, self.short_n)

    @classmethod
    def from_plan(cls, plan: ReadPlan, root: Path | None = None) -> "NgramDrafter":
        ngram = plan.options("ngram")
        return cls(ngram.min, ngram.max, plan.lookup_max_draft, ngram.short)

    @staticmethod
    def describe(ngram: NgramOptions, plan: DraftPlan) -> str:
        short = f", 1 token after a match of <= {ngram.short}" if ngram.drafts_after_short_match else ""
        return f"n-gram lookup (n {ngram.max}..{ngram.min}{short})"

    def start(self, prompt: Sequence[int]) -> None:
        """A new index, holding the prompt already: reading a long prompt is part of reading the prompt (before
        the first token), not of the first round."""
        self.index = NgramIndex(self.min_n, self.max_n, self.max_draft)
        self.index.sync(prompt)

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
        return self.draft_of(tokens)

    def feedback(self, draft: Draft, accepted: int) -> None:
        pass
