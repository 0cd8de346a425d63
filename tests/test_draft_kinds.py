"""The draft-kinds seam: backends implement one complete interface and never learn what a plan is; a
kind written outside the runtime (``tests/demo_kind.py``, one module plus one registry line) decodes
losslessly, is priced by the cost model and scored by the estimator without touching any of them."""

from __future__ import annotations

import inspect

import pytest
from lossless import assert_same_greedy, run

from speccompile.passes.acceptance_estimate import profile_plan, reference_pass
from speccompile.passes.cost_model import measure_costs
from speccompile.runtime.artifact.manifest import DraftPlan
from speccompile.runtime.backends.base import Backend
from speccompile.runtime.backends.onnx import OnnxBackend
from speccompile.runtime.backends.tensorrt.backend import TensorRTBackend
from speccompile.runtime.backends.torch.backend import TorchBackend
from speccompile.runtime.drafting import check_plan, describe
from speccompile.runtime.drafting import kinds as draft_kinds
from speccompile.runtime.errors import ArtifactError

PROMPT = [5, 17, 42, 9, 100, 3, 77, 12]


@pytest.mark.parametrize("cls", [TorchBackend, OnnxBackend, TensorRTBackend])
def test_every_backend_implements_the_whole_interface(cls):
    assert issubclass(cls, Backend) and not inspect.isabstract(cls)
    for name in Backend.__abstractmethods__:
        assert name in cls.__dict__, f"{cls.__name__} does not implement {name}"
    # what a plan is stays with its kind: no backend overrides the calls that hand a plan to its kind
    for name in ("draft", "verify", "check_plans", "forward"):
        assert name not in cls.__dict__, f"{cls.__name__} overrides {name}"


def test_a_backend_missing_part_of_the_interface_cannot_be_made():
    class Partial(Backend):  # no run, unsupported or load_draft_head
        def reserve(self, max_len):
            pass

        def replica(self):
            return self

    with pytest.raises(TypeError, match="abstract"):
        Partial()


@pytest.fixture
def shallow_kind(monkeypatch):
    """The demonstration kind, registered the way a new kind is: one line in ``KINDS``."""
    monkeypatch.setitem(draft_kinds.KINDS, "shallow", "demo_kind:ShallowDraft")
    return DraftPlan.of(name="shallow", kind="shallow", params={"blocks": 1}, sources={"model": {"max_draft": 4}})


@pytest.mark.parametrize("family", ["llama", "gpt_neox", "gemma"])
def test_a_kind_added_outside_the_runtime_is_lossless(tiny_decoder, shallow_kind, family):
    _, decoder = tiny_decoder(family)
    plan = shallow_kind
    check_plan(plan, decoder.config.num_layers)
    backend = TorchBackend(decoder)
    plain, _ = run(backend, PROMPT, 24)
    spec, stats = run(backend, PROMPT, 24, plan)
    assert stats.rounds > 0 and stats.drafted > stats.rounds  # it drafted, several tokens a round
    assert_same_greedy(decoder, PROMPT, plain, spec)
    assert describe(plan) == "the first 1 blocks, no prefix reuse"


@pytest.mark.parametrize("variant", ["standard", "fused"])
def test_a_kind_added_outside_the_runtime_is_exported_and_runs_on_onnx(tiny_decoder, shallow_kind, tmp_path, variant):
    """The exporter writes the graphs of the kind's segments (``DraftKind.segments()``) and ONNX Runtime runs
    them, with no exporter or backend file knowing the kind."""
    pytest.importorskip("onnxruntime")
    from onnx_helpers import make_artifact, ort_backend

    _, decoder = tiny_decoder("llama")
    root = make_artifact(decoder, {"shallow": shallow_kind}, tmp_path / "artifact", variant=variant)
    backend = ort_backend(root)
    assert backend.unsupported(draft_kinds.kind_of(shallow_kind, decoder.config.num_layers).draft_segment) is None
    plain, _ = run(backend, PROMPT, 24)
    spec, stats = run(backend, PROMPT, 24, shallow_kind)
    assert stats.rounds > 0 and stats.drafted > stats.rounds
    assert_same_greedy(decoder, PROMPT, plain, spec)


def test_a_kind_added_outside_the_runtime_is_priced_and_estimated(tiny_decoder, shallow_kind):
    _, decoder = tiny_decoder("llama")
    plan = shallow_kind
    cost = measure_costs(decoder, 4, rounds=2)
    assert 0 < cost.draft_step(plan) < cost.plain_step()
    assert cost.verify(plan, 3) == cost.verify(None, 3)  # no prefix reuse: a full-model verify
    plain, _ = run(TorchBackend(decoder), PROMPT, 12)
    profile = profile_plan(decoder, plan, [reference_pass(decoder, PROMPT + plain, len(PROMPT))])
    assert len(profile.matches[0]) == len(plain) - 1


def test_an_unknown_kind_is_refused_in_one_line():
    plan = DraftPlan.of(name="x", kind="teleport", lookup=["ngram"])
    with pytest.raises(ArtifactError) as exc:
        check_plan(plan, 4)
    assert "teleport" in str(exc.value) and "\n" not in str(exc.value)
