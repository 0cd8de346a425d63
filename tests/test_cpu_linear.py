"""The CPU weight-streaming linear (runtime/cpu_linear.py): same products as F.linear, chosen per row
count by measurement, and lossless when forced on for every row count."""

import pytest
import torch
import torch.nn.functional as F

from lossless import assert_same_greedy, run
from speccompile.convert import arch_config, canonical_weights
from speccompile.runtime.cpu_linear import MAX_ROWS, StreamingLinear, choose_streaming_rows, use_streaming_linears
from speccompile.runtime.decoder import build_decoder
from speccompile.runtime.manifest import DraftPlan
from speccompile.runtime.torch_backend import TorchBackend


@pytest.mark.parametrize("bias", [False, True])
def test_streaming_linear_computes_f_linear(bias):
    torch.manual_seed(0)
    layer = torch.nn.Linear(48, 80, bias=bias)
    layer.__class__ = StreamingLinear
    layer.streaming_rows = frozenset(range(1, MAX_ROWS + 1))
    for rows in (1, 2, 3, 7, 16, 17):  # 17: beyond the chosen counts, F.linear itself
        x = torch.randn(1, rows, 48)
        y = layer(x)
        assert y.shape == (1, rows, 80) and y.is_contiguous()
        torch.testing.assert_close(y, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


def test_choice_covers_counts_between_probes():
    weights = [torch.randn(64, 32), torch.randn(32, 64)]
    assert choose_streaming_rows(weights, rows=(1, 4), margin=float("inf")) == frozenset(range(1, MAX_ROWS + 1))
    assert choose_streaming_rows(weights, rows=(1, 4), margin=0.0) == frozenset()


def test_environment_override(monkeypatch):
    monkeypatch.setenv("SPECCOMPILE_CPU_LINEAR", "fastest")
    with pytest.raises(ValueError, match="SPECCOMPILE_CPU_LINEAR"):
        use_streaming_linears(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    monkeypatch.setenv("SPECCOMPILE_CPU_LINEAR", "standard")
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    assert use_streaming_linears(model) == frozenset()


@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen2"])
def test_speculative_greedy_equals_plain_with_streaming_forced(family, tiny_decoder, monkeypatch):
    monkeypatch.setenv("SPECCOMPILE_CPU_LINEAR", "streaming")
    hf, _ = tiny_decoder(family)
    config = arch_config(hf)
    decoder = build_decoder(config, canonical_weights(hf, config))  # a fresh one: the shared one keeps its choice
    backend = TorchBackend(decoder)
    linears = [m for m in decoder.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(type(m) is StreamingLinear for m in linears)
    assert decoder._streaming_rows == frozenset(range(1, MAX_ROWS + 1))
    gen = torch.Generator().manual_seed(5)
    near_ties = accepted = 0
    for length in (4, 19):
        prompt = torch.randint(3, config.vocab_size, (length,), generator=gen).tolist()
        plain, _ = run(backend, prompt, 32)
        for plan in (DraftPlan(name="exit", exit_layer=config.num_layers // 2, max_draft=5),
                     DraftPlan(name="skip", skip_attn=[1], max_draft=3)):
            spec, stats = run(backend, prompt, 32, plan)
            near_ties += assert_same_greedy(decoder, prompt, plain, spec)
            accepted += stats.accepted
    assert near_ties <= 1 and accepted > 0
