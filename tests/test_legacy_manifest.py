"""Manifests written before draft sources kept their own options (schema version 1) still load: the one
conversion (``runtime/artifact/legacy.py``) puts each flat field under its source, and the converted artifact
decodes exactly as it did."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from speccompile.runtime import load
from speccompile.runtime.artifact.legacy import LEGACY_FIELDS, upgrade_plan
from speccompile.runtime.artifact.manifest import SCHEMA_VERSION, DraftPlan, Manifest, read_manifest
from speccompile.runtime.drafting import check_plan, describe, options

V1_PLANS = json.loads((Path(__file__).parent / "data" / "v1_plans.json").read_text())["plans"]
PROMPT = "def read_lines(path):"


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
    for old, new in ((V1_PLANS["smollm2-onnx-precision"], onnx), (V1_PLANS["smollm2-torch-lookup"], torch)):
        for key in ("name", "kind", "params", "lookup", "lookup_max_draft", "lookup_branches", "extend"):
            assert new[key] == old[key]
        plan = DraftPlan.from_dict(old)
        check_plan(plan, 30)
        assert plan == DraftPlan.from_dict(new)
        assert upgrade_plan(new) is new  # a version-2 plan is left as it is


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


def as_version_1(manifest: dict) -> dict:
    """``manifest`` (version 2) as the previous toolkit wrote it: every source's options flat on the plan."""
    old = {**manifest, "schema_version": 1, "plans": {}}
    for name, plan in manifest["plans"].items():
        flat = {key: value for key, value in plan.items() if key != "sources"}
        for field, (source, option, default) in LEGACY_FIELDS.items():
            flat[field] = plan["sources"].get(source, {}).get(option, default)
        old["plans"][name] = flat
    return old


@pytest.mark.parametrize("backend", ["torch", "onnx"])
def test_an_artifact_with_a_version_1_manifest_loads_and_decodes_identically(
    tiny_artifact, tiny_decoder, tmp_path, backend
):
    if backend == "onnx":
        pytest.importorskip("onnxruntime")
        from onnx_helpers import make_artifact

        _, decoder = tiny_decoder("llama")
        plans = {
            "hybrid": DraftPlan(
                name="hybrid",
                exit_layer=1,
                lookup=["ngram"],
                sources={"ngram": {"min": 1, "max": 3}, "model": {"max_draft": 3}},
            )
        }
        root = make_artifact(decoder, plans, tmp_path / "v2")
    else:
        root = tiny_artifact
    manifest = json.loads((root / "manifest.json").read_text())
    assert manifest["schema_version"] == SCHEMA_VERSION
    old = tmp_path / "v1"
    old.mkdir(exist_ok=True)
    for path in root.rglob("*"):
        if path.is_file() and path.name != "manifest.json":
            (old / path.relative_to(root)).parent.mkdir(parents=True, exist_ok=True)
            (old / path.relative_to(root)).write_bytes(path.read_bytes())
    (old / "manifest.json").write_text(json.dumps(as_version_1(manifest)))

    converted = read_manifest(old)
    assert converted.schema_version == SCHEMA_VERSION
    for name, plan in read_manifest(root).plans.items():  # the same options, spelled out by the version-1 form
        used = [*plan.lookup, "model"]
        assert {s: options(converted.plans[name], s) for s in used} == {s: options(plan, s) for s in used}
    new_model, old_model = load(root, backend=backend), load(old, backend=backend)
    for name in new_model.manifest.plans:
        assert describe(old_model.manifest.plans[name]) == describe(new_model.manifest.plans[name])
        new = new_model.generate(PROMPT, max_new_tokens=24, plan=name)
        again = old_model.generate(PROMPT, max_new_tokens=24, plan=name)
        assert (
            again.token_ids == new.token_ids and again.stats.as_dict()["round_mix"] == new.stats.as_dict()["round_mix"]
        )


def test_a_newer_schema_is_refused_in_one_line(tiny_artifact, tmp_path):
    manifest = json.loads((tiny_artifact / "manifest.json").read_text())
    with pytest.raises(Exception, match="schema version 3 is not supported by this runtime") as exc:
        Manifest.from_dict({**manifest, "schema_version": 3})
    assert "\n" not in str(exc.value)
