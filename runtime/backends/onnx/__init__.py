"""The ONNX Runtime backend: the artifact's graphs run by ONNX Runtime sessions (``backend.py``), their
weights shared across sessions (``initializers.py``), the load-time self-check of quantized targets
(``selfcheck.py``), and how the toolkit opens, checks and writes it (``descriptor.py``).

Importing the package imports neither onnxruntime nor torch: ``OnnxBackend`` opens its sessions when built.
"""

from .backend import OnnxBackend

__all__ = ["OnnxBackend"]
