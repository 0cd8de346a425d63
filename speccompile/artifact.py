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


BACKENDS = ("torch", "onnx")


def write_backend_files(root: Path, ir, backends: list[str]) -> dict:
    """Write each backend's files for ``ir`` under ``root``; returns the manifest's ``backends`` record."""
    import torch

    records = {}
    if "torch" in backends:
        (root / "weights").mkdir(exist_ok=True)
        dtype = getattr(torch, ir.dtype)
        weights = {k: (v if k == "rope_inv_freq" else v.to(dtype)).contiguous() for k, v in ir.weights.items()}
        save_file(weights, str(root / WEIGHTS_FILE), metadata={"format": "pt", "producer": "speccompile"})
        records["torch"] = {"weights": WEIGHTS_FILE}
    if "onnx" in backends:
        from speccompile.export_onnx import export_onnx_weights

        onnx_dtype = "float16" if ir.dtype == "float16" else "float32"
        records["onnx"] = export_onnx_weights(ir.config, ir.weights, ir.plans, root / "onnx", onnx_dtype)
    return records


def hash_files(root: Path) -> dict:
    """sha256 and size of every file under ``root`` (the manifest itself excluded)."""
    names = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and p.name != MANIFEST_NAME)
    return {name: file_record(root, name) for name in names}


def write_artifact(out: Path, ir, tokenizer, source: dict, tokens: dict, force: bool = False,
                   backends: list[str] = ("torch",)) -> Path:
    """Write the backends' files, tokenizer and manifest for ``ir`` to ``out`` (atomically)."""
    out = Path(out)
    check_output(out, force)
    with atomic_folder(out) as tmp:
        records = write_backend_files(tmp, ir, list(backends))
        tokenizer.save_pretrained(tmp / "tokenizer")
        if not (tmp / "tokenizer" / "tokenizer.json").is_file():
            raise SpeccompileError("the tokenizer did not save a tokenizer.json; the runtime needs a fast tokenizer")
        manifest = Manifest(
            config=ir.config, plans=ir.plans, default_plan=ir.default_plan, files=hash_files(tmp),
            backends=records, dtype=ir.dtype, source=source, tokens=tokens, tuning=ir.tuning,
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
    data = np.memmap(root / record["weights"], dtype=np.uint8, mode="r")
    weights = {}
    for name, t in record["tensors"].items():
        raw = data[t["offset"] : t["offset"] + t["nbytes"]]
        array = np.frombuffer(raw.tobytes(), dtype=t["dtype"]).reshape(t["shape"])
        weights[name] = torch.from_numpy(array.copy()).float()
    return weights


def rewrite_artifact(root: Path, ir, update) -> Path:
    """Apply ``update(manifest)`` and re-write the backends' files for ``ir`` (whose plans may have
    changed: ONNX draft graphs are per plan), atomically. Tokenizer files are hard-linked, not copied."""
    root = Path(root)
    manifest = read_manifest(root)
    with atomic_folder(root) as tmp:
        shutil.copytree(root / "tokenizer", tmp / "tokenizer", copy_function=os.link)
        update(manifest)
        manifest.backends = write_backend_files(tmp, ir, list(manifest.backends))
        manifest.files = hash_files(tmp)
        write_manifest(tmp, manifest)
    return root


__all__ = ["BACKENDS", "MANIFEST_NAME", "WEIGHTS_FILE", "check_output", "read_canonical_weights", "rewrite_artifact",
           "write_artifact"]
