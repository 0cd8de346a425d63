"""Model-draft trees (``sources.model.branches``, ``runtime/drafters.ModelDrafter``): beside each token a model
draft chooses, its runner-ups become leaves of a token tree that the full model verifies in one call.

- greedy speculative == plain on every canonical family, on torch (an int8 precision draft, a layer skip, the
  int8 draft behind n-gram lookup, extended by it) and on ONNX Runtime's fused graphs (int8 and int4
  precision drafts, a layer skip, the hybrid), with leaves drafted, verified as trees and accepted;
- sampling drafts chains (the leaves' q would be one-hot beside a q-sampled chain), so the rejection rule
  is the chain's and the distribution stays the model's;
- the replay (what the tuner estimates) follows the same tree: a leaf equal to the continuation is accepted
  and costs no draft step;
- a plan that cannot branch (no model draft; an early exit, whose verify reuses its draft's prefix) is
  refused in one line.

The leaves' probability floor (``BRANCH_MIN_PROBABILITY``) is lifted to zero here: a tiny random model's draft
spreads its probability too thin for any runner-up to pass it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from speccompile.runtime.drafting import check_plan

pytest.importorskip("onnxruntime")

from lossless import assert_speculative_is_plain, run  # noqa: E402
from onnx_helpers import make_artifact, ort_backend  # noqa: E402
from tiny_models import FAMILIES  # noqa: E402

from speccompile.runtime.artifact.manifest import DraftPlan  # noqa: E402
from speccompile.runtime.backends.torch.backend import TorchBackend  # noqa: E402
from speccompile.runtime.drafting import model_draft as drafters  # noqa: E402
from speccompile.runtime.drafting import read_plans  # noqa: E402
from speccompile.runtime.errors import ArtifactError  # noqa: E402
from speccompile.runtime.sampling import SamplingParams  # noqa: E402

INT8 = {"precision": "int8"}


@pytest.fixture(autouse=True)
def every_runner_up(monkeypatch):
    monkeypatch.setattr(drafters, "BRANCH_MIN_PROBABILITY", 0.0)


def prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(3, vocab, (5 + 8 * i,), generator=gen).tolist() for i in range(3)]


def tree_plans(backend: str) -> dict[str, DraftPlan]:
    plans = [
        DraftPlan.of(
            name="int8-tree",
            kind="precision",
            params=INT8,
            sources={"model": {"max_draft": 4, "threshold": 0.0, "branches": 3}},
        ),
        DraftPlan.of(
            name="skip-tree",
            skip_mlp=[1],
            skip_attn=[1],
            sources={"model": {"max_draft": 3, "threshold": 0.0, "branches": 2}},
        ),
        DraftPlan.of(
            name="int8-tree+lookup",
            kind="precision",
            params=INT8,
            lookup=["ngram"],
            lookup_max_draft=3,
            sources={"model": {"max_draft": 3, "branches": 2}, "ngram": {"min": 1, "max": 3}},
        ),
    ]
    if backend == "onnx":
        plans.append(
            DraftPlan.of(
                name="int4-tree",
                kind="precision",
                params={"precision": "int4"},
                sources={"model": {"max_draft": 3, "threshold": 0.0, "branches": 2}},
            )
        )
    return {p.name: p for p in plans}


def assert_trees_were_verified(backend, decoder, plan: DraftPlan) -> None:
    _, stats = run(backend, prompts(decoder.config.vocab_size)[0], 24, plan)
    branch = stats.per_source.get("branch", [0, 0])
    assert stats.tree_rounds > 0 and branch[0] > 0, (stats.tree_rounds, stats.per_source)


@pytest.mark.parametrize("family", FAMILIES)
def test_model_draft_trees_are_lossless_on_torch(tiny_decoder, family):
    _, decoder = tiny_decoder(family)
    backend = TorchBackend(decoder)
    plans = tree_plans("torch")
    backend.check_plans(read_plans(plans, backend.config.num_layers))
    assert_speculative_is_plain(backend, decoder, prompts(decoder.config.vocab_size), plans, 24)
    assert_trees_were_verified(backend, decoder, plans["skip-tree"])


@pytest.mark.parametrize("family", FAMILIES)
def test_model_draft_trees_are_lossless_on_onnx_runtime(tiny_decoder, tmp_path, family):
    _, decoder = tiny_decoder(family)
    plans = tree_plans("onnx")
    backend = ort_backend(make_artifact(decoder, plans, tmp_path / family, variant="fused"))
    backend.check_plans(read_plans(plans, backend.config.num_layers))
    assert_speculative_is_plain(backend, decoder, prompts(decoder.config.vocab_size), plans, 24)
    # ONNX Runtime verifies a tree while its last slot is inside a sliding window (``tree_fits``); past it, the
    # tree's first branch: a windowed tiny model's window is too short for these trees (test_tree.py covers it)
    if not any(map(decoder.config.window_of, range(decoder.config.num_layers))):
        assert_trees_were_verified(backend, decoder, plans["int8-tree"])


def test_a_leaf_is_accepted_where_the_chain_stops(tiny_decoder):
    """Over many rounds some leaf is the model's token, and such a round commits it: a tree plan keeps more
    tokens per round than the same plan as a chain (the leaves are the draft's runner-ups, so on a real model
    this is the point; here it only has to happen)."""
    _, decoder = tiny_decoder("llama")
    backend = TorchBackend(decoder)
    plan = tree_plans("torch")["skip-tree"]
    total = {"branch": [0, 0]}
    for prompt in prompts(decoder.config.vocab_size):
        _, stats = run(backend, prompt, 32, plan)
        total["branch"] = [a + b for a, b in zip(total["branch"], stats.per_source.get("branch", [0, 0]))]
    assert total["branch"][1] > 0, total


def test_sampling_drafts_chains(tiny_decoder):
    _, decoder = tiny_decoder("llama")
    backend = TorchBackend(decoder)
    plan = tree_plans("torch")["int8-tree"]
    _, stats = run(backend, prompts(decoder.config.vocab_size)[1], 16, plan, SamplingParams(temperature=0.8), seed=3)
    assert stats.rounds > 0 and stats.tree_rounds == 0 and "branch" not in stats.per_source


def test_the_replay_follows_a_model_tree():
    """The tuner's replay: the profile's runner-up at a position where its top choice is wrong is a leaf, which
    the continuation accepts; it is priced as a verify row, not a draft step."""
    from speccompile.passes.acceptance_estimate import Profile, Reference
    from speccompile.passes.replay import replay

    prompt, target = [1, 2, 3], list(range(7, 19))
    targets = np.array(target[1:])  # what each continuation position predicts (``Reference.targets``)
    tops = targets.copy()
    tops[1] = 5  # the draft is wrong about the token after 8; its runner-up there is 9, the right one
    runners = np.full((len(tops), 2), 4)
    runners[1, 0] = 9
    probs = np.full((len(tops), 2), 0.2, np.float32)
    profile = Profile(
        matches=[tops == targets],
        confidences=[np.full(len(tops), 0.9, np.float32)],
        tops=[tops],
        runner_ups=[runners],
        runner_up_probs=[probs],
    )
    ref = Reference(torch.tensor([prompt + target]), len(prompt), None)
    plan = DraftPlan.of(
        name="t", skip_mlp=[0], sources={"model": {"max_draft": 3, "threshold": 0.0, "adaptive": False}}
    )
    chain = replay(plan, [ref], profile)
    tree = replay(plan.with_options(model={"branches": 2}), [ref], profile)
    assert chain[0].accepted == 1 and tree[0].accepted == 2  # 8 by the chain; 9 by a leaf below it
    assert tree[0].model_tokens == chain[0].model_tokens and tree[0].drafted > chain[0].drafted


def test_plans_that_cannot_branch_are_refused():
    with pytest.raises(ArtifactError, match="sources.model.branches") as exc:
        check_plan(DraftPlan.of(name="x", lookup=["ngram"], sources={"model": {"branches": 2}}), 4)
    assert "\n" not in str(exc.value)
    with pytest.raises(ArtifactError, match="early exit"):
        check_plan(DraftPlan.of(name="y", exit_layer=2, sources={"model": {"branches": 2}}), 4)


def test_a_lookup_extends_a_model_tree_below_its_chain():
    from speccompile.runtime.drafting.drafter import Draft
    from speccompile.runtime.tree import depths

    tree = Draft(
        tokens=[10, 11, 20, 21], q=[None] * 4, sources=["model", "model", "branch", "branch"], parents=[-1, 0, -1, 0]
    )  # chain 10 -> 11; leaves 20 (beside 10) and 21 (beside 11)
    extended = tree.extend(Draft(tokens=[12, 13], q=[None, None], sources=["ngram", "ngram"]))
    assert extended.tokens == [10, 11, 12, 13, 20, 21] and extended.parents == [-1, 0, 1, 2, -1, 0]
    assert depths(extended.parents) == [1, 2, 3, 4, 1, 2]
    assert extended.first_branch().tokens == [10, 11, 12, 13]
