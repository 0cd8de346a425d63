"""Does the manifest's geometry fit the weights it names? Checked from the weight files' headers (the
safetensors JSON header, the ONNX backend's tensor table), without reading any weight.

The manifest's schema checks types and ranges (``runtime/artifact/schema.py``, ``ArchConfig.validate``); this
module checks consistency: layer count, hidden size, vocabulary, head counts and sizes, MLP width, rotary
size and experts against the tensors' shapes, so that a manifest edited (or damaged) to disagree with its
weights is refused with one ``ArtifactError`` naming the config field and the tensor, not a shape error
from deep inside the backend.

``check_before_open`` runs before a backend is opened; ``check_after_open`` compares what the opened
backend reports (its decoder's config, its ONNX sessions' KV inputs) with the manifest.
"""

from __future__ import annotations

import json
import math
import re
import struct
from pathlib import Path
from typing import Any

from ..artifact.manifest import ArchConfig, Manifest
from ..errors import ArtifactError, quote

MAX_HEADER_BYTES = 100 << 20
"""Largest safetensors header read (the format's own readers refuse more)."""
ITEMSIZE = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "uint8": 1,
    "int8": 1,
}
"""Bytes per element of the dtypes safetensors and the ONNX tensor table name."""
_LAYER = re.compile(r"layers\.(\d+)\.")
_EXPERT = re.compile(r"layers\.0\.mlp\.experts\.(\d+)\.")
REBUILD = "the manifest does not match its weights (edited or from another build): rebuild the artifact"


def safetensors_shapes(path: Path, relative: str) -> dict[str, list[int]]:
    """Tensor name -> shape from a safetensors file's header, checked against the file's size."""
    try:
        with open(path, "rb") as handle:
            size = path.stat().st_size
            prefix = handle.read(8)
            (length,) = struct.unpack("<Q", prefix) if len(prefix) == 8 else (None,)
            if length is None or not 2 <= length <= min(size - 8, MAX_HEADER_BYTES):
                raise ArtifactError(
                    f"weights file {quote(relative)} is not a safetensors file (bad header length); "
                    "restore it or rebuild the artifact"
                )
            header = json.loads(handle.read(length))
    except OSError as exc:
        raise ArtifactError(
            f"cannot read weights file {quote(relative)} ({exc.strerror}); check its permissions"
        ) from None
    except (ValueError, RecursionError):  # not JSON, or not UTF-8
        raise ArtifactError(
            f"weights file {quote(relative)} has a damaged safetensors header; restore it or rebuild the artifact"
        ) from None
    if not isinstance(header, dict):
        raise ArtifactError(f"weights file {quote(relative)} has a damaged safetensors header; rebuild the artifact")
    data_bytes = size - 8 - length
    shapes = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        ok = isinstance(entry, dict) and isinstance(entry.get("shape"), list) and entry.get("dtype") in ITEMSIZE
        shape = entry.get("shape") if ok else None
        offsets = entry.get("data_offsets") if ok else None
        ok = ok and all(type(d) is int and d >= 0 for d in shape) and isinstance(offsets, list) and len(offsets) == 2
        ok = ok and all(type(o) is int for o in offsets) and 0 <= offsets[0] <= offsets[1] <= data_bytes
        if not ok or offsets[1] - offsets[0] != math.prod(shape) * ITEMSIZE[entry["dtype"]]:
            raise ArtifactError(
                f"weights file {quote(relative)}: tensor {quote(name)} has a damaged header entry; "
                "restore the file or rebuild the artifact"
            )
        shapes[name] = shape
    return shapes


def onnx_table_shapes(record: dict[str, Any]) -> dict[str, list[int]]:
    """Tensor name -> shape from the ONNX backend's tensor table (the index of its weights file), each
    entry's byte size checked against its shape and dtype (what the backend's reshape needs)."""
    shapes = {}
    for name, t in record.get("tensors", {}).items():
        itemsize = ITEMSIZE.get(t["dtype"])
        if itemsize is None or t["nbytes"] != math.prod(t["shape"]) * itemsize:
            raise ArtifactError(
                f"manifest backends['onnx'].tensors[{quote(name)}]: {t['nbytes']} bytes do not hold "
                f"dtype {quote(t['dtype'])} of shape {quote(t['shape'])}; rebuild the artifact with "
                "--backend onnx"
            )
        shapes[name] = t["shape"]
    return shapes


