"""Fuzz manifest loading (hypothesis): random JSON documents and random mutations of a real manifest must
either load into a manifest that keeps the runtime's invariants or fail with ArtifactError, never with
another exception (a traceback for the user). Issue 27: the same through ``load`` itself, on real torch
and ONNX artifacts, mutated at every depth (``helpers_reliability.mutations``): only the runtime's own
error type may escape. ``tests/manifest_fuzz.py`` runs 2,000+ of these; CI runs a few hundred."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from helpers_reliability import JSON, load_outcome, mutations, to_text, write_manifest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from speccompile.runtime.artifact.manifest import Manifest, check_relative_path, read_manifest
from speccompile.runtime.errors import ArtifactError


def fuzz(examples: int) -> settings:
    return settings(
        max_examples=examples,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
    )


@pytest.fixture(scope="module")
def real_manifest(tiny_artifact) -> dict:
    return json.loads((tiny_artifact / "manifest.json").read_text())


def parsed(data) -> object:
    """What ``read_manifest`` would hand ``Manifest.from_dict`` for ``data`` written out."""
    return json.loads(to_text(data))


def assert_loads_safely(data) -> None:
    try:
        manifest = Manifest.from_dict(data)
    except ArtifactError:
        return
    assert_invariants(manifest)


def assert_invariants(manifest: Manifest) -> None:
    """What loaded keeps the invariants the runtime relies on."""
    assert manifest.backends and manifest.config.num_layers >= 1
    assert manifest.default_plan is None or manifest.default_plan in manifest.plans
    for relative in manifest.opened_files():
        assert relative in manifest.files
        check_relative_path(relative, "files")


@fuzz(300)
@given(data=JSON)
def test_random_json_is_refused_cleanly(data):
    assert_loads_safely(data)


@fuzz(400)
@given(st.data())
def test_mutated_real_manifest_loads_or_is_refused_cleanly(real_manifest, data):
    assert_loads_safely(parsed(data.draw(mutations(real_manifest))))


@pytest.fixture(scope="module")
def onnx_artifact(tiny_model_dir, tmp_path_factory):
    """A real ONNX artifact: its backend record (graphs, tensor table) is the largest part of its manifest."""
    from speccompile.build import BuildOptions, build

    out = tmp_path_factory.mktemp("fuzz-onnx") / "artifact"
    build(
        BuildOptions(
            model=str(tiny_model_dir("llama")),
            out=out,
            method="cosine",
            max_draft=2,
            calibration_tokens=8,
            confirm_prompts=1,
            confirm_tokens=8,
            backends=("onnx",),
            show_progress=False,
        ),
        log=lambda m: None,
    )
    return out


@pytest.fixture(scope="module")
def onnx_manifest(onnx_artifact) -> dict:
    return json.loads((onnx_artifact / "manifest.json").read_text())


@fuzz(200)
@given(st.data())
def test_mutated_onnx_manifest_loads_or_is_refused_cleanly(onnx_manifest, data):
    """The *mutated* manifest, once loaded, keeps what the ORT backend computes first (offsets and sizes
    that cannot reach before the weights file)."""
    try:
        manifest = Manifest.from_dict(parsed(data.draw(mutations(onnx_manifest))))
    except ArtifactError:
        return
    assert_invariants(manifest)
    for t in manifest.backends.get("onnx", {}).get("tensors", {}).values():
        assert t["offset"] >= 0 and t["nbytes"] >= 0 and t["offset"] + t["nbytes"] >= 0


def copy_of(artifact, tmp_path_factory, name):
    target = tmp_path_factory.mktemp(name) / "artifact"
    shutil.copytree(artifact, target)
    return target


@pytest.fixture(scope="module")
def artifact_folder(tiny_artifact, tmp_path_factory):
    return copy_of(tiny_artifact, tmp_path_factory, "fuzz")


@fuzz(100)
@given(st.data())
def test_read_manifest_from_disk_with_mutations(real_manifest, artifact_folder, data):
    """The same through the file, with hashes checked: bytes that are not JSON, or a manifest whose
    entries no longer match the files, are ArtifactErrors too."""
    text = to_text(data.draw(mutations(real_manifest)))
    raw = text.encode() if data.draw(st.booleans()) else data.draw(st.binary(max_size=64))
    (artifact_folder / "manifest.json").write_bytes(raw)
    try:
        read_manifest(artifact_folder)
    except ArtifactError:
        pass


@pytest.fixture(scope="module")
def standard_linears():
    """The torch backend times its CPU products at load (about a second); a fuzz loads hundreds of times."""
    previous = os.environ.get("SPECCOMPILE_CPU_LINEAR")
    os.environ["SPECCOMPILE_CPU_LINEAR"] = "standard"
    yield
    if previous is None:
        os.environ.pop("SPECCOMPILE_CPU_LINEAR")
    else:
        os.environ["SPECCOMPILE_CPU_LINEAR"] = previous


@pytest.fixture(scope="module")
def load_folders(tiny_artifact, onnx_artifact, tmp_path_factory, standard_linears):
    return {
        "torch": (tiny_artifact, copy_of(tiny_artifact, tmp_path_factory, "fuzz-load")),
        "onnx": (onnx_artifact, copy_of(onnx_artifact, tmp_path_factory, "fuzz-load-onnx")),
    }


@pytest.mark.parametrize("backend, examples", [("torch", 300), ("onnx", 100)])
def test_load_of_a_mutated_artifact_raises_only_the_runtimes_errors(load_folders, backend, examples):
    """Issue 27: ``load`` of a real artifact whose manifest was mutated at any depth (geometry that no longer
    fits the weights, plan references, types, deep values, long strings, lone surrogates) either loads or
    raises the runtime's own error type, and the checks (not the boundary's net) answer the geometry."""
    source, folder = load_folders[backend]
    document = json.loads((source / "manifest.json").read_text())
    outcomes = []

    @fuzz(examples)
    @given(st.data())
    def run(data):
        write_manifest(folder, data.draw(mutations(document)))
        outcomes.append(load_outcome(folder))  # any other exception fails the test, shrunk to its mutation

    run()
    assert outcomes.count("refused") >= examples // 4, outcomes  # the mutations do reach the checks
    assert outcomes.count("net") <= examples // 50, outcomes


@pytest.mark.parametrize(
    "change, words",
    [
        ({"num_kv_heads": 1}, ["num_kv_heads"]),
        ({"hidden_size": 32}, ["hidden_size"]),
        ({"num_layers": 5}, ["num_layers"]),
        ({"head_dim": 8, "rotary_dim": 8}, ["rotary_dim"]),
        ({"intermediate_size": 64}, ["intermediate_size"]),
    ],
    ids=["kv-heads", "hidden", "layers", "head-dim", "mlp"],
)
def test_an_onnx_config_that_does_not_fit_its_weights_is_refused(
    onnx_artifact, tmp_path, standard_linears, change, words
):
    """Issue 27: an ONNX artifact's geometry against its tensor table and graphs' KV inputs, refused by the
    checks (not the boundary's net) before a session runs."""
    folder = tmp_path / "artifact"
    shutil.copytree(onnx_artifact, folder)
    document = json.loads((folder / "manifest.json").read_text())
    document["config"].update(change)
    write_manifest(folder, document)
    from speccompile.runtime import load

    with pytest.raises(ArtifactError) as refused:
        load(folder)
    assert type(refused.value) is ArtifactError and all(word in str(refused.value) for word in words), refused.value
