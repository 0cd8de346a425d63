"""Manifests of older schemas still load: version 1 (every source's options flat on the plan) and version 2 (the
model part in first-class fields, its kind optional). The one conversion (``runtime/artifact/legacy.py``) puts each
old field where version 3 keeps it, and a converted artifact decodes exactly as it did."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from speccompile.runtime import load
from speccompile.runtime.artifact.draft_head_file import DraftHead
from speccompile.runtime.artifact.legacy import LEGACY_FIELDS, MODEL_FIELDS, upgrade_plan
from speccompile.runtime.artifact.manifest import (
    SCHEMA_VERSION,
    DraftPlan,
    Manifest,
    file_record,
    read_manifest,
)
from speccompile.runtime.drafting import check_plan, describe, options
from speccompile.runtime.drafting.kinds import kind_of
from speccompile.runtime.errors import ArtifactError

DATA = Path(__file__).parent / "data"
V1_PLANS = json.loads((DATA / "v1_plans.json").read_text())["plans"]
V2 = json.loads((DATA / "v2_plans.json").read_text())
PROMPT = "def read_lines(path):"
VOCAB_HEAD = "draft_heads/vocab.safetensors"


def test_real_version_1_plans_convert_field_by_field():
    onnx = upgrade_plan(V1_PLANS["smollm2-onnx-precision"])
    assert not set(LEGACY_FIELDS) & set(onnx)
    assert onnx["sources"] == {
        "ngram": {"min": 3, "max": 5, "short": 1},
        "retrieval": {"datastore": "retrieval/datastore.safetensors"},
        "model": {"max_draft": 8, "threshold": 0.0, "adaptive": False, "target_acceptance": 0.8596, "branches": 1},
    }  # a precision draft behind n-gram and retrieval lookups: no lookahead or LogitSpec options, which it never used
    torch = upgrade_plan(V1_PLANS["smollm2-torch-lookup"])
    assert torch["sources"] == {"ngram": {"min": 1, "max": 5, "short": 2}}  # lookup only: no model options
    assert (onnx["kind"], onnx["params"]) == ("precision", {"precision": "int8"})  # named, every block
    assert (torch["kind"], torch["params"]) == ("lookup", {})  # inferred: no exit layer, no skipped sublayer
    for old, new in ((V1_PLANS["smollm2-onnx-precision"], onnx), (V1_PLANS["smollm2-torch-lookup"], torch)):
        assert not set(MODEL_FIELDS) & set(new)
        for key in ("name", "lookup", "lookup_max_draft", "lookup_branches", "extend"):
            assert new[key] == old[key]
        plan = DraftPlan.from_dict(old)
        check_plan(plan, 30)
        assert plan == DraftPlan.from_dict(new)
        assert upgrade_plan(new) is new  # a version-3 plan is left as it is


def test_every_legacy_field_lands_with_its_source():
    old = {
        "name": "all",
        "exit_layer": 2,
        "lookup": ["ngram", "lookahead", "logitspec", "retrieval", "recycling"],
        "ngram_min": 1,
        "ngram_max": 3,
        "short_ngram": 1,
        "lookahead_window": 6,
        "lookahead_ngram": 3,
        "logitspec_top_k": 5,
        "datastore": "retrieval/d.safetensors",
        "max_draft": 5,
        "threshold": 0.25,
        "adaptive": False,
        "target_acceptance": 0.7,
        "draft_branches": 1,
    }
    plan = DraftPlan.from_dict(old)
    check_plan(plan, 4)
    assert (options(plan, "ngram").min, options(plan, "ngram").max, options(plan, "ngram").short) == (1, 3, 1)
    assert (options(plan, "lookahead").window, options(plan, "lookahead").ngram) == (6, 3)
    assert options(plan, "logitspec").top_k == 5 and options(plan, "retrieval").datastore == "retrieval/d.safetensors"
    model = options(plan, "model")
    assert (model.max_draft, model.threshold, model.adaptive, model.target_acceptance) == (5, 0.25, False, 0.7)
    # a field a version-1 plan omitted means its version-1 default, whatever today's default is
    assert DraftPlan.from_dict({"name": "d", "lookup": ["ngram"], "ngram_max": 6}).sources == {
        "ngram": {"min": 2, "max": 6, "short": 0}
    }


V2_CONVERTED = {
    "adapter": (
        "early_exit",
        {"exit_layer": 2, "head": "adapter:2", "draft_vocab": 64, "draft_head_file": "draft_heads/adapter.safetensors"},
    ),
    "early-exit": ("early_exit", {"exit_layer": 1, "head": "exit:1"}),
    "layer-skip": ("layer_skip", {"skip_attn": [1, 2], "skip_mlp": [2]}),
    "skip-vocab": (
        "layer_skip",
        {"skip_mlp": [1], "draft_vocab": 64, "draft_head_file": "draft_heads/skip-vocab.safetensors"},
    ),
    "precision-exit": ("precision", {"precision": "int8", "block_size": 64, "symmetric": True, "exit_layer": 2}),
    "hybrid": ("layer_skip", {"skip_attn": [0]}),
    "lookup": ("lookup", {}),
}
"""What each of ``data/v2_plans.json``'s plans converts to: its kind, named, and its options in ``params``."""


