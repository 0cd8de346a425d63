"""The ``OrtValue`` every ONNX Runtime session of a backend shares, one per unique tensor of the export's table.

Sessions receive them through ``SessionOptions.add_initializer`` (``runtime/backends/onnx/backend.py``), so however many
sessions a backend opens the weights are in memory once. Only tensors that several sessions read are shared so
(``shared_tensors``) when sessions prepack their weights: a tensor one session reads is read by that session
from the graph's external data and freed once packed, where a given ``OrtValue`` would stay beside its packed
copy. They come from ``weights.bin`` (an artifact: copied out of a map of the file, or kept as views of it) or
from arrays a caller already holds (a build's tuning runner: the canonical weights the torch decoder holds, as
numpy views, and the quantized copies it made once). ONNX Runtime still reads from the file
the weights it folds at session creation (the fused graphs' packed q/k/v and gate/up projections are a Concat
of initializers: constant folding reads its inputs from the external data, not from the initializers given).

This module must not import torch or transformers.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import ArtifactError

NUMPY_DTYPES = {"float32": np.float32, "float16": np.float16, "int64": np.int64, "uint8": np.uint8}


def read_weights(root: Path, record: dict, tensors: dict[str, dict], relative: str) -> np.ndarray:
    """The bytes of the export's ``weights.bin`` the tensor table needs, mapped read-only (a page is read when a
    tensor on it is: ``from_blob`` copies the shared tensors out, or keeps views); a missing or truncated file is
    a one-line error."""
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
    if need == 0:  # nothing to map (numpy cannot map zero bytes)
        return np.zeros(0, dtype=np.uint8)
    return np.memmap(path, dtype=np.uint8, mode="r", shape=(need,))


def shared_tensors(graphs: dict[str, dict], opened: list[str], tensors: dict[str, dict]) -> set[str]:
    """The tensors whose bytes (their slot in ``weights.bin``) more than one of the ``opened`` graphs reads: those
    become shared ``OrtValue``s; a session reads the others itself (and frees what it packs)."""
    readers: dict[tuple, set[str]] = {}
    for key in opened:
        for name in graphs[key].get("initializers", []):
            if name in tensors:
                readers.setdefault(_slot(tensors[name]), set()).add(key)
    return {name for name, t in tensors.items() if len(readers.get(_slot(t), ())) > 1}


def _slot(t: dict) -> tuple:
    return (t["offset"], t["nbytes"], t["dtype"], tuple(t["shape"]))


def from_blob(
    ort, tensors: dict[str, dict], blob: np.ndarray, only: set[str] | None = None, copy: bool = False
) -> tuple[dict[tuple, np.ndarray], dict[str, Any]]:
    """(arrays by table slot, OrtValue by tensor name) over ``blob``, the bytes of ``weights.bin``, for the tensors
    in ``only`` (default all); ``copy`` reads each into private memory (``blob`` is then a map of the file, of
    which only these tensors' pages are read). Tensors the table stores once (a tied head) share one array and
    one OrtValue."""
    arrays: dict[tuple, np.ndarray] = {}
    values: dict[str, Any] = {}
    by_slot: dict[tuple, Any] = {}
    for name, t in tensors.items():
        if only is not None and name not in only:
            continue
        slot = _slot(t)
        if slot not in by_slot:
            arr = blob[t["offset"] : t["offset"] + t["nbytes"]].view(NUMPY_DTYPES[t["dtype"]]).reshape(t["shape"])
            arrays[slot] = np.array(arr) if copy else arr
            by_slot[slot] = ort.OrtValue.ortvalue_from_numpy(arrays[slot])
        values[name] = by_slot[slot]
    return arrays, values


def from_arrays(
    ort, tensors: dict[str, dict], given: Mapping[str, np.ndarray], only: set[str] | None = None
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """(arrays, OrtValue by tensor name) over arrays already in memory, for the tensors in ``only`` (default all),
    each checked against the table's dtype and shape (an ``OrtValue`` over a numpy array reads its memory: the
    arrays must outlive the sessions, which the backend ensures by keeping them)."""
    arrays: dict[str, np.ndarray] = {}
    values: dict[str, Any] = {}
    for name, t in tensors.items():
        if only is not None and name not in only:
            continue
        arr = given.get(name)
        if arr is None or arr.dtype != NUMPY_DTYPES[t["dtype"]] or list(arr.shape) != list(t["shape"]):
            raise ArtifactError(f"tensor {name!r} is not in memory as the ONNX export's table describes it")
        arrays[name] = np.ascontiguousarray(arr)
        values[name] = ort.OrtValue.ortvalue_from_numpy(arrays[name])
    return arrays, values


__all__ = ["NUMPY_DTYPES", "from_arrays", "from_blob", "read_weights", "shared_tensors"]
