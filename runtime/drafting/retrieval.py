"""Retrieval drafting (REST-style): look the continuation up in a datastore of calibration text.

The datastore is built at build time from token sequences (the calibration text and the target's own
greedy continuations of it) and stored in the artifact as safetensors: the tokens of all sequences
(separated by -1) and every position sorted by the ``depth`` tokens that start there. A lookup
binary-searches the positions whose first n tokens equal the end of the context (longest n first),
then follows the majority path: at each step the most frequent next token among the matches, keeping
only the matches that agree. numpy only; the q of a retrieved token is one-hot.

A lookup depends only on the last ``depth`` tokens of the context and its limits, so its answers are kept
(``ANSWERS_KEPT``, least recently used out). Why: the build replays about a hundred lookup plans over the same
calibration text (``passes/lookup_autotune.py``) and most of its retrieval lookups are repeats; the search
itself narrows one column of the sorted keys at a time (two ``searchsorted`` each) instead of slicing the
tokens at every probe of a Python binary search (retrieval was a large share of the pass under a profiler:
docs/history.md, 'Figures behind the code's constants').
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Sequence

import numpy as np

from ..artifact.manifest import DraftPlan
from ..errors import ArtifactError
from .drafter import Draft, LookupSource, RoundContext, SourceOptions
from .plan import ReadPlan

SEPARATOR = -1
MAX_MATCHES = 256  # matches considered when choosing the majority continuation
ANSWERS_KEPT = 65536  # lookups whose answers a datastore keeps (a few MB)


class Datastore:
    def __init__(self, tokens: np.ndarray, order: np.ndarray, depth: int):
        self.depth = depth
        self.tokens = np.concatenate([tokens.astype(np.int64), np.full(depth + 64, SEPARATOR, np.int64)])
        self.order = order.astype(np.int64)
        # the first ``depth`` tokens at every sorted position, one column per token: sorted lexicographically
        self.keys = self.tokens[self.order[:, None] + np.arange(depth)].astype(np.int32)
        self.answers: OrderedDict[tuple, list] = OrderedDict()

    @classmethod
    def build(cls, sequences: Sequence[Sequence[int]], depth: int = 4) -> "Datastore":
        parts = []
        for seq in sequences:
            parts += [list(map(int, seq)), [SEPARATOR]]
        tokens = np.array([t for part in parts for t in part] or [SEPARATOR], dtype=np.int64)
        padded = np.concatenate([tokens, np.full(depth, SEPARATOR, np.int64)])
        starts = np.flatnonzero(tokens != SEPARATOR)
        keys = [padded[starts + j] for j in reversed(range(depth))]  # lexsort: last key is the primary one
        order = starts[np.lexsort(keys)] if len(starts) else starts
        return cls(tokens, order, depth)

    def save(self, path: Path) -> None:
        from safetensors.numpy import save_file

        body = self.tokens[: len(self.tokens) - self.depth - 64]
        save_file(
            {"tokens": body.astype(np.int32), "order": self.order.astype(np.int32)},
            str(path),
            metadata={"format": "speccompile-datastore", "depth": str(self.depth)},
        )

    @classmethod
    def load(cls, path: Path) -> "Datastore":
        from safetensors import safe_open

        try:
            with safe_open(str(path), framework="numpy") as handle:
                depth = int(handle.metadata()["depth"])
                return cls(handle.get_tensor("tokens"), handle.get_tensor("order"), depth)
        except Exception as exc:  # safetensors raises its own error types for a bad file
            raise ArtifactError(
                f"retrieval datastore {str(path)!r} cannot be read ({type(exc).__name__}); rebuild the artifact"
            ) from None

    def __len__(self) -> int:
        return len(self.order)

    def _range(self, query: tuple[int, ...]) -> tuple[int, int]:
        """The sorted positions whose first ``len(query)`` tokens are ``query``: within the rows that share the
        first j tokens, column j is sorted, so each token narrows the range with two searches."""
        lo, hi = 0, len(self.order)
        for j, token in enumerate(query):
            column = self.keys[lo:hi, j]
            lo, hi = lo + int(np.searchsorted(column, token, "left")), lo + int(np.searchsorted(column, token, "right"))
            if lo >= hi:
                break
        return lo, hi

    def _remember(self, key: tuple, compute) -> list:
        """``compute()``, or the answer kept for ``key`` (a copy either way: callers may extend it)."""
        found = self.answers.get(key)
        if found is None:
            found = compute()
            self.answers[key] = found
            if len(self.answers) > ANSWERS_KEPT:
                self.answers.popitem(last=False)
        else:
            self.answers.move_to_end(key)
        return [list(x) for x in found] if found and isinstance(found[0], list) else list(found)

    def _match(self, tail: Sequence[int], min_n: int) -> tuple[tuple[int, ...], np.ndarray] | None:
        """The longest end of ``tail`` (at least ``min_n`` tokens) found in the store, and where each of its
        first ``MAX_MATCHES`` occurrences is followed; None when none is."""
        for n in range(min(self.depth, len(tail)), min_n - 1, -1):
            query = tuple(int(t) for t in tail[-n:])
            lo, hi = self._range(query)
            if hi > lo:
                return query, self.order[lo : min(hi, lo + MAX_MATCHES)] + n
        return None

    def _majority_path(self, positions: np.ndarray, limit: int) -> list[int]:
        """Up to ``limit`` tokens, each the most frequent next token of the occurrences still followed."""
        out: list[int] = []
        for _ in range(limit):
            following = self.tokens[positions]
            following = following[following != SEPARATOR]
            if not len(following):
                break
            values, counts = np.unique(following, return_counts=True)
            token = int(values[np.argmax(counts)])
            out.append(token)
            positions = positions[self.tokens[positions] == token] + 1
        return out

    def continuation(self, tail: Sequence[int], limit: int, min_n: int = 1) -> list[int]:
        key = ("one", tuple(int(t) for t in tail[-self.depth :]), limit, min_n)
        return self._remember(key, lambda: self._continuation(tail, limit, min_n))

    def _continuation(self, tail: Sequence[int], limit: int, min_n: int) -> list[int]:
        match = self._match(tail, min_n)
        return [] if match is None else self._majority_path(match[1], limit)

    def continuations(self, tail: Sequence[int], limit: int, min_n: int = 1, most: int = 4) -> list[list[int]]:
        """Up to ``most`` continuations of the longest match: the majority path (``continuation``), then each
        other next token seen after the match, most frequent first, followed by its own majority path."""
        key = ("all", tuple(int(t) for t in tail[-self.depth :]), limit, min_n, most)
        return self._remember(key, lambda: self._continuations(tail, limit, min_n, most))

    def _continuations(self, tail: Sequence[int], limit: int, min_n: int, most: int) -> list[list[int]]:
        match = self._match(tail, min_n)
        first = [] if match is None else self._majority_path(match[1], limit)
        if not first or most <= 1:
            return [first] if first else []
        query, positions = match
        found = [first]
        following = self.tokens[positions]
        values, counts = np.unique(following[following != SEPARATOR], return_counts=True)
        for token in values[np.argsort(-counts, kind="stable")]:
            if int(token) == first[0]:
                continue
            found.append([int(token)] + self.continuation(list(query) + [int(token)], limit - 1, min_n)[: limit - 1])
            if len(found) >= most:
                break
        return found


@lru_cache(maxsize=8)
def _load_cached(path: str, mtime_ns: int) -> Datastore:
    return Datastore.load(Path(path))


@dataclass
class RetrievalOptions(SourceOptions):
    """``datastore``: the artifact-relative path of the datastore file. Matches are at least the n-gram
    source's ``min`` tokens long (``sources.ngram.min``)."""

    datastore: str | None = None

    def check(self, plan: DraftPlan) -> None:
        if not self.datastore:
            raise ArtifactError(f"plan '{plan.name}' drafts by retrieval but names no datastore; rebuild the artifact")


