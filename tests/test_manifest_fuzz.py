"""Fuzz manifest loading (hypothesis): random JSON documents and random mutations of a real manifest must
either load into a manifest that keeps the runtime's invariants or fail with ArtifactError, never with
another exception (a traceback for the user)."""

from __future__ import annotations

import json
import shutil

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from speccompile.runtime.errors import ArtifactError
from speccompile.runtime.manifest import Manifest, check_relative_path, read_manifest

FUZZ = settings(max_examples=2000, deadline=None, database=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

SCALARS = (st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=True, allow_infinity=True)
           | st.text(max_size=12) | st.sampled_from(["", "..", "/etc/passwd", "../x", "a//b", "./a", "weights/model.safetensors",
                                                    "tokenizer/tokenizer.json", "torch", "onnx", "float16", "0" * 64]))
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                    max_leaves=12)


@pytest.fixture(scope="module")
def real_manifest(tiny_artifact) -> dict:
    return json.loads((tiny_artifact / "manifest.json").read_text())


def walk(draw, document):
    """A random (path, value) in a JSON document, found by descending from the root (cheap on a large
    manifest, and every depth is reachable)."""
    path, node = (), document
    while isinstance(node, (dict, list)) and node and draw(st.integers(0, 3)) > 0:
        key = draw(st.sampled_from(sorted(node) if isinstance(node, dict) else range(len(node))))
        path, node = path + (key,), node[key]
    return path, node


@st.composite
def mutated(draw, document):
    """``document`` with 1-3 random edits: a value replaced, a key removed, or a key added."""
    data = json.loads(json.dumps(document))
    for _ in range(draw(st.integers(1, 3))):
        path, value = walk(draw, data)
        action = draw(st.sampled_from(["replace", "remove", "add"]))
        if not path:
            if action == "replace":
                data = draw(JSON)
            continue
        parent = data
        for key in path[:-1]:
            parent = parent[key]
        if action == "replace":
            parent[path[-1]] = draw(JSON)
        elif action == "remove" and isinstance(parent, dict):
            del parent[path[-1]]
        elif action == "add" and isinstance(value, dict):
            value[draw(st.text(max_size=10) | st.sampled_from(["file", "weights", "datastore", "x_file"]))] = draw(JSON)
    return data


def assert_loads_safely(data) -> None:
    try:
        manifest = Manifest.from_dict(data)
    except ArtifactError:
        return
    # What loaded keeps the invariants the runtime relies on.
    assert manifest.backends and manifest.config.num_layers >= 1
    assert manifest.default_plan is None or manifest.default_plan in manifest.plans
    for relative in manifest.opened_files():
        assert relative in manifest.files
        check_relative_path(relative, "files")


@settings(FUZZ, max_examples=1000)
@given(data=JSON)
def test_random_json_is_refused_cleanly(data):
    assert_loads_safely(data)


@FUZZ
@given(st.data())
def test_mutated_real_manifest_loads_or_is_refused_cleanly(real_manifest, data):
    assert_loads_safely(data.draw(mutated(real_manifest)))


@pytest.fixture(scope="module")
def onnx_manifest(tiny_model_dir, tmp_path_factory) -> dict:
    """A real ONNX artifact's manifest: its backend record (graphs, tensor table) is the largest part."""
    from speccompile.build import BuildOptions, build

    out = tmp_path_factory.mktemp("fuzz-onnx") / "artifact"
    build(BuildOptions(model=str(tiny_model_dir("llama")), out=out, method="cosine", max_draft=2, calibration_tokens=8,
                       confirm_prompts=1, confirm_tokens=8, backends=("onnx",), show_progress=False), log=lambda m: None)
    return json.loads((out / "manifest.json").read_text())


@settings(max_examples=500, deadline=None, database=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.data())
def test_mutated_onnx_manifest_loads_or_is_refused_cleanly(onnx_manifest, data):
    assert_loads_safely(data.draw(mutated(onnx_manifest)))
    if "onnx" in onnx_manifest["backends"]:
        for t in onnx_manifest["backends"]["onnx"]["tensors"].values():
            assert t["offset"] + t["nbytes"] >= 0  # what the ORT backend computes first


@pytest.fixture(scope="module")
def artifact_folder(tiny_artifact, tmp_path_factory):
    target = tmp_path_factory.mktemp("fuzz") / "artifact"
    shutil.copytree(tiny_artifact, target)
    return target


@settings(max_examples=200, deadline=None, database=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.data())
def test_read_manifest_from_disk_with_mutations(real_manifest, artifact_folder, data):
    """The same through the file, with hashes checked: bytes that are not JSON, or a manifest whose
    entries no longer match the files, are ArtifactErrors too."""
    text = json.dumps(data.draw(mutated(real_manifest)), allow_nan=True)
    raw = text.encode() if data.draw(st.booleans()) else data.draw(st.binary(max_size=64))
    (artifact_folder / "manifest.json").write_bytes(raw)
    try:
        read_manifest(artifact_folder)
    except ArtifactError:
        pass
