"""The torch backend's files: the canonical decoder's weights as one safetensors file (plus the int8 twin's
smoothing scales when a precision plan uses them), or, for a model on the generic path, the model's own
``save_pretrained`` folder (config.json + safetensors), loaded by transformers at run time, never remote code.
The torch descriptor's writer (``runtime/backends/torch/descriptor.py``)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from speccompile.artifact_writer import WEIGHTS_FILE


def write_torch_files(root: Path, ir, records: dict, onnx_memory: dict | None = None) -> dict:
    """Write the torch backend's files for ``ir`` under ``root``; its manifest record."""
    if ir.config.decoder == "generic":
        from speccompile.runtime.backends.torch.hf_decoder import HF_FOLDER

        ir.decoder().model.save_pretrained(root / HF_FOLDER, safe_serialization=True, max_shard_size="1000GB")
        return {"weights": WEIGHTS_FILE, "hf_folder": HF_FOLDER}
    (root / "weights").mkdir(exist_ok=True)
    dtype = getattr(torch, ir.dtype)
    weights = {k: (v if k == "rope_inv_freq" else v.to(dtype)).contiguous() for k, v in ir.weights.items()}
    save_file(weights, str(root / WEIGHTS_FILE), metadata={"format": "pt", "producer": "speccompile"})
    record = {"weights": WEIGHTS_FILE}
    from speccompile.runtime.backends.torch.int8_twin import SCALES_FILE

    if SCALES_FILE in getattr(ir, "extra_files", {}):  # the int8 twin's smoothing (passes/precision_tune.py)
        record["int8_scales_file"] = SCALES_FILE
    return record


__all__ = ["write_torch_files"]
