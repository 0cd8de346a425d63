"""The acceptance estimator (one parallel forward per sequence) against the real draft-and-verify loop.

Early-exit plans: the estimate is exact, round for round. Layer-skip plans: the first drafted token of
every round is estimated exactly (its attention reads the verifier's K/V for earlier positions and its
own on the diagonal, which is what the estimator computes); later tokens of a round are approximated,
and the error of the mean accepted length is measured and bounded.
"""

import numpy as np
import pytest
import torch
from lossless import run

from speccompile.passes.acceptance_estimate import profile_plan, reference_pass, simulate_rounds
from speccompile.runtime.artifact.manifest import DraftPlan
from speccompile.runtime.backends.torch.backend import TorchBackend
from speccompile.runtime.drafting import options

NEW_TOKENS = 48


def prompts(vocab, count=4):
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(3, vocab, (6 + 5 * i,), generator=gen).tolist() for i in range(count)]


def real_and_estimated(decoder, plan):
    backend = TorchBackend(decoder)
    real_rounds, references = [], []
    for prompt in prompts(decoder.config.vocab_size):
        plain, _ = run(backend, prompt, NEW_TOKENS)
        spec, stats = run(backend, prompt, NEW_TOKENS, plan)
        assert spec == plain
        references.append(reference_pass(decoder, prompt + plain, len(prompt)))
        real_rounds.append(stats.round_log)
    profile = profile_plan(decoder, plan, references)
    return real_rounds, profile


@pytest.mark.parametrize("family", ["llama", "gpt_neox", "opt"])
@pytest.mark.parametrize("threshold", [0.0, 0.5])
def test_early_exit_estimate_is_exact(family, threshold, tiny_decoder):
    _, decoder = tiny_decoder(family)
    plan = DraftPlan.of(
        name="exit", exit_layer=2, sources={"model": {"max_draft": 4, "threshold": threshold, "adaptive": False}}
    )
    real_rounds, profile = real_and_estimated(decoder, plan)
    for real, matches, confidences in zip(real_rounds, profile.matches, profile.confidences):
        one = type(profile)([matches], [confidences])
        simulated = simulate_rounds(one, options(plan, "model").max_draft, options(plan, "model").threshold)
        if threshold == 0.0:
            assert simulated == real
        else:
            # After a rejected token the real draft continues from a wrong prefix, so only the number
            # drafted past a mismatch may differ; the accepted counts are exact.
            assert [a for _, a in simulated] == [a for _, a in real]
    assert sum(a for rounds in real_rounds for _, a in rounds) > 0


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2"])
def test_layer_skip_first_token_exact_and_mean_close(family, tiny_decoder):
    _, decoder = tiny_decoder(family)
    L = decoder.config.num_layers
    plan = DraftPlan.of(
        name="skip", skip_attn=[1], skip_mlp=[L - 2], sources={"model": {"max_draft": 4, "adaptive": False}}
    )
    real_rounds, profile = real_and_estimated(decoder, plan)
    mismatched = checked = 0
    real_tokens, real_count = 0, 0
    for real, matches in zip(real_rounds, profile.matches):
        i = 0
        for drafted, accepted in real:
            # The first draft of the round is right exactly when the estimator says so.
            mismatched += int((accepted >= 1) != bool(matches[i]))
            checked += 1
            i += accepted + 1
            real_tokens += accepted + 1
            real_count += 1
    assert checked > 20 and mismatched <= 1, f"{mismatched}/{checked} first-token estimates differ from the real loop"
    estimated = simulate_rounds(profile, options(plan, "model").max_draft, options(plan, "model").threshold)
    est_mean = np.mean([a + 1 for _, a in estimated])
    real_mean = real_tokens / real_count
    # Later tokens of a round attend to the draft's own K/V of that round, which the estimator replaces
    # by the full model's: for a draft that skips two of eight sublayers the bias is small.
    assert abs(est_mean - real_mean) / real_mean < 0.15, (est_mean, real_mean)


@pytest.mark.parametrize("family", ["llama", "mistral", "gemma3_text", "smollm3", "gpt_neox", "opt"])
def test_batched_calibration_continuations_equal_one_prompt_at_a_time(tiny_decoder, family):
    """Calibration decodes its prompts as one left-padded batch where rows cannot see their padding
    (rotary / NoPE positions, sliding windows); each row must be the plain loop's own greedy output, and
    an eos ends only its own row. Learned positions (opt) take the one-prompt loop."""
    from speccompile.passes.acceptance_estimate import batches_left_padded, greedy_continuations

    _, decoder = tiny_decoder(family)
    assert batches_left_padded(decoder) == (family != "opt")
    batch_prompts = prompts(decoder.config.vocab_size, count=5)
    alone = greedy_continuations(decoder, batch_prompts, 30, batch=1)
    assert greedy_continuations(decoder, batch_prompts, 30) == alone
    stop = alone[2][3]  # row 2 stops after its 4th token; rows that never produce it run to the end
    ended = greedy_continuations(decoder, batch_prompts, 30, eos=frozenset({stop}))
    for row, (got, full) in enumerate(zip(ended, alone)):
        cut = full.index(stop) + 1 if stop in full else len(full)
        assert got == full[:cut], row
