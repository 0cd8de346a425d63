"""Backends: where a model's segments run (torch, ONNX Runtime, TensorRT), behind one interface.

``base.Backend`` is the whole interface; each backend is one module here. Modules are imported by
name (``runtime/model.py``) so that the runtime never imports torch unless the torch backend is used.
"""

from .base import Backend

__all__ = ["Backend"]
