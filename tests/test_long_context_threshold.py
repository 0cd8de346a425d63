"""Far into a long context a model draft stops at a token it doubts (``LONG_CONTEXT_THRESHOLD`` in
``runtime/drafting/model_draft.py``), whatever the plan's tuned threshold:

- a draft whose third token has confidence 0.2 runs to the plan's length before ``LONG_CONTEXT`` positions and
  stops after that token from there on; a plan whose own threshold is higher keeps it;
- greedy output stays plain output on torch and ONNX Runtime with the threshold in force, and drafts get shorter;
- the device round (``runtime/backends/torch/device_round.py``) cuts its drafts by the same rule: its round log
  equals the host round's.
"""

from __future__ import annotations

import numpy as np
import pytest
from lossless import assert_speculative_is_plain
from test_draft_window import int8_plans, prompt

import speccompile.runtime.drafting.model_draft as model_draft
from speccompile.runtime.drafting import read_plans
from speccompile.runtime.drafting.drafter import RoundContext
from speccompile.runtime.drafting.model_draft import DraftPolicy, ModelDrafter
from speccompile.runtime.sampling import SamplingParams


class ScriptedStep:
    """A draft step that drafts token 10 + j at step j with the given confidences (the policy's input)."""

    def __init__(self, confidences: list[float]):
        self.confidences = confidences
        self.steps = 0

    def __call__(self, token, pos, ctx):
        j = self.steps
        self.steps += 1
        return 10 + j, self.confidences[j], None

    def runner_ups(self, most):
        return []


def drafted(pos: int, threshold: float) -> int:
    plan = read_plans(int8_plans(), 4)["int8"]
    step = ScriptedStep([0.9, 0.9, 0.2, 0.9, 0.9, 0.9])
    drafter = ModelDrafter(plan, step, DraftPolicy(max_draft=4, threshold=threshold, adaptive=False))
    ctx = RoundContext(history=[1, 2, 3], pos=pos, limit=8, params=SamplingParams(), rng=np.random.default_rng(0))
    return len(drafter.propose(ctx).tokens)


def test_a_doubted_token_ends_the_draft_only_far_into_the_context():
    near, far = model_draft.LONG_CONTEXT - 1, model_draft.LONG_CONTEXT
    assert drafted(near, 0.0) == 4  # the plan's own threshold: 0
    assert drafted(far, 0.0) == 3  # the doubted third token is the last
    assert drafted(near, 0.95) == drafted(far, 0.95) == 1  # a higher tuned threshold stands


@pytest.mark.parametrize("backend_kind", ["torch", "onnx"])
def test_the_long_context_threshold_keeps_output_plain(backend_kind, tiny_decoder, tmp_path, monkeypatch):
    _, decoder = tiny_decoder("llama")
    if backend_kind == "torch":
        from speccompile.runtime.backends.torch.backend import TorchBackend

        backend, probe = TorchBackend(decoder), decoder
    else:
        from onnx_helpers import make_artifact, ort_backend

        backend = probe = ort_backend(make_artifact(decoder, int8_plans(), tmp_path / "llama", variant="fused"))
    prompts = [prompt(decoder.config.vocab_size, n, seed=n) for n in (30, 40)]
    cut = []
    propose = ModelDrafter.drafting

    def counted(self, ctx):
        draft = yield from propose(self, ctx)
        cut.append(len(draft.tokens) < min(self.policy.max_draft, ctx.limit))
        return draft

    monkeypatch.setattr(ModelDrafter, "drafting", counted)
    monkeypatch.setattr(model_draft, "LONG_CONTEXT", 24)
    monkeypatch.setattr(model_draft, "LONG_CONTEXT_THRESHOLD", 0.9)  # random weights: a doubtful draft throughout
    assert_speculative_is_plain(backend, probe, prompts, int8_plans(), 30)
    assert any(cut)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_the_device_round_cuts_like_the_host_round_at_long_context(family, tiny_decoder, monkeypatch):
    from lossless import run

    from speccompile.runtime.backends.torch.backend import TorchBackend

    _, decoder = tiny_decoder(family)
    host = TorchBackend(decoder, round_on_device=False)
    device = TorchBackend(decoder, round_on_device=True)
    monkeypatch.setattr(model_draft, "LONG_CONTEXT", 24)
    monkeypatch.setattr(model_draft, "LONG_CONTEXT_THRESHOLD", 0.9)
    plan = int8_plans()["int8"]
    for n in (20, 33):
        tokens = prompt(decoder.config.vocab_size, n, seed=n)
        host_out, host_stats = run(host, tokens, 30, plan)
        device_out, device_stats = run(device, tokens, 30, plan)
        assert device_out == host_out
        assert device_stats.round_log == host_stats.round_log
