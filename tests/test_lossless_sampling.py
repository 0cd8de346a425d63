"""Speculative sampling has the plain sampler's distribution (Leviathan/Chen rejection sampling).

On a 12-token vocabulary the exact distribution of the 2nd and 3rd sampled tokens is computable by
enumeration, so both samplers are tested against it with a chi-square goodness-of-fit test. A negative
control shows the test has power: the same samples are clearly *not* distributed like the draft.
"""

import numpy as np
import pytest
from lossless import chi_square_pvalue as gof
from lossless import exact_marginals, next_token_logits, run
from tiny_models import make_model

from speccompile.convert import arch_config, canonical_weights
from speccompile.runtime.artifact.manifest import DraftPlan
from speccompile.runtime.backends.torch.backend import TorchBackend
from speccompile.runtime.backends.torch.decoder import build_decoder
from speccompile.runtime.sampling import SamplingParams

VOCAB = 12
PROMPT = [1, 5, 7, 3]
SAMPLES = 2000
ALPHA = 1e-3


@pytest.fixture(scope="module", params=["llama", "gpt_neox"])
def small_vocab_decoder(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    folder = make_model(
        request.param,
        tmp_path_factory.mktemp("small_vocab") / request.param,
        seed=4,
        vocab_size=VOCAB,
        initializer_range=0.15,
    )
    hf = AutoModelForCausalLM.from_pretrained(folder).eval()
    config = arch_config(hf)
    return build_decoder(config, canonical_weights(hf, config))


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_k=6, top_p=0.9)],
    ids=["t1.0", "t0.8-topk6-topp0.9"],
)
def test_speculative_sampling_matches_target_distribution(small_vocab_decoder, params):
    decoder = small_vocab_decoder
    backend = TorchBackend(decoder)
    plan = DraftPlan.of(
        name="skip", skip_attn=[1, 2], skip_mlp=[1, 2], sources={"model": {"max_draft": 2, "adaptive": False}}
    )

    target2, target3 = exact_marginals(next_token_logits(decoder), params, PROMPT, VOCAB)
    draft2, draft3 = exact_marginals(next_token_logits(decoder, plan), params, PROMPT, VOCAB)
    assert 0.5 * np.abs(target3 - draft3).sum() > 0.1, "draft too close to the target for the control to mean anything"

    spec2, spec3, plain3, accepted = [], [], [], 0
    for seed in range(SAMPLES):
        tokens, stats = run(backend, PROMPT, 3, plan, params, seed=seed)
        spec2.append(tokens[1])
        spec3.append(tokens[2])
        accepted += stats.accepted
    for seed in range(SAMPLES // 2):
        plain3.append(run(backend, PROMPT, 3, None, params, seed=seed)[0][2])
    assert 0 < accepted < 2 * SAMPLES, "both the accept and the reject path must be exercised"
    assert gof(spec2, target2) > ALPHA
    assert gof(spec3, target3) > ALPHA
    assert gof(plain3, target3) > ALPHA
    # Negative control: the samples are distinguishable from the draft's own distribution.
    assert gof(spec3, draft3) < ALPHA