@pytest.mark.parametrize("name", sorted(V2_CONVERTED))
def test_real_version_2_plans_convert_to_one_shape_and_draft_as_before(name):
    old = V2["plans"][name]
    new = upgrade_plan(old)
    assert (new["kind"], new["params"]) == V2_CONVERTED[name]
    assert not set(MODEL_FIELDS) & set(new)
    assert {k: v for k, v in new.items() if k not in ("kind", "params")} == {
        k: v for k, v in old.items() if k not in (*MODEL_FIELDS, "kind", "params")
    }  # the plan's other fields as written
    assert upgrade_plan(new) is new
    plan = DraftPlan.from_dict(old)
    check_plan(plan, 4)
    assert plan == DraftPlan.from_dict(new) == DraftPlan.of(**{k: v for k, v in old.items() if v is not None})
    # what the version-2 runtime said of the plan, and the subgraphs it drafted and verified with
    assert describe(plan) == V2["described"][name]
    assert [repr(s) for s in kind_of(plan, 4).segments()] == V2["segments_at_4_blocks"][name]
    for key in MODEL_FIELDS:  # the old fields still read, as properties
        assert getattr(plan, key) == old[key]


def test_a_version_3_plan_names_its_kind_and_its_options_are_checked():
    plan = DraftPlan.of(name="p", kind="precision", params={"precision": "int8"}, exit_layer=2, head="final")
    assert (plan.kind, plan.params) == ("precision", {"precision": "int8", "exit_layer": 2})  # "final": the default
    assert plan.with_params(exit_layer=None, skip_mlp=[1]).params == {"precision": "int8", "skip_mlp": [1]}
    with pytest.raises(ArtifactError, match=r"plan 'x': params \['skip_atn'\] are not options of the layer_skip"):
        check_plan(DraftPlan(name="x", kind="layer_skip", params={"skip_attn": [1], "skip_atn": [2]}), 4)
    with pytest.raises(ArtifactError, match="an early exit with no params.exit_layer"):
        check_plan(DraftPlan(name="x", kind="early_exit", params={}), 4)
    with pytest.raises(ArtifactError, match=r"plans\['x'\].params\['exit_layer'\] must be an integer or null"):
        DraftPlan.from_dict({"name": "x", "kind": "early_exit", "params": {"exit_layer": "2"}}, "plans['x']")


def as_version_2(manifest: dict) -> dict:
    """``manifest`` (version 3) as the version-2 toolkit wrote it: every model field first-class, written whether
    set or not, and ``kind`` null for the kinds it inferred."""
    old = {**manifest, "schema_version": 2, "plans": {}}
    for name, plan in manifest["plans"].items():
        params = dict(plan["params"])
        fields = {key: params.pop(key, absent) for key, absent in MODEL_FIELDS.items()}
        kind = plan["kind"] if plan["kind"] == "precision" else None
        rest = {key: value for key, value in plan.items() if key not in ("kind", "params")}
        old["plans"][name] = {"name": plan["name"], **fields, "kind": kind, "params": params, **rest}
    return old


def as_version_1(manifest: dict) -> dict:
    """``manifest`` (version 3) as the version-1 toolkit wrote it: as version 2, with every source's options flat
    on the plan."""
    old = {**as_version_2(manifest), "schema_version": 1, "plans": {}}
    for name, plan in as_version_2(manifest)["plans"].items():
        flat = {key: value for key, value in plan.items() if key != "sources"}
        for field, (source, option, default) in LEGACY_FIELDS.items():
            flat[field] = plan["sources"].get(source, {}).get(option, default)
        old["plans"][name] = flat
    return old


def with_plans(root: Path, plans: dict[str, DraftPlan], vocab: int) -> Path:
    """The artifact at ``root`` with ``plans`` added and the vocabulary head they name, listed and hashed."""
    DraftHead(vocab=np.arange(vocab)).save(root / VOCAB_HEAD)
    manifest = json.loads((root / "manifest.json").read_text())
    manifest["plans"].update({name: dataclasses.asdict(plan) for name, plan in plans.items()})
    manifest["files"][VOCAB_HEAD] = file_record(root, VOCAB_HEAD)
    (root / "manifest.json").write_text(json.dumps(manifest))
    return root


