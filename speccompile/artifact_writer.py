"""Write an artifact safely: validated OUT, a lock, a temp sibling folder renamed into place.

- ``--force`` replaces OUT only when OUT is a speccompile artifact (or an empty folder); a user's folder,
  a file, the source model or the working folder are refused before anything is loaded.
- A build or tune holds ``.OUT.lock`` (next to OUT) while it writes; a second one fails at once.
- Everything is written to ``.OUT.tmp-<pid>-<random>`` and renamed into place, so a failure or a kill
  never leaves a half-written artifact; those names let the next build or tune of OUT remove what a
  SIGKILL left behind (``.OUT.tmp-*``, ``.OUT.old-*``).
- Folders are created with the process umask (not 0700), so a service account can read the artifact.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from contextlib import contextmanager
from pathlib import Path

import speccompile
from speccompile.backend_parts import in_write_order, writer
from speccompile.build_memory import peak_resident_bytes
from speccompile.runtime.artifact.manifest import (
    MANIFEST_NAME,
    READABLE_VERSIONS,
    Manifest,
    file_record,
    write_manifest,
)
from speccompile.runtime.drafting import has_model_part
from speccompile.runtime.errors import SpeccompileError
from speccompile.runtime.model import read_artifact

try:
    import fcntl
except ImportError:  # Windows: no advisory locks; builds to the same OUT are not serialised there
    fcntl = None

WEIGHTS_FILE = "weights/model.safetensors"


class OutputError(SpeccompileError):
    """OUT cannot be written, or is something --force must not destroy."""


def resolve_out(out: Path) -> Path:
    """OUT as an absolute path with symlinks resolved (so ``-o .`` and a linked artifact mean the real folder)."""
    return Path(out).expanduser().resolve()


def source_folder(model: str | None) -> Path | None:
    """The local folder (or file) a build reads MODEL from, if MODEL names one; hub ids are not resolved here."""
    from speccompile.loading import BUNDLED_MODELS, DEFAULT_MODEL

    bundled = BUNDLED_MODELS.get(model or DEFAULT_MODEL)
    if bundled is not None:
        return bundled.resolve()
    path = Path(model).expanduser()
    return path.resolve() if path.exists() else None


def artifact_manifest(path: Path) -> dict | None:
    """The parsed manifest if ``path`` is a folder holding a speccompile manifest of a known schema
    (files are not verified: a damaged artifact may still be replaced), else None."""
    try:
        data = json.loads((path / MANIFEST_NAME).read_bytes().decode("utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    if (
        isinstance(data, dict)
        and data.get("schema_version") in READABLE_VERSIONS
        and isinstance(data.get("files"), dict)
    ):
        return data
    return None


def _entries(path: Path) -> list[str]:
    return sorted(p.relative_to(path).as_posix() for p in path.rglob("*") if not p.is_dir() or p.is_symlink())


def _shown(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def check_replaceable(out: Path, real: Path) -> None:
    """Refuse to replace ``real`` unless it is an artifact with no unlisted files, or an empty folder."""
    if not real.is_dir():
        raise OutputError(
            f"'{out}' is a file, not a speccompile artifact; --force only replaces artifacts: "
            "remove it yourself or choose another -o"
        )
    if not any(real.iterdir()):
        return
    manifest = artifact_manifest(real)
    if manifest is None:
        raise OutputError(
            f"'{out}' is not a speccompile artifact (no readable manifest.json; it holds "
            f"{_shown(_entries(real))}); --force only replaces artifacts: choose another -o or remove the "
            "folder yourself"
        )
    extra = [name for name in _entries(real) if name != MANIFEST_NAME and name not in manifest["files"]]
    if extra:
        raise OutputError(
            f"'{out}' is an artifact but also holds files its manifest does not list ({_shown(extra)}); "
            "--force would delete them: move them out or choose another -o"
        )


def check_output(out: Path, force: bool, source: Path | None = None) -> Path:
    """Validate OUT before anything is loaded or tuned; returns it resolved.

    OUT must not be (or contain) the working folder or ``source`` (the model's resolved folder, see
    ``source_folder``), nor lie inside the source; the nearest existing folder above it must be a
    writable folder; an existing OUT needs ``force`` and must be replaceable (``check_replaceable``)."""
    real = resolve_out(out)
    cwd = Path.cwd().resolve()
    if real == cwd or real in cwd.parents:
        raise OutputError(
            f"-o '{out}' is the working folder or contains it; write the artifact to a new folder, "
            "e.g. -o artifacts/NAME"
        )
    if source is not None and (real == source or source in real.parents or real in source.parents):
        raise OutputError(
            f"-o '{out}' is, contains or lies inside the source model at '{source}'; write the artifact somewhere else"
        )
    above = real.parent
    while not above.exists() and above != above.parent:
        above = above.parent
    if not above.is_dir():
        raise OutputError(f"cannot create '{out}': '{above}' is a file, not a folder; choose another -o")
    if not os.access(above, os.W_OK | os.X_OK):
        raise OutputError(
            f"cannot write '{out}': folder '{above}' is not writable by this user; choose another -o "
            "or fix its permissions"
        )
    if real.exists() or real.is_symlink():
        if not force:
            raise OutputError(f"output folder '{out}' already exists; pass --force to replace it or choose another -o")
        check_replaceable(Path(out), real)
    return real


_held_locks: dict[Path, list] = {}  # resolved OUT -> [fd, depth]: re-entrant within a process


@contextmanager
def output_lock(out: Path):
    """Hold ``.OUT.lock`` (an exclusive flock next to OUT) while writing OUT; a second build or tune of
    the same OUT fails at once with a clear message. Parent folders created for it are removed again if
    OUT was not written."""
    real = resolve_out(out)
    if real in _held_locks:
        _held_locks[real][1] += 1
        try:
            yield real
        finally:
            _held_locks[real][1] -= 1
        return
    created = [p for p in [real.parent, *real.parent.parents] if not p.exists()]
    real.parent.mkdir(parents=True, exist_ok=True)
    lock_path = real.with_name(f".{real.name}.lock")
    fd = _acquire(lock_path, real) if fcntl is not None else None
    _held_locks[real] = [fd, 1]
    try:
        yield real
    finally:
        del _held_locks[real]
        if fd is not None:
            lock_path.unlink(missing_ok=True)  # while still holding it; _acquire re-checks the inode
            os.close(fd)
        if not real.exists():
            for folder in created:  # deepest first
                try:
                    folder.rmdir()
                except OSError:
                    break


def _acquire(lock_path: Path, real: Path) -> int:
    while True:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise OutputError(
                f"another speccompile build or tune is writing '{real}' (it holds {lock_path.name}); "
                "wait for it to finish or choose another -o"
            ) from None
        try:
            if os.stat(lock_path).st_ino == os.fstat(fd).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)  # the previous holder removed the file after we opened it: lock the new one


def _sibling(real: Path, kind: str) -> Path:
    return real.with_name(f".{real.name}.{kind}-{os.getpid()}-{secrets.token_hex(4)}")


def remove_stale(real: Path) -> list[Path]:
    """Remove ``.OUT.tmp-*`` / ``.OUT.old-*`` left by a killed build or tune of OUT. Only called with the
    lock held, so no live writer owns them."""
    stale = [p for p in real.parent.iterdir() if p.name.startswith((f".{real.name}.tmp-", f".{real.name}.old-"))]
    for path in stale:
        _remove(path)
    return stale


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


@contextmanager
def atomic_folder(out: Path, replace: bool = False):
    """Yield a temp sibling of ``out`` to fill; on success it is renamed to ``out`` (an existing ``out``
    only if ``replace``, swapped out at the very end), on any error or interrupt it is removed."""
    with output_lock(out) as real:
        remove_stale(real)
        tmp = _sibling(real, "tmp")
        os.mkdir(tmp, 0o777)  # the umask applies, unlike tempfile.mkdtemp's 0700
        try:
            yield tmp
            if real.exists() or real.is_symlink():
                if not replace:
                    raise OutputError(
                        f"'{out}' appeared while this build ran (written by another process); nothing "
                        "was replaced: rerun with --force or choose another -o"
                    )
                check_replaceable(Path(out), real)
                old = _sibling(real, "old")
                real.rename(old)
                tmp.rename(real)
                _remove(old)
            else:
                tmp.rename(real)
        except BaseException:
            _remove(tmp)
            raise


def write_backend_files(root: Path, ir, backends: list[str], onnx_memory: dict | None = None) -> dict:
    """Write each backend's files for ``ir`` under ``root`` with its descriptor's writer, in ``BACKENDS``' order;
    returns the manifest's ``backends`` record. ``onnx_memory``: more of ``export_onnx_weights``' memory options
    (a tuning runner's: the arrays its sessions read); writers of other backends ignore it."""
    records = {}
    for name in in_write_order(backends):
        records[name] = writer(name)(root, ir, records, onnx_memory)
    for relative, source in getattr(ir, "extra_files", {}).items():  # plan resources, e.g. a retrieval datastore
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, root / relative)
    return records


