"""Lookups at length: the n-gram index's cost per round is flat in the input's length, its memory is linear and
within its stated bound, and its proposals are the walk-every-occurrence index's (``ReferenceIndex``, the index
as it was before it dropped repeated occurrences) on random, periodic and code-like token streams."""

import itertools
import random
import tracemalloc

import pytest

from speccompile.runtime.drafting.drafter import RoundContext
from speccompile.runtime.drafting.ngram import NgramDrafter, NgramIndex
from speccompile.runtime.sampling import SamplingParams


class ReferenceIndex:
    """The index with every earlier occurrence kept and walked: what ``NgramIndex`` must answer. ``visited``
    counts the occurrences its lookups walk."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self.latest = {n: {} for n in range(min_n, max_n + 1)}
        self.earlier = {n: {} for n in range(min_n, max_n + 1)}
        self.visited = 0

    def append(self, token: int) -> None:
        i = len(self.tokens)
        self.tokens.append(token)
        for n, table in self.latest.items():
            if i >= n:
                gram = tuple(self.tokens[i - n : i])
                if gram in table:
                    self.earlier[n].setdefault(gram, []).append(table[gram])
                table[gram] = i

    def continuations(self, tail, limit: int, short: int = 0, most: int = 4) -> list[list[int]]:
        found: list[list[int]] = []
        for n in range(min(self.max_n, len(tail)), self.min_n - 1, -1):
            gram = tuple(tail[-n:])
            latest = self.latest[n].get(gram)
            if latest is None:
                continue
            for start in itertools.chain([latest], reversed(self.earlier[n].get(gram, ()))):
                self.visited += 1
                cont = self.tokens[start : start + (1 if n <= short else limit)]
                if cont and not any(f[: len(cont)] == cont for f in found):
                    found.append(cont)
                    if len(found) >= most:
                        return found
        return found


def periodic(length: int, seed: int = 0) -> list[int]:
    """A block of 37 tokens repeated: every n-gram recurs every 37 positions with the same continuation."""
    block = random.Random(seed).choices(range(1000), k=37)
    return (block * (length // 37 + 1))[:length]


def code_like(length: int, seed: int = 0) -> list[int]:
    """Lines drawn from a few templates with a varying name in each: n-grams recur often, continuations vary."""
    rng = random.Random(seed)
    templates = [[5, 6, -1, 7, 8, 9], [10, 5, -1, 11], [12, -1, 13, 14, 7, 9], [5, 6, 15, -1, 8, 9]]
    out: list[int] = []
    while len(out) < length:
        out += [rng.randrange(100, 140) if t < 0 else t for t in rng.choice(templates)]
    return out[:length]


def uniform(length: int, seed: int = 0, vocab: int = 12) -> list[int]:
    return random.Random(seed).choices(range(vocab), k=length)


STREAMS = {
    "periodic": periodic,
    "code-like": code_like,
    "random": uniform,
    "random-wide": lambda n: uniform(n, 1, 5000),
}


@pytest.mark.parametrize("stream", sorted(STREAMS))
@pytest.mark.parametrize("short", [0, 2])
def test_proposals_equal_the_reference_walk(stream, short):
    """Every lookup a round may make (a chain's continuation, a tree's continuations at full and one-token
    length) equals the reference walk's, at every position of the stream."""
    tokens = STREAMS[stream](1500)
    depth = 6
    index, reference = NgramIndex(1, 4, depth), ReferenceIndex(1, 4)
    checked = 0
    for i, token in enumerate(tokens):
        index.append(token)
        reference.append(token)
        if i % 3:
            continue
        tail = tokens[max(0, i - 8) : i + 1] + ([tokens[i // 2]] if i % 2 else [])  # a draft's tail too
        for limit, most in [(depth, 4), (depth, 8), (1, 4), (depth, 1), (3, 1)]:
            assert index.continuations(tail, limit, short, most) == reference.continuations(tail, limit, short, most)
            checked += 1
        assert index.continuation(tail, depth, short) == (reference.continuations(tail, depth, short, 1) or [[]])[0]
        # a limit between 1 and depth (a request's last rounds): the walk is capped, so a tree may offer fewer
        # or other branches, each one the text holds, and its first branch is still the chain's
        found, every = index.continuations(tail, 3, short, 4), reference.continuations(tail, 3, short, 10**6)
        assert found[:1] == every[:1] and {tuple(f) for f in found} <= {tuple(f) for f in every}
    assert checked > 2000


def _round_work(index: NgramIndex, history: list[int], most: int) -> int:
    """The work of one round at the end of ``history``: index its last token, look up a chain and a tree (at
    full length and after a short match)."""
    before = index.work
    index.sync(history)
    index.continuation(history, index.depth, 0)
    index.continuations(history, index.depth, 2, most)
    index.continuations(history, index.depth, 0, most)
    return index.work - before


def _round_bound(index: NgramIndex, most: int, lookups: int = 3) -> int:
    """What a round may cost at any length: one token indexed, and per lookup and n-gram size one probe and at
    most ``walk_limit`` occurrences of at most ``depth`` tokens each."""
    sizes = index.max_n - index.min_n + 1
    return 1 + lookups * sizes * (1 + index.walk_limit(most) * (1 + index.depth))


@pytest.mark.parametrize("stream", sorted(STREAMS))
def test_lookup_work_per_round_is_flat_in_length(stream):
    """A round's work (tokens indexed, dict probes, occurrences walked, tokens copied) at 1K and 8K positions is
    within a bound that does not depend on the length, and about the same at both; the reference walk's grows
    with the length on the periodic stream (there it would exceed the bound)."""
    tokens = STREAMS[stream](8192)
    most, depth = 4, 8
    work, visited = {}, {}
    for length in (1024, 8192):
        index, reference = NgramIndex(1, 4, depth), ReferenceIndex(1, 4)
        index.sync(tokens[: length - 32])
        for t in tokens[: length - 32]:
            reference.append(t)
        rounds, walks = [], []
        for end in range(length - 31, length + 1):  # 32 rounds of one committed token each
            rounds.append(_round_work(index, tokens[:end], most))
            reference.append(tokens[end - 1])
            before = reference.visited
            reference.continuations(tokens[:end], depth, 0, most)
            walks.append(reference.visited - before)
        work[length], visited[length] = max(rounds), max(walks)
        assert work[length] <= _round_bound(index, most)
    assert work[8192] <= 2 * work[1024]
    if stream == "periodic":
        assert visited[8192] >= 7 * visited[1024]
        assert visited[8192] * (1 + depth) > _round_bound(NgramIndex(1, 4, depth), most)


def test_drafter_round_touches_only_the_new_tokens():
    """The drafter a plan runs: a round after the prompt indexes the tokens committed since the last round only."""
    prompt = code_like(8000)
    drafter = NgramDrafter(2, 4, 8, short_n=2)
    drafter.start(prompt)
    history = list(prompt)
    ctx = RoundContext(history=history, pos=len(history) - 1, limit=8, params=SamplingParams(), rng=None)
    drafter.propose(ctx)
    assert drafter.index.work >= len(prompt)  # the first round reads the prompt once
    for token in code_like(40, seed=3):
        history.append(token)
        before = drafter.index.work
        drafter.propose(ctx)
        drafter.continuations(history, 8, 4)
        assert drafter.index.work - before <= _round_bound(drafter.index, 4, lookups=2)


def _indexed_bytes(tokens: list[int], depth: int) -> int:
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        index = NgramIndex(2, 4, depth)
        index.sync(tokens)
        return tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()


def twice(length: int) -> list[int]:
    """Every n-gram twice: each gram's second occurrence gives it its per-gram sets (the most memory per token)."""
    block = uniform(length // 2, 2, 5000)
    return block + block


@pytest.mark.parametrize("stream", [code_like, twice, lambda n: uniform(n, 1, 5000)])
def test_memory_is_linear_and_within_the_stated_bound(stream):
    """Bytes held per token indexed, at 1K to 8K tokens: within ``BYTES_PER_TOKEN`` per n-gram size at every
    length (so linear in the tokens indexed)."""
    tokens = [t + 1000 for t in stream(8192)]  # above CPython's cached small ints: each token its own int
    for length in (1024, 2048, 4096, 8192):
        per_token = _indexed_bytes(tokens[:length], 8) / length
        assert 0 < per_token <= 3 * NgramIndex.BYTES_PER_TOKEN


def test_bad_index_shapes_are_refused_in_one_line():
    with pytest.raises(ValueError, match="min_n <= max_n"):
        NgramIndex(3, 2)
    index = NgramIndex(1, 2, depth=4)
    index.sync([1, 2, 3, 1, 2, 4])
    with pytest.raises(ValueError, match="exceed the index's depth"):
        index.continuations([1, 2], limit=5, most=2)
    assert index.continuation([1, 2], 5) == [4]  # a chain's lookup is the latest occurrence's, at any limit
