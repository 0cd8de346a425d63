"""The ONNX Runtime backend as the toolkit sees it (``backends/descriptor.py``)."""

from __future__ import annotations

from pathlib import Path

from ...artifact.manifest import Manifest
from ...errors import BackendUnavailableError, quote
from ..descriptor import BackendDescriptor


class OnnxDescriptor(BackendDescriptor):
    name = "onnx"
    writer = "speccompile.exporters.onnx_export:write_onnx_files"
    runner = "speccompile.runners:OnnxRunner"

    def open(self, root: Path, manifest: Manifest, plans: dict, device: str):
        try:
            import onnxruntime  # noqa: F401  (the sessions are opened by the backend)
        except ImportError:
            raise BackendUnavailableError(
                "the onnx backend needs onnxruntime; install it (pip install onnxruntime, or onnxruntime-gpu)"
            ) from None
        from .backend import OnnxBackend

        return OnnxBackend.from_artifact(root, manifest, plans, device=device)

    def check_before_open(self, root: Path, manifest: Manifest) -> None:
        from ..weights_check import check_geometry, check_kv_input, onnx_table_shapes

        config, record = manifest.config, manifest.backends["onnx"]
        check_geometry(config, onnx_table_shapes(record), "the ONNX tensor table")
        for key, graph in record["graphs"].items():
            for item in graph.get("inputs", []):
                check_kv_input(config, item.get("name"), item.get("shape"), f"ONNX graph {quote(key)} in the manifest")

    def speculation_refusal(self, backend) -> str | None:
        """A quantized target whose verify rounds differently from its steps on this CPU (``selfcheck.py``)."""
        from . import selfcheck

        return selfcheck.speculation_refusal(backend)


__all__ = ["OnnxDescriptor"]