class RetrievalDrafter(LookupSource):
    Options = RetrievalOptions
    name = "retrieval"

    def __init__(self, datastore: Datastore, min_n: int = 2, max_draft: int = 8):
        self.datastore, self.min_n, self.max_draft = datastore, min_n, max_draft

    @classmethod
    def from_plan(cls, plan: ReadPlan, root: Path | None = None) -> "RetrievalDrafter":
        datastore = plan.options("retrieval").datastore
        if root is None:
            raise ArtifactError(f"plan {plan.name!r} drafts by retrieval but no artifact folder holds its datastore")
        path = (Path(root) / datastore).resolve()
        if Path(root).resolve() not in path.parents or not path.is_file():
            raise ArtifactError(
                f"plan {plan.name!r}: datastore {datastore!r} is not a file inside the artifact; rebuild the artifact"
            )
        return cls(_load_cached(str(path), path.stat().st_mtime_ns), plan.options("ngram").min, plan.lookup_max_draft)

    @staticmethod
    def describe(retrieval: RetrievalOptions, plan: DraftPlan) -> str:
        return "retrieval"

    def start(self, prompt: Sequence[int]) -> None:
        pass

    def lookup(self, history: Sequence[int], tail: Sequence[int], limit: int) -> list[int]:
        return self.datastore.continuation(tail, min(limit, self.max_draft), self.min_n)

    def continuations(self, history: Sequence[int], limit: int, most: int) -> list[list[int]]:
        return self.datastore.continuations(history, min(limit, self.max_draft), self.min_n, most)

    def propose(self, ctx: RoundContext) -> Draft:
        tokens = self.lookup(ctx.history, ctx.history, ctx.limit)
        return Draft(tokens=tokens, q=[None] * len(tokens), sources=[self.name] * len(tokens))

    def feedback(self, draft: Draft, accepted: int) -> None:
        pass