def model_plans(plans: dict) -> dict:
    """The plans with a model subgraph: the only ones that need graphs of their own (lookup-only plans
    verify with the full model)."""
    return {name: plan for name, plan in plans.items() if has_model_part(plan)}


def hash_files(root: Path) -> dict:
    """sha256 and size of every file under ``root`` (the manifest itself excluded)."""
    names = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and p.name != MANIFEST_NAME)
    return {name: file_record(root, name) for name in names}


def write_artifact(
    out: Path, ir, tokenizer, source: dict, tokens: dict, force: bool = False, backends: list[str] = ("torch",)
) -> Path:
    """Write the backends' files, tokenizer and manifest for ``ir`` to ``out`` (atomically)."""
    out = Path(out)
    check_output(out, force)
    with atomic_folder(out, replace=force) as tmp:
        records = write_backend_files(tmp, ir, list(backends))
        ir.tuning.setdefault("memory", {})["peak_resident_bytes"] = peak_resident_bytes()  # the build's, so far
        tokenizer.save_pretrained(tmp / "tokenizer")
        if not (tmp / "tokenizer" / "tokenizer.json").is_file():
            raise SpeccompileError("the tokenizer did not save a tokenizer.json; the runtime needs a fast tokenizer")
        manifest = Manifest(
            config=ir.config,
            plans=ir.plans,
            default_plan=ir.default_plan,
            files=hash_files(tmp),
            backends=records,
            dtype=ir.dtype,
            source=source,
            tokens=tokens,
            tuning=ir.tuning,
            toolkit_version=speccompile.__version__,
        )
        write_manifest(tmp, manifest)
    return out


