"""Plain decoding on the torch backend's device (``runtime/backends/torch/device_plain.py``), on CPU tensors:
forced here (``round_on_device=True``) so its logic is tested everywhere and only its speed needs a GPU. Greedy
output equals the host's plain steps on every family, eagerly, through the static steps of CUDA graphs
(``eager_capture``) and through a capture that runs the step as CUDA graph capture does (warm-up runs first);
sampling has the target's distribution; the host reads the device once per block of steps."""

from __future__ import annotations

import pytest
from lossless import chi_square_pvalue as gof
from lossless import exact_marginals, next_token_logits, run
from test_device_round import HostReads, count_calls
from tiny_models import FAMILIES

from speccompile.runtime.backends.torch.backend import TorchBackend
from speccompile.runtime.backends.torch.device_plain import PLAIN_BLOCK, DevicePlain
from speccompile.runtime.backends.torch.device_round import DeviceRound
from speccompile.runtime.backends.torch.graphs import eager_capture
from speccompile.runtime.sampling import SamplingParams


def warm_capture(fn):
    """What ``graphs.cuda_capture_with`` does before recording a graph: it runs the step twice (the warm-up, on a
    side stream), with every side effect of a real step; then each call replays it."""
    fn()
    fn()
    return fn


CAPTURES = {"eager": None, "static-steps": eager_capture, "warm-capture": warm_capture}


@pytest.fixture
def blocks_seen(monkeypatch):
    return count_calls(monkeypatch, DevicePlain)


@pytest.mark.parametrize("family", FAMILIES)
def test_device_plain_greedy_equals_host_plain(family, tiny_decoder, blocks_seen):
    _, decoder = tiny_decoder(family)
    host = TorchBackend(decoder, round_on_device=False)
    prompt = [5, 17, 42, 9, 100, 3, 77, 12]
    want, _ = run(host, prompt, 29)
    for name, capture in CAPTURES.items():
        before = blocks_seen[0]
        got, stats = run(TorchBackend(decoder, round_on_device=True, capture=capture), prompt, 29)
        assert got == want, name
        assert blocks_seen[0] - before == -(-28 // PLAIN_BLOCK)  # the first token comes with the prompt
        assert stats.stop_reason == "length" and stats.new_tokens == 29


def test_device_plain_stops_at_eos_like_the_host(tiny_decoder):
    _, decoder = tiny_decoder("llama")
    prompt = [5, 9, 17, 33]
    host = TorchBackend(decoder, round_on_device=False)
    eos = frozenset({run(host, prompt, 30)[0][10]})
    want, stats = run(host, prompt, 30, eos=eos)
    for capture in CAPTURES.values():
        got, device_stats = run(TorchBackend(decoder, round_on_device=True, capture=capture), prompt, 30, eos=eos)
        assert got == want and device_stats.stop_reason == stats.stop_reason == "eos"


@pytest.mark.parametrize("capture", [None, eager_capture], ids=["eager", "static-steps"])
@pytest.mark.parametrize(
    "params", [SamplingParams(), SamplingParams(temperature=0.9, top_k=20, top_p=0.9)], ids=["greedy", "sampling"]
)
def test_device_plain_reads_the_device_once_a_block(tiny_decoder, monkeypatch, capture, params):
    _, decoder = tiny_decoder("llama")
    backend = TorchBackend(decoder, round_on_device=True, capture=capture)
    reads = HostReads(monkeypatch)
    per_block: list[int] = []
    original = DevicePlain.__call__

    def counted(self, ctx, stats):
        before = reads.count
        out = original(self, ctx, stats)
        per_block.append(reads.count - before)
        return out

    monkeypatch.setattr(DevicePlain, "__call__", counted)
    tokens, _ = run(backend, [5, 9, 17, 33], 3 * PLAIN_BLOCK + 1, params=params, seed=3)
    assert len(tokens) == 3 * PLAIN_BLOCK + 1
    assert per_block == [1, 1, 1]


VOCAB = 12
PROMPT = [1, 5, 7, 3, 5, 7, 9, 5]
SAMPLES = 2000
ALPHA = 1e-3


@pytest.mark.parametrize("capture", [None, eager_capture], ids=["eager", "static-steps"])
def test_device_plain_sampling_matches_the_target_distribution(small_vocab_llama, capture):
    """The 2nd and 3rd tokens follow the model's exact marginals (temperature, top-k and top-p applied on the
    device); a negative control tells them from another temperature's."""
    params = SamplingParams(temperature=0.8, top_k=6, top_p=0.9)
    backend = TorchBackend(small_vocab_llama, round_on_device=True, capture=capture)
    target2, target3 = exact_marginals(next_token_logits(small_vocab_llama), params, PROMPT, VOCAB)
    other2, _ = exact_marginals(next_token_logits(small_vocab_llama), SamplingParams(temperature=2.0), PROMPT, VOCAB)
    second, third = [], []
    for seed in range(SAMPLES):
        tokens, _ = run(backend, PROMPT, 3, params=params, seed=seed)
        second.append(tokens[1])
        third.append(tokens[2])
    assert gof(second, target2) > ALPHA
    assert gof(third, target3) > ALPHA
    assert gof(second, other2) < ALPHA  # negative control


def test_plain_steps_stay_on_the_device_on_cuda_or_when_asked(tiny_decoder, monkeypatch):
    _, decoder = tiny_decoder("llama")
    monkeypatch.delenv("SPECCOMPILE_DEVICE_ROUND", raising=False)
    assert TorchBackend(decoder).device_round(None, 0) is None  # CPU: the host's plain steps
    assert isinstance(TorchBackend(decoder, round_on_device=True).device_round(None, 0), DevicePlain)
    assert TorchBackend(decoder, round_on_device=False).device_round(None, 0) is None
    assert not isinstance(TorchBackend(decoder, round_on_device=True).device_round(None, 0), DeviceRound)
