"""The canonical decoder reproduces transformers' logits for every supported family (fp32, 1e-4)."""

import pytest
import torch
from tiny_models import FAMILIES

from speccompile.runtime.backends.torch.decoder import KVCache

TOLERANCE = 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(family, tiny_decoder):
    hf, decoder = tiny_decoder(family)
    ids = torch.randint(3, decoder.config.vocab_size, (1, 48), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        reference = hf(ids).logits
        parallel = decoder(ids)
        # Incremental decoding through the static cache, in uneven chunks (prefill, verify-sized, single).
        cache = KVCache(decoder.config, 64)
        pieces, pos = [], 0
        for size in (30, 5, 1, 1, 7, 4):
            pieces.append(decoder(ids[:, pos : pos + size], pos, cache))
            pos += size
        incremental = torch.cat(pieces, dim=1)
    assert reference.abs().max() > 0.5, "logits too small for the comparison to mean anything"
    assert (parallel - reference).abs().max().item() < TOLERANCE
    assert (incremental - reference).abs().max().item() < TOLERANCE


@pytest.mark.parametrize("family", ["mistral", "gpt_neox", "qwen3", "gemma"])
def test_cache_rollback_overwrites_stale_entries(family, tiny_decoder):
    """Rolling back is starting the next call at an earlier position: stale KV must not leak in."""
    _, decoder = tiny_decoder(family)
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(3, decoder.config.vocab_size, (1, 40), generator=gen)
    junk = torch.randint(3, decoder.config.vocab_size, (1, 6), generator=gen)
    with torch.inference_mode():
        cache = KVCache(decoder.config, 64)
        decoder(ids[:, :30], 0, cache)
        decoder(junk, 30, cache)  # a rejected draft round writes positions 30..35
        rolled = decoder(ids[:, 30:], 30, cache)
        clean = decoder(ids)[:, 30:]
    assert (rolled - clean).abs().max().item() < TOLERANCE


def test_decoder_keeps_no_view_of_the_weights_it_was_built_from(tiny_decoder):
    """``build_decoder`` copies every tensor it is given: a view kept of one (the rotary frequencies were) would
    keep the whole memory-mapped safetensors file of a loaded artifact resident next to the decoder's copy
    (SmolLM2: 513 MB more)."""
    from speccompile.convert import arch_config, canonical_weights
    from speccompile.runtime.backends.torch.decoder import build_decoder

    hf, _ = tiny_decoder("llama")
    config = arch_config(hf)
    weights = canonical_weights(hf, config)
    given = {t.untyped_storage().data_ptr() for t in weights.values()}
    decoder = build_decoder(config, weights)
    kept = [
        name
        for name, t in [*decoder.named_parameters(), *decoder.named_buffers()]
        if t.untyped_storage().data_ptr() in given
    ]
    assert kept == []