def read_canonical_weights(root: Path, manifest) -> dict:
    """The canonical weights of an artifact as torch tensors, from its torch or its ONNX files."""
    import numpy as np
    import torch
    from safetensors.torch import load_file

    if "torch" in manifest.backends:
        return load_file(str(root / manifest.backends["torch"]["weights"]))
    record = manifest.backends["onnx"]
    if record.get("quantization"):
        raise SpeccompileError(
            "this artifact's ONNX weights are quantized and it has no torch weights to tune from; "
            "rebuild it from the source model with --backend torch,onnx --quantize"
        )
    from speccompile.exporters.onnx_quant import QUANTIZED_COPY

    data = np.memmap(root / record["weights"], dtype=np.uint8, mode="r")
    weights = {}
    for name, t in record["tensors"].items():
        if QUANTIZED_COPY.search(name):  # a precision draft's quantized copy of a weight, not a canonical weight
            continue
        raw = data[t["offset"] : t["offset"] + t["nbytes"]]
        array = np.frombuffer(raw.tobytes(), dtype=t["dtype"]).reshape(t["shape"])
        weights[name] = torch.from_numpy(array.copy()).float()
    return weights


def check_rewritable(root: Path) -> Path:
    """The real (symlink-resolved) artifact folder ``tune`` will rewrite, refused early if its parent
    folder is not writable (the new artifact is written next to it) or if it holds files its manifest
    does not list (the rewrite would drop them)."""
    real = resolve_out(root)
    if real.is_dir() and not os.access(real.parent, os.W_OK | os.X_OK):
        raise OutputError(
            f"cannot rewrite '{root}': its folder '{real.parent}' is not writable by this user; copy "
            "the artifact somewhere writable and tune the copy"
        )
    if real.is_dir() and artifact_manifest(real) is not None:
        check_replaceable(Path(root), real)  # files the manifest does not list would be lost by the rewrite
    return real


def rewrite_artifact(root: Path, ir, update) -> Path:
    """Apply ``update(manifest)`` and re-write the backends' files for ``ir`` (whose plans may have
    changed: ONNX draft graphs are per plan), atomically. Tokenizer files are hard-linked, not copied."""
    real = check_rewritable(root)  # through a symlink: rewrite the real artifact, the link keeps pointing at it
    manifest = read_artifact(real)
    with atomic_folder(real, replace=True) as tmp:
        shutil.copytree(real / "tokenizer", tmp / "tokenizer", copy_function=os.link)
        update(manifest)
        manifest.backends = write_backend_files(tmp, ir, list(manifest.backends))
        manifest.files = hash_files(tmp)
        write_manifest(tmp, manifest)
    return root


__all__ = [
    "MANIFEST_NAME",
    "WEIGHTS_FILE",
    "OutputError",
    "atomic_folder",
    "check_output",
    "source_folder",
    "check_rewritable",
    "output_lock",
    "read_canonical_weights",
    "remove_stale",
    "rewrite_artifact",
    "write_artifact",
]
