"""Speculative greedy output equals the runtime's plain greedy output, token for token, for every
family, for layer-skip and early-exit plans, over many prompts and draft lengths."""

import pytest
import torch
from lossless import assert_same_greedy, run
from tiny_models import FAMILIES

from speccompile.runtime.artifact.manifest import DraftPlan
from speccompile.runtime.backends.torch.backend import TorchBackend

PROMPTS = 6
NEW_TOKENS = 40


def plans(num_layers: int) -> list[DraftPlan]:
    out = []
    for k, threshold in ((1, 0.0), (3, 0.0), (5, 0.3), (8, 0.0)):
        out.append(
            DraftPlan.of(
                name=f"skip-k{k}",
                skip_attn=[1],
                skip_mlp=[num_layers - 2],
                sources={"model": {"max_draft": k, "threshold": threshold}},
            )
        )
        out.append(
            DraftPlan.of(
                name=f"exit-k{k}",
                exit_layer=num_layers // 2,
                sources={"model": {"max_draft": k, "threshold": threshold}},
            )
        )
    out.append(
        DraftPlan.of(
            name="exit-last", exit_layer=num_layers - 1, sources={"model": {"max_draft": 6, "adaptive": False}}
        )
    )
    out.append(
        DraftPlan.of(
            name="skip-all-attn",
            skip_attn=list(range(num_layers)),
            sources={"model": {"max_draft": 4, "adaptive": False}},
        )
    )
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_speculative_greedy_equals_plain(family, tiny_decoder):
    _, decoder = tiny_decoder(family)
    backend = TorchBackend(decoder)
    gen = torch.Generator().manual_seed(3)
    vocab = decoder.config.vocab_size
    near_ties = accepted = comparisons = 0
    for p in range(PROMPTS):
        length = 3 + 7 * p  # 3..38 tokens: with mistral's window of 24, drafts cross the window edge
        prompt = torch.randint(3, vocab, (length,), generator=gen).tolist()
        plain, _ = run(backend, prompt, NEW_TOKENS)
        assert len(plain) == NEW_TOKENS
        for plan in plans(decoder.config.num_layers):
            spec, stats = run(backend, prompt, NEW_TOKENS, plan)
            near_ties += assert_same_greedy(decoder, prompt, plain, spec)
            accepted += stats.accepted
            comparisons += 1
    assert near_ties <= 1, f"{near_ties} near-tie divergences in {comparisons} runs: too many to be rounding"
    assert accepted > 0, "no drafted token was ever accepted: the accept path was not exercised"


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_eos_stops_generation_identically(family, tiny_decoder):
    """With an EOS that the model actually emits, both modes stop at the same place and keep the EOS."""
    _, decoder = tiny_decoder(family)
    backend = TorchBackend(decoder)
    prompt = [5, 9, 17, 33]
    free, _ = run(backend, prompt, 30)
    eos = frozenset({free[12]})
    plain, stats = run(backend, prompt, 30, eos=eos)
    assert plain[-1] in eos and stats.stop_reason == "eos" and len(plain) <= 13
    for plan in plans(decoder.config.num_layers)[:4]:
        spec, spec_stats = run(backend, prompt, 30, plan, eos=eos)
        assert spec == plain and spec_stats.stop_reason == "eos"
