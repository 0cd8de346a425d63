"""Find and load the source model: the bundled reference model, a local folder, or a hub id.

Hub ids resolve through the local Hugging Face cache first; with ``HF_HUB_OFFLINE=1`` (or no network)
an id that is not cached is a one-line error that says how to pass a local folder instead.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path

from safetensors import SafetensorError, safe_open

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
    if path.is_file():
        raise ModelNotFoundError(
            f"MODEL '{name}' is a file; pass the folder that holds config.json and the "
            "safetensors weights (saved with save_pretrained()), or a .gguf file"
        )
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


def _first_line(exc: BaseException, limit: int = 200) -> str:
    text = str(exc).strip()
    line = text.splitlines()[0] if text else type(exc).__name__
    return line if len(line) <= limit else line[: limit - 3] + "..."


def read_model_type(path: Path) -> str:
    """``model_type`` from ``path/config.json``, with a one-line error for a file that is not a JSON
    object or has no model_type (transformers would raise OSError or a 3 KB ValueError)."""
    file = path / "config.json"
    try:
        config = json.loads(file.read_bytes().decode("utf-8"))
    except OSError as exc:
        raise SpeccompileError(f"cannot read {file} ({exc.strerror}); check its permissions") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        where = f" at line {exc.lineno}" if isinstance(exc, json.JSONDecodeError) else ""
        raise SpeccompileError(f"{file} is not valid JSON{where}; restore it (save_pretrained() writes it)") from None
    if not isinstance(config, dict):
        raise SpeccompileError(f"{file} must hold a JSON object; restore it (save_pretrained() writes it)")
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise SpeccompileError(
            f'{file} has no "model_type"; add it (e.g. "model_type": "llama") or re-save the '
            "model with save_pretrained()"
        )
    return model_type


def check_safetensors(path: Path) -> None:
    """Refuse a model folder without safetensors weights, or with an empty or truncated weights file,
    before transformers reads them (its SafetensorError would surface as a traceback)."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise SpeccompileError(
            f"model at {path} has no safetensors weights (pickle .bin files are refused); "
            "convert it with save_pretrained(..., safe_serialization=True)"
        )
    for file in files:
        try:
            with safe_open(str(file), framework="numpy") as handle:
                handle.keys()
        except (SafetensorError, OSError) as exc:
            raise SpeccompileError(
                f"weights file {file} is empty, truncated or not safetensors ({_first_line(exc)}); "
                "re-save the model with save_pretrained() or download it again"
            ) from None


# Rope scalings whose frequencies depend on the current sequence length: a k-token verify and a 1-token
# step then rotate the same position differently, so speculative output could differ from plain output.
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


def check_drafts_losslessly(config) -> None:
    """Refuse, before the weights are read, configurations that cannot be drafted losslessly."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    if getattr(config, "is_encoder_decoder", False):
        raise SpeccompileError(
            f"'{config.model_type}' is an encoder-decoder model; speccompile drafts decoder-only causal LMs"
        )
    scaling = getattr(text, "rope_scaling", None) or {}
    rope_type = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, dict) else None
    if rope_type in LENGTH_DEPENDENT_ROPE:
        raise SpeccompileError(
            f"rope scaling '{rope_type}' changes the rotary frequencies with the sequence length, so a verify of "
            "several tokens and a one-token step would disagree; set rope_scaling in config.json to a static type "
            "(linear, yarn, llama3) or remove it"
        )


def load_source(name: str | None, trust_remote_code: bool = False, dtype: str = "float32") -> SourceModel:
    """Load config, tokenizer and weights (which decoder path runs the model is decided once it is loaded:
    ``speccompile.convert.choose_path``).

    A ``.gguf`` file goes through transformers' GGUF support (``speccompile.gguf_input``)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if name and name.lower().endswith(".gguf"):
        from speccompile.gguf_input import gguf_folder

        gguf = Path(name).expanduser()
        folder, sha = gguf_folder(gguf, dtype)
        return dataclasses.replace(load_source(str(folder), dtype=dtype), name=str(gguf), revision=sha)
    path, revision = resolve_model_path(name)
    read_model_type(path)  # a one-line error for a broken config.json; the architecture is judged once loaded
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (ValueError, OSError) as exc:
        raise SpeccompileError(
            f"cannot read {path}/config.json ({_first_line(exc)}); "
            "pass --trust-remote-code only if you trust the model's code"
        ) from None
    check_drafts_losslessly(config)
    check_safetensors(path)
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # kernel and init notices of the model classes; speccompile reports what matters
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path,
            dtype=getattr(torch, dtype),
            attn_implementation="eager",
            use_safetensors=True,
            trust_remote_code=trust_remote_code,
        ).eval()
    except (SafetensorError, OSError) as exc:
        raise SpeccompileError(
            f"cannot load the weights in {path} ({_first_line(exc)}); re-save the model with "
            "save_pretrained() or download it again"
        ) from None
    except ValueError as exc:  # transformers has no *ForCausalLM class for this config
        raise SpeccompileError(
            f"'{config.model_type}' has no causal-LM class in transformers ({_first_line(exc, 80)}); "
            "speccompile drafts decoder-only causal LMs"
        ) from None
    finally:
        hf_logging.set_verbosity(verbosity)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as exc:
        raise SpeccompileError(
            f"cannot load the tokenizer from {path} ({type(exc).__name__}); "
            "the folder needs tokenizer.json or the files AutoTokenizer reads"
        ) from None
    if not getattr(tokenizer, "is_fast", False):
        raise SpeccompileError(f"the tokenizer at {path} has no fast (tokenizer.json) version; the runtime needs one")
    return SourceModel(model=model, tokenizer=tokenizer, name=name or DEFAULT_MODEL, path=path, revision=revision)
