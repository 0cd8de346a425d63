"""The draft-source seam: a source written outside the runtime (``tests/demo_source.py``, one module plus one
registry line) drafts losslessly alone, behind a model draft and in token trees, keeps its options under its own
name in the plan, and has them checked by itself, with no other file touched."""

from __future__ import annotations

import pytest
from lossless import assert_same_greedy, run

from speccompile.runtime.artifact.manifest import DraftPlan
from speccompile.runtime.backends.torch.backend import TorchBackend
from speccompile.runtime.drafting import SOURCES, check_plan, describe, options
from speccompile.runtime.errors import ArtifactError

PROMPT = [5, 17, 42, 9, 100, 3, 77, 12, 5, 17, 42, 9, 100]


@pytest.fixture
def successor(monkeypatch):
    """The demonstration source, registered the way a new source is: one line in ``SOURCES``."""
    monkeypatch.setitem(SOURCES, "successor", "demo_source:SuccessorDrafter")


@pytest.mark.parametrize("family", ["llama", "gpt_neox"])
@pytest.mark.parametrize("composition", ["alone", "behind the model", "tree"])
def test_a_source_added_outside_the_runtime_is_lossless(tiny_decoder, successor, family, composition):
    _, decoder = tiny_decoder(family)
    plan = {
        "alone": DraftPlan.of(name="s", lookup=["successor"], sources={"successor": {"length": 4}}),
        "behind the model": DraftPlan.of(
            name="s",
            exit_layer=1,
            lookup=["successor"],
            sources={"successor": {"length": 2}, "model": {"max_draft": 3}},
        ),
        "tree": DraftPlan.of(
            name="s",
            lookup=["ngram", "successor"],
            lookup_branches=2,
            tree_nodes=6,
            sources={"successor": {"length": 3}, "ngram": {"min": 1, "max": 3}},
        ),
    }[composition]
    check_plan(plan, decoder.config.num_layers)
    backend = TorchBackend(decoder)
    plain, _ = run(backend, PROMPT, 32)
    spec, stats = run(backend, PROMPT, 32, plan)
    assert stats.per_source.get("successor", [0])[0] > 0  # it drafted
    assert_same_greedy(decoder, PROMPT, plain, spec)


def test_a_sources_options_are_its_own_and_checked_by_it(successor):
    plan = DraftPlan.of(name="s", lookup=["successor"], sources={"successor": {"length": 5}})
    assert options(plan, "successor").length == 5
    assert options(DraftPlan.of(name="d", lookup=["successor"]), "successor").length == 3  # its own default
    assert describe(plan) == "latest successors (5 tokens)"
    with pytest.raises(ArtifactError, match=r"sources.successor.length must be in 1..16") as exc:
        check_plan(plan.with_options(successor={"length": 99}), 4)
    assert "\n" not in str(exc.value)
    with pytest.raises(ArtifactError, match=r"successor.*lenght"):  # an option the source does not have
        check_plan(plan.with_options(successor={"lenght": 2}), 4)
    with pytest.raises(ArtifactError, match=r"sources\['successor'\]\.length"):  # of the option's type
        check_plan(plan.with_options(successor={"length": "two"}), 4)


def test_an_unknown_source_is_refused_in_one_line():
    with pytest.raises(ArtifactError, match="draft source 'teleport' is not known") as exc:
        check_plan(DraftPlan.of(name="x", lookup=["teleport"]), 4)
    assert "\n" not in str(exc.value)
    with pytest.raises(ArtifactError, match="options for draft sources \\['teleport'\\]"):
        check_plan(DraftPlan.of(name="x", lookup=["ngram"], sources={"teleport": {}}), 4)
