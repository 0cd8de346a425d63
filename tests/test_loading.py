"""Model resolution: hub ids through the local Hugging Face cache (offline), local folders, the default."""

import shutil

import huggingface_hub.constants
import pytest

from speccompile.loading import BUNDLED_MODELS, DEFAULT_MODEL, ModelNotFoundError, load_source, resolve_model_path


def fake_hub_cache(cache, repo_id, source_folder, revision="0123456789abcdef0123456789abcdef01234567"):
    """Lay out ``source_folder`` as the HF hub cache does: models--org--name/{refs/main, snapshots/<rev>}."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(revision)
    shutil.copytree(source_folder, repo / "snapshots" / revision)
    return revision


def test_cached_hub_id_loads_offline(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    revision = fake_hub_cache(tmp_path, "tiny-org/tiny-llama", tiny_model_dir("llama"))
    path, resolved_revision = resolve_model_path("tiny-org/tiny-llama")
    assert path.name == revision and resolved_revision == revision
    source = load_source("tiny-org/tiny-llama")
    assert source.model.config.model_type == "llama" and source.name == "tiny-org/tiny-llama"


def test_uncached_hub_id_offline_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ModelNotFoundError, match="not in the local Hugging Face cache and HF_HUB_OFFLINE is set"):
        resolve_model_path("tiny-org/not-cached")


def test_folder_without_config_and_pickle_only_weights(tiny_model_dir, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        resolve_model_path(str(empty))
    pickled = tmp_path / "pickled"
    shutil.copytree(tiny_model_dir("llama"), pickled)
    for weights in pickled.glob("*.safetensors"):
        weights.unlink()
    with pytest.raises(Exception, match="no safetensors weights"):
        load_source(str(pickled))


def test_default_model_is_the_bundled_reference_model():
    assert DEFAULT_MODEL in BUNDLED_MODELS
    path, revision = resolve_model_path(None)
    assert path == BUNDLED_MODELS[DEFAULT_MODEL] and revision is None and (path / "config.json").is_file()