def check_geometry(config: ArchConfig, shapes: dict[str, list[int]], source: str) -> None:
    """The config's sizes against the canonical tensors present in ``shapes`` (derived names, such as an
    ONNX graph's quantized ``<name>.int4``, are not compared)."""
    c = config

    def expect(name: str, shape: list[int], fields: str) -> None:
        got = shapes.get(name)
        if got is not None and list(got) != shape:
            raise ArtifactError(
                f"{source}: tensor {quote(name)} has shape {quote(list(got))} but config {fields} gives "
                f"{shape}; {REBUILD}"
            )

    layers = {int(m.group(1)) for name in shapes if (m := _LAYER.match(name))}
    if layers and layers != set(range(c.num_layers)):
        raise ArtifactError(
            f"{source} holds {len(layers)} blocks (0..{max(layers)}) but config.num_layers is {c.num_layers}; {REBUILD}"
        )
    experts = {int(m.group(1)) for name in shapes if (m := _EXPERT.match(name))}
    if len(experts) != c.num_experts:
        raise ArtifactError(
            f"{source} holds {len(experts)} experts per block but config.num_experts is {c.num_experts}; {REBUILD}"
        )
    h, v, hd, inner = c.hidden_size, c.vocab_size, c.head_dim, c.intermediate_size
    expect("embed.weight", [v, h], "(vocab_size, hidden_size)")
    expect("lm_head.weight", [v, h], "(vocab_size, hidden_size)")
    expect("norm.weight", [h], "(hidden_size,)")
    if c.positions == "learned":
        expect(
            "pos_embed.weight",
            [c.max_position_embeddings + c.position_offset, h],
            "(max_position_embeddings + position_offset, hidden_size)",
        )
    else:
        expect("rope_inv_freq", [c.rotary_dim // 2], "(rotary_dim / 2,)")
        expect("rope_local_inv_freq", [c.rotary_dim // 2], "(rotary_dim / 2,)")
    mlps = [f"layers.{i}.mlp." for i in range(c.num_layers)]
    if c.num_experts:
        mlps = [f"{p}experts.{e}." for p in mlps for e in range(c.num_experts)]
    for i in range(c.num_layers):
        p = f"layers.{i}.attn."
        expect(p + "q.weight", [c.num_heads * hd, h], "(num_heads * head_dim, hidden_size)")
        expect(p + "k.weight", [c.num_kv_heads * hd, h], "(num_kv_heads * head_dim, hidden_size)")
        expect(p + "v.weight", [c.num_kv_heads * hd, h], "(num_kv_heads * head_dim, hidden_size)")
        expect(p + "o.weight", [h, c.num_heads * hd], "(hidden_size, num_heads * head_dim)")
        if c.num_experts:
            expect(f"layers.{i}.mlp.router.weight", [c.num_experts, h], "(num_experts, hidden_size)")
    for p in mlps:
        expect(p + "up.weight", [inner, h], "(intermediate_size, hidden_size)")
        expect(p + "gate.weight", [inner, h], "(intermediate_size, hidden_size)")
        expect(p + "down.weight", [h, inner], "(hidden_size, intermediate_size)")


def check_before_open(root: Path, manifest: Manifest, backend: str) -> None:
    """The manifest's geometry against the headers of the weights ``backend`` is about to open (its descriptor's
    check: ``backends/descriptor.py``)."""
    from . import BACKENDS

    BACKENDS.descriptor(backend).check_before_open(root, manifest)


def check_kv_input(config: ArchConfig, name: Any, shape: Any, where: str) -> None:
    """A ``past_key_values.{i}.key|value`` input ``[batch, kv_heads, length, head_dim]`` against the config."""
    if not isinstance(name, str) or not name.startswith("past_key_values."):
        return
    layer = name.split(".")[1]
    if not layer.isdigit() or int(layer) >= config.num_layers:
        raise ArtifactError(
            f"{where} reads the KV cache of block {quote(layer)}, outside 0..{config.num_layers - 1}; {REBUILD}"
        )
    want = [None, config.num_kv_heads, None, config.head_dim]
    if (
        not isinstance(shape, (list, tuple))
        or len(shape) != 4
        or any(isinstance(got, int) and w is not None and got != w for got, w in zip(shape, want))
    ):
        raise ArtifactError(
            f"{where}: input {quote(name)} has shape {quote(shape)} but config gives "
            f"[batch, num_kv_heads={config.num_kv_heads}, length, head_dim={config.head_dim}]; {REBUILD}"
        )


GEOMETRY = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim")


def compare_geometry(config: ArchConfig, own: dict[str, Any], where: str) -> None:
    """The manifest's ``GEOMETRY`` fields against the model's own (``own``: field -> value; None where the
    model does not say)."""
    wrong = [
        f"{name} {getattr(config, name)} (the model has {own[name]})"
        for name in GEOMETRY
        if own.get(name) is not None and own[name] != getattr(config, name)
    ]
    if wrong:
        raise ArtifactError(
            f"manifest config does not match the model in the artifact ({where}): {', '.join(wrong[:3])}; {REBUILD}"
        )


def check_after_open(manifest: Manifest, backend: Any) -> None:
    """What the opened backend reports against the manifest: a generic-path decoder's own geometry (read
    from the model's config.json by transformers), an ONNX session's KV inputs (from the graph file)."""
    decoder = getattr(backend, "decoder", None)
    own = getattr(decoder, "config", None)
    if isinstance(own, ArchConfig) and own is not manifest.config:
        compare_geometry(manifest.config, {name: getattr(own, name) for name in GEOMETRY}, "the loaded model")
    for key, session in (getattr(backend, "sessions", None) or {}).items():
        for item in session.get_inputs():
            check_kv_input(manifest.config, item.name, item.shape, f"ONNX graph {quote(key)}")


__all__ = [
    "check_after_open",
    "check_before_open",
    "check_geometry",
    "check_kv_input",
    "compare_geometry",
    "onnx_table_shapes",
    "safetensors_shapes",
]
