"""Write an artifact atomically: everything goes to a temp sibling folder that is renamed into place.

A failure at any point leaves no half-written artifact; ``--force`` replaces an existing one only once
the new one is complete.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

from safetensors.torch import save_file

import speccompile
from speccompile.runtime.errors import SpeccompileError
from speccompile.runtime.manifest import MANIFEST_NAME, Manifest, file_record, read_manifest, write_manifest

WEIGHTS_FILE = "weights/model.safetensors"


def check_output(out: Path, force: bool) -> None:
    if out.exists() and not force:
        raise SpeccompileError(f"output folder '{out}' already exists; pass --force to replace it or choose another -o")


@contextmanager
def atomic_folder(out: Path):
    """Yield a temp sibling of ``out`` to fill; on success it replaces ``out`` (an existing one only at the
    very end), on any error it is removed, so no half-written artifact is ever left."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        yield tmp
        if out.exists():
            old = out.with_name(f".{out.name}.old-{tmp.name[-8:]}")
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_artifact(out: Path, ir, tokenizer, source: dict, tokens: dict, force: bool = False) -> Path:
    """Write weights, tokenizer and manifest for ``ir`` to ``out`` (atomically)."""
    import torch

    out = Path(out)
    check_output(out, force)
    with atomic_folder(out) as tmp:
        (tmp / "weights").mkdir()
        dtype = getattr(torch, ir.dtype)
        weights = {k: (v if k == "rope_inv_freq" else v.to(dtype)).contiguous() for k, v in ir.weights.items()}
        save_file(weights, str(tmp / WEIGHTS_FILE), metadata={"format": "pt", "producer": "speccompile"})
        tokenizer.save_pretrained(tmp / "tokenizer")
        if not (tmp / "tokenizer" / "tokenizer.json").is_file():
            raise SpeccompileError("the tokenizer did not save a tokenizer.json; the runtime needs a fast tokenizer")
        files = sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file())
        manifest = Manifest(
            config=ir.config, plans=ir.plans, default_plan=ir.default_plan,
            files={name: file_record(tmp, name) for name in files},
            backends={"torch": {"weights": WEIGHTS_FILE}},
            dtype=ir.dtype, source=source, tokens=tokens, tuning=ir.tuning,
            toolkit_version=speccompile.__version__,
        )
        write_manifest(tmp, manifest)
    return out


def rewrite_manifest(root: Path, update) -> Path:
    """Apply ``update(manifest)`` to an artifact's manifest atomically (weights are hard-linked, not copied)."""
    root = Path(root)
    manifest = read_manifest(root)
    with atomic_folder(root) as tmp:
        shutil.copytree(root, tmp, dirs_exist_ok=True, copy_function=os.link)
        (tmp / MANIFEST_NAME).unlink()
        update(manifest)
        write_manifest(tmp, manifest)
    return root


__all__ = ["MANIFEST_NAME", "WEIGHTS_FILE", "check_output", "rewrite_manifest", "write_artifact"]
