"""Moved to ``runtime/backends/onnx_backend.py``; this name stays importable."""

from .backends.onnx_backend import OnnxBackend  # noqa: F401
