"""The ``OrtValue`` every ONNX Runtime session of a backend shares, one per unique tensor of the export's table.

Sessions receive them through ``SessionOptions.add_initializer`` (``runtime/backends/onnx.py``), so however many
sessions a backend opens the weights are in memory once. They come from ``weights.bin`` (an artifact: read once,
or memory-mapped) or from arrays a caller already holds (a build's tuning runner: the canonical weights the torch
decoder holds, as numpy views, and the quantized copies it made once). ONNX Runtime still reads from the file
the weights it folds at session creation (the fused graphs' packed q/k/v and gate/up projections are a Concat
of initializers: constant folding reads its inputs from the external data, not from the initializers given).

This module must not import torch or transformers.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ArtifactError

NUMPY_DTYPES = {"float32": np.float32, "float16": np.float16, "int64": np.int64, "uint8": np.uint8}


def read_weights(root: Path, record: dict, tensors: dict[str, dict], relative: str, mmap: bool = False) -> np.ndarray:
    """The bytes of the export's ``weights.bin`` the tensor table needs, read into private memory or (``mmap``)
    mapped read-only (pages shared with the page cache and other processes); a missing or truncated file is a
    one-line error."""
    path = root / relative
    if not path.is_file():
        raise ArtifactError(
            f"ONNX weights file {relative!r} is missing from {str(root)!r}; restore it or rebuild the "
            "artifact with --backend onnx"
        )
    need = max([int(record.get("weights_bytes", 0))] + [t["offset"] + t["nbytes"] for t in tensors.values()])
    size = path.stat().st_size
    if size < need:
        raise ArtifactError(
            f"ONNX weights file {relative!r} is truncated ({size} bytes, the graphs need {need}); restore it "
            "or rebuild the artifact with --backend onnx"
        )
    if mmap:
        return np.memmap(path, dtype=np.uint8, mode="r", shape=(need,))
    return np.fromfile(path, dtype=np.uint8, count=need)


def from_blob(ort, tensors: dict[str, dict], blob: np.ndarray) -> tuple[dict[tuple, np.ndarray], dict[str, Any]]:
    """(arrays by table slot, OrtValue by tensor name) over ``blob``, the bytes of ``weights.bin``: tensors the
    table stores once (a tied head) share one array and one OrtValue."""
    arrays: dict[tuple, np.ndarray] = {}
    values: dict[str, Any] = {}
    by_slot: dict[tuple, Any] = {}
    for name, t in tensors.items():
        slot = (t["offset"], t["nbytes"], t["dtype"], tuple(t["shape"]))
        if slot not in by_slot:
            arr = blob[t["offset"] : t["offset"] + t["nbytes"]].view(NUMPY_DTYPES[t["dtype"]]).reshape(t["shape"])
            arrays[slot] = arr
            by_slot[slot] = ort.OrtValue.ortvalue_from_numpy(arr)
        values[name] = by_slot[slot]
    return arrays, values


def from_arrays(
    ort, tensors: dict[str, dict], given: Mapping[str, np.ndarray]
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """(arrays, OrtValue by tensor name) over arrays already in memory, each checked against the table's dtype
    and shape (an ``OrtValue`` over a numpy array reads its memory: the arrays must outlive the sessions, which
    the backend ensures by keeping them)."""
    arrays: dict[str, np.ndarray] = {}
    values: dict[str, Any] = {}
    for name, t in tensors.items():
        arr = given.get(name)
        if arr is None or arr.dtype != NUMPY_DTYPES[t["dtype"]] or list(arr.shape) != list(t["shape"]):
            raise ArtifactError(f"tensor {name!r} is not in memory as the ONNX export's table describes it")
        arrays[name] = np.ascontiguousarray(arr)
        values[name] = ort.OrtValue.ortvalue_from_numpy(arrays[name])
    return arrays, values


__all__ = ["NUMPY_DTYPES", "from_arrays", "from_blob", "read_weights"]