def model_plans(vocab: int, precision: bool) -> dict[str, DraftPlan]:
    """A plan of each kind, an early exit and a layer skip with a draft head, a precision draft with an exit."""
    model = {"model": {"max_draft": 3, "adaptive": False}}
    plans = [
        DraftPlan.of(name="exit-vocab", exit_layer=1, draft_vocab=vocab, draft_head_file=VOCAB_HEAD, sources=model),
        DraftPlan.of(name="skip", skip_attn=[1], skip_mlp=[0], sources=model),
        DraftPlan.of(
            name="hybrid",
            exit_layer=1,
            lookup=["ngram"],
            sources={"ngram": {"min": 1, "max": 3}, "model": {"max_draft": 3}},
        ),
        DraftPlan.of(name="lookup", lookup=["ngram"], sources={"ngram": {"min": 1, "max": 3}}),
    ]
    if precision:  # an int8 draft runs on torch (its int8 twin); the standard ONNX graphs have none
        plans.append(DraftPlan.of(name="int8-exit", kind="precision", params={"precision": "int8"}, exit_layer=1))
    return {plan.name: plan for plan in plans}


def schema_3_artifact(backend: str, tiny_artifact: Path, tiny_decoder, root: Path) -> Path:
    """An artifact written by this toolkit (version 3) with ``model_plans``: the built tiny artifact for torch, an
    ONNX export of the tiny Llama for onnx."""
    if backend == "torch":
        shutil.copytree(tiny_artifact, root)
        vocab = min(48, read_manifest(root).config.vocab_size)
        return with_plans(root, model_plans(vocab, precision=True), vocab)
    from onnx_helpers import make_artifact

    _, decoder = tiny_decoder("llama")
    vocab = min(48, decoder.config.vocab_size)
    DraftHead(vocab=np.arange(vocab)).save(root / VOCAB_HEAD)
    plans = model_plans(vocab, precision=False)
    return make_artifact(decoder, plans, root, draft_heads={VOCAB_HEAD: root / VOCAB_HEAD})


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("backend", ["torch", "onnx"])
def test_an_artifact_with_an_older_manifest_loads_and_decodes_identically(
    tiny_artifact, tiny_decoder, tmp_path, backend, version
):
    if backend == "onnx":
        pytest.importorskip("onnxruntime")
    root = schema_3_artifact(backend, tiny_artifact, tiny_decoder, tmp_path / "v3")
    manifest = json.loads((root / "manifest.json").read_text())
    assert manifest["schema_version"] == SCHEMA_VERSION == 3
    assert all(plan["kind"] and not set(MODEL_FIELDS) & set(plan) for plan in manifest["plans"].values())
    old = tmp_path / f"v{version}"
    shutil.copytree(root, old)
    (old / "manifest.json").write_text(json.dumps((as_version_1 if version == 1 else as_version_2)(manifest)))

    converted, plans = read_manifest(old), read_manifest(root).plans
    assert converted.schema_version == SCHEMA_VERSION
    for name, plan in plans.items():
        assert (converted.plans[name].kind, converted.plans[name].params) == (plan.kind, plan.params)
        used = [*plan.lookup, "model"]  # version 1 spells out every option of the sources a plan uses
        assert {s: options(converted.plans[name], s) for s in used} == {s: options(plan, s) for s in used}
    if version == 2:
        assert converted.plans == plans
    new_model, old_model = load(root, backend=backend), load(old, backend=backend)
    assert {"exit-vocab", "skip", "hybrid", "lookup"} <= set(new_model.manifest.plans)
    for name in new_model.manifest.plans:
        assert describe(old_model.manifest.plans[name]) == describe(new_model.manifest.plans[name])
        new = new_model.generate(PROMPT, max_new_tokens=24, plan=name)
        again = old_model.generate(PROMPT, max_new_tokens=24, plan=name)
        assert new.stats.drafted > 0
        assert (
            again.token_ids == new.token_ids and again.stats.as_dict()["round_mix"] == new.stats.as_dict()["round_mix"]
        )


def test_a_newer_schema_is_refused_in_one_line(tiny_artifact):
    manifest = json.loads((tiny_artifact / "manifest.json").read_text())
    with pytest.raises(Exception, match="schema version 4 is not supported by this runtime") as exc:
        Manifest.from_dict({**manifest, "schema_version": 4})
    assert "\n" not in str(exc.value)
