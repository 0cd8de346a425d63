"""The device n-gram lookup (``runtime/backends/torch/device_lookup.py``) proposes exactly what the host index
(``runtime/drafting/ngram.py``, ``NgramIndex.continuation``) proposes, whatever the buffer holds past the
valid tokens; and the device round looks up on the device after its first round (the host source proposes
once per sequence)."""

from __future__ import annotations

import random

import pytest
import torch
from lossless import assert_same_greedy, run

from speccompile.runtime.artifact.manifest import DraftPlan
from speccompile.runtime.backends.torch.backend import TorchBackend
from speccompile.runtime.backends.torch.device_lookup import ngram_continuation
from speccompile.runtime.drafting.ngram import NgramDrafter, NgramIndex


def host_and_device(tokens: list[int], garbage: list[int], min_n: int, max_n: int, limit: int, short: int):
    index = NgramIndex(min_n, max_n)
    index.sync(tokens)
    want = index.continuation(tokens, limit, short)
    following, count = ngram_continuation(
        torch.tensor(tokens + garbage), torch.tensor(len(tokens)), min_n, max_n, limit, short
    )
    return want, following[: int(count)].tolist()


@pytest.mark.parametrize("vocab", [2, 4, 50])
def test_the_device_lookup_proposes_what_the_host_index_proposes(vocab):
    rng = random.Random(vocab)
    hits = 0
    for _ in range(200):
        length = rng.randint(1, 80)
        tokens = [rng.randrange(vocab) for _ in range(length)]
        garbage = [rng.randrange(vocab) for _ in range(rng.randint(1, 16))]  # what a buffer holds past its tokens
        min_n = rng.randint(1, 3)
        max_n = rng.randint(min_n, 5)
        want, got = host_and_device(tokens, garbage, min_n, max_n, rng.randint(1, 8), rng.randint(0, max_n))
        assert got == want, (tokens, min_n, max_n)
        hits += bool(want)
    assert hits > 20  # matches were found, of several lengths


def test_the_device_lookup_on_repetitive_text():
    """Longest match first, the latest occurrence, cut at the end of the valid tokens."""
    text = [1, 2, 3, 4, 5, 1, 2, 3, 9, 9, 1, 2, 3]
    assert host_and_device(text, [7, 7], 1, 3, 4, 0) == ([9, 9, 1, 2], [9, 9, 1, 2])
    assert host_and_device(text, [7, 7], 1, 3, 4, 3) == ([9], [9])  # a match of <= short tokens: one token
    assert host_and_device([5, 6, 5], [5, 6, 5, 6], 1, 2, 4, 0) == ([6, 5], [6, 5])
    assert host_and_device([8, 9], [8, 9], 1, 3, 4, 0) == ([], [])


def test_the_device_round_looks_up_on_the_device_after_its_first_round(tiny_decoder, monkeypatch):
    _, decoder = tiny_decoder("llama")
    plan = DraftPlan.of(
        name="ngram", lookup=["ngram"], lookup_max_draft=4, sources={"ngram": {"min": 1, "max": 3, "short": 1}}
    )
    calls = [0]
    original = NgramDrafter.propose

    def counted(self, ctx):
        calls[0] += 1
        return original(self, ctx)

    monkeypatch.setattr(NgramDrafter, "propose", counted)
    prompt = [5, 9, 17, 33, 5, 9, 17, 40, 5, 9]
    plain, _ = run(TorchBackend(decoder, round_on_device=False), prompt, 40)
    spec, stats = run(TorchBackend(decoder, round_on_device=True), prompt, 40, plan)
    assert_same_greedy(decoder, prompt, plain, spec)
    assert stats.rounds > 5 and stats.drafted > 0 and calls[0] == 1
