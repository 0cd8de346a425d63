"""The TensorRT backend as the toolkit sees it (``backends/descriptor.py``): engines built from the standard ONNX
graphs on the GPU that runs them, refitted from the ONNX weights at load. Tuned on the torch runner."""

from __future__ import annotations

from pathlib import Path

from ...artifact.manifest import Manifest
from ..descriptor import BackendDescriptor


class TensorRTDescriptor(BackendDescriptor):
    name = "tensorrt"
    writer = "speccompile.exporters.tensorrt:write_tensorrt_files"

    def open(self, root: Path, manifest: Manifest, plans: dict, device: str):
        from .backend import TensorRTBackend  # tensorrt + cuda-python: checked when the engines are opened

        return TensorRTBackend.from_artifact(root, manifest, plans, device=device)

    def check_available(self) -> None:
        from .backend import tensorrt_module
        from .cuda import cuda_runtime

        tensorrt_module()
        cuda_runtime()


__all__ = ["TensorRTDescriptor"]
