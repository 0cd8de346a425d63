"""Load a GGUF file (llama.cpp's format) as a source model, through transformers' GGUF support.

transformers reads a GGUF file with ``from_pretrained(folder, gguf_file=name)`` and dequantises every
tensor to the requested dtype; the tokenizer is rebuilt from the vocabulary stored in the file.

Why the model is then saved to a cache folder: the rest of the toolkit treats a source model as a
folder. The manifest records ``source.path`` as where the model came from, ``bench`` loads its
transformers and optimum baselines from ``source.path / "config.json"``, and ``tune`` and the reports
read it again later. A GGUF file has no such folder, so the dequantised model (safetensors) and its
tokenizer are written once to ``$XDG_CACHE_HOME/speccompile/gguf/<sha256 prefix>-<dtype>/`` (default
``~/.cache``), atomically (a temp sibling renamed into place), and reused on the next build of the
same file. ``name`` stays the .gguf path and ``revision`` is the file's sha256, so the manifest says
exactly which file was compiled.

transformers 4.57's GGUF tokenizer for Llama-architecture files sets the eos token to the bos token
and always prepends bos; both are repaired here from the file's own metadata
(``tokenizer.ggml.eos_token_id``, ``tokenizer.ggml.add_bos_token``) before the tokenizer is saved.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

from speccompile.convert import check_supported
from speccompile.runtime.errors import SpeccompileError

GGUF_MAGIC = b"GGUF"
INSTALL_HINT = "pip install gguf accelerate (or pip install 'speccompile[build]')"


class GGUFInputError(SpeccompileError):
    """A GGUF file that cannot be read, or a setup that cannot read GGUF files."""


def cache_root() -> Path:
    """Where dequantised GGUF models are kept: ``$XDG_CACHE_HOME/speccompile/gguf`` (default ~/.cache)."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "speccompile" / "gguf"


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def require_gguf_support() -> None:
    """transformers needs the ``gguf`` package to read the file and ``accelerate`` to load from it."""
    for package in ("gguf", "accelerate"):
        try:
            __import__(package)
        except ImportError:
            raise GGUFInputError(
                f"reading a .gguf model needs the '{package}' package, which is not installed; {INSTALL_HINT}"
            ) from None


def check_gguf_file(path: Path) -> None:
    """Refuse a path that is missing, unreadable or not a GGUF file, before any parsing."""
    if not path.exists():
        raise GGUFInputError(f"GGUF file '{path}' does not exist; check the path")
    if not path.is_file():
        raise GGUFInputError(f"'{path}' is not a file; pass the path of a .gguf file")
    try:
        with path.open("rb") as handle:
            magic = handle.read(4)
    except OSError as exc:
        raise GGUFInputError(f"cannot read '{path}' ({exc.strerror}); check its permissions") from None
    if magic != GGUF_MAGIC:
        raise GGUFInputError(
            f"'{path}' is not a GGUF file (it does not start with 'GGUF'); "
            "pass a llama.cpp .gguf file or a folder saved with save_pretrained()"
        )


def read_metadata(path: Path) -> dict:
    """The scalar and string fields of the GGUF header (architecture, special token ids, ...).

    ``GGUFReader`` maps the whole file and indexes every tensor, so a truncated or corrupt file fails
    here, before transformers is asked to load it."""
    from gguf import GGUFReader, GGUFValueType

    try:
        reader = GGUFReader(path)
    except Exception as exc:  # the reader fails with ValueError / IndexError / KeyError on a bad file
        raise GGUFInputError(
            f"'{path}' is truncated or corrupt ({type(exc).__name__}: {str(exc)[:80]}); download or convert it again"
        ) from None
    metadata = {}
    for key, field in reader.fields.items():
        if not field.data or field.types[0] == GGUFValueType.ARRAY:
            continue
        part = field.parts[field.data[0]]
        metadata[key] = (
            bytes(part).decode("utf-8", "replace") if field.types[0] == GGUFValueType.STRING else part.tolist()[0]
        )
    if "general.architecture" not in metadata:
        raise GGUFInputError(f"'{path}' has no general.architecture field; it is not a model GGUF file")
    return metadata


def repair_special_tokens(tokenizer, metadata: dict) -> None:
    """Set bos / eos and whether bos is prepended from the file's metadata (see the module docstring)."""
    vocab_size = len(tokenizer)
    for role in ("bos", "eos"):
        token_id = metadata.get(f"tokenizer.ggml.{role}_token_id")
        if token_id is not None and 0 <= token_id < vocab_size:
            setattr(tokenizer, f"{role}_token", tokenizer.convert_ids_to_tokens(int(token_id)))
    add_bos = metadata.get("tokenizer.ggml.add_bos_token")
    # LlamaTokenizerFast rebuilds its post-processor when this property is set.
    if add_bos is not None and isinstance(getattr(type(tokenizer), "add_bos_token", None), property):
        tokenizer.add_bos_token = bool(add_bos)


def dequantise_to_folder(path: Path, dtype: str, folder: Path) -> None:
    """Load ``path`` with transformers (dequantised to ``dtype``) and save model + tokenizer to ``folder``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    metadata = read_metadata(path)
    architecture = metadata["general.architecture"]
    try:
        config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    except ValueError as exc:
        if "not supported" not in str(exc):
            raise GGUFInputError(f"transformers cannot read the GGUF header of '{path}' ({str(exc)[:100]})") from None
        import transformers

        raise GGUFInputError(
            f"transformers {transformers.__version__} cannot load GGUF architecture "
            f"'{architecture}'; convert the model to a Hugging Face folder and pass that"
        ) from None
    check_supported(config.model_type)  # before the weights are dequantised
    try:
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=getattr(torch, dtype))
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except (ValueError, KeyError, RuntimeError, NotImplementedError) as exc:
        raise GGUFInputError(
            f"transformers could not load '{path}' ({type(exc).__name__}: {str(exc).splitlines()[0][:100]})"
        ) from None
    if not getattr(tokenizer, "is_fast", False):
        raise GGUFInputError(f"transformers built no fast tokenizer from '{path}'; the runtime needs one")
    repair_special_tokens(tokenizer, metadata)

    tmp = folder.with_name(f"{folder.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        try:
            tmp.rename(folder)
        except OSError:
            if not (folder / "config.json").is_file():  # not another process finishing first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def gguf_folder(path: Path, dtype: str = "float32") -> tuple[Path, str]:
    """The ``save_pretrained`` folder of a .gguf file, dequantised once into the cache, and the file's
    sha256 (the source's revision). ``speccompile.loading.load_source`` loads the folder."""
    path = Path(path)
    require_gguf_support()
    check_gguf_file(path)
    sha = file_sha256(path)
    folder = cache_root() / f"{sha[:16]}-{dtype}"
    if not (folder / "config.json").is_file():
        folder.parent.mkdir(parents=True, exist_ok=True)
        dequantise_to_folder(path, dtype, folder)
    return folder, sha
