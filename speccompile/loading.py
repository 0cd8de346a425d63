"""Find and load the source model: the bundled reference model, a local folder, or a hub id.

Hub ids resolve through the local Hugging Face cache first; with ``HF_HUB_OFFLINE=1`` (or no network)
an id that is not cached is a one-line error that says how to pass a local folder instead.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from speccompile.convert import check_supported
from speccompile.runtime.errors import SpeccompileError

REPO_ROOT = Path(__file__).resolve().parent.parent
BUNDLED_MODELS = {"refcoder": REPO_ROOT / "models" / "refcoder"}
DEFAULT_MODEL = "refcoder"


class ModelNotFoundError(SpeccompileError):
    pass


@dataclass
class SourceModel:
    """A loaded source model with where it came from (recorded in the manifest)."""

    model: object
    tokenizer: object
    name: str
    path: Path
    revision: str | None


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")


def resolve_model_path(name: str | None) -> tuple[Path, str | None]:
    """Local folder for ``name`` (None = the bundled reference model) and its revision if from the hub."""
    name = name or DEFAULT_MODEL
    if name in BUNDLED_MODELS:
        path = BUNDLED_MODELS[name]
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(
                f"the bundled model '{name}' is not at {path}; run from a source checkout (pip install -e .) "
                "or pass a model folder"
            )
        return path, None
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"folder '{name}' has no config.json; pass a folder saved with save_pretrained()")
        return path, None
    if name.startswith((".", "/", "~")) or name.count("/") > 1 or os.sep + os.sep in name:
        raise ModelNotFoundError(f"model folder '{name}' does not exist; check the path")

    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    patterns = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken"]
    try:
        local = snapshot_download(name, local_files_only=True, allow_patterns=patterns)
    except (LocalEntryNotFoundError, OSError, ValueError):
        local = None
    if local is None and not _offline():
        try:
            local = snapshot_download(name, allow_patterns=patterns)
        except Exception as exc:  # network errors come in many types
            raise ModelNotFoundError(
                f"model '{name}' is not in the local Hugging Face cache and could not be downloaded "
                f"({type(exc).__name__}); pass a local folder saved with save_pretrained() instead"
            ) from None
    if local is None:
        raise ModelNotFoundError(
            f"model '{name}' is not in the local Hugging Face cache and HF_HUB_OFFLINE is set; "
            "pass a local folder (speccompile build ./path/to/model) or download it first"
        )
    return Path(local), Path(local).name


def load_source(name: str | None, trust_remote_code: bool = False, dtype: str = "float32") -> SourceModel:
    """Load config, tokenizer and weights; refuse unsupported architectures before loading weights.

    A ``.gguf`` file goes through transformers' GGUF support (``speccompile.gguf_input``)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if name and name.lower().endswith(".gguf"):
        from speccompile.gguf_input import load_gguf

        return load_gguf(Path(name).expanduser(), dtype=dtype)
    path, revision = resolve_model_path(name)
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except ValueError as exc:
        raise SpeccompileError(f"cannot read {path}/config.json ({str(exc).splitlines()[0]}); "
                               "pass --trust-remote-code only if you trust the model's code") from None
    check_supported(config.model_type)
    if not list(path.glob("*.safetensors")):
        raise SpeccompileError(
            f"model at {path} has no safetensors weights (pickle .bin files are refused); "
            "convert it with save_pretrained(..., safe_serialization=True)"
        )
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=getattr(torch, dtype), attn_implementation="eager", use_safetensors=True,
        trust_remote_code=trust_remote_code,
    ).eval()
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as exc:
        raise SpeccompileError(f"cannot load the tokenizer from {path} ({type(exc).__name__}); "
                               "the folder needs tokenizer.json or the files AutoTokenizer reads") from None
    if not getattr(tokenizer, "is_fast", False):
        raise SpeccompileError(f"the tokenizer at {path} has no fast (tokenizer.json) version; the runtime needs one")
    return SourceModel(model=model, tokenizer=tokenizer, name=name or DEFAULT_MODEL, path=path, revision=revision)
