"""Backends: where a model's segments run (torch, ONNX Runtime, TensorRT), behind one interface.

``base.Backend`` is the whole interface; each backend is one package here with a ``descriptor.BackendDescriptor``
that says how it opens, what it checks and what writes its files, registered in ``BACKENDS`` below (a new
backend: one package plus one line). Descriptors are imported by name, so that the runtime never imports
torch unless the torch backend is used.
"""

from ..errors import BackendUnavailableError
from ..registry import Registry
from .base import Backend
from .descriptor import BackendDescriptor


class BackendRegistry(Registry):
    """``name -> "module:Descriptor"``; ``descriptor(name)`` the instance, an unknown name refused in one line."""

    def descriptor(self, name: str) -> BackendDescriptor:
        if name not in self:
            raise BackendUnavailableError(
                f"backend {name[:64]!r} is not supported by this runtime (supported: {', '.join(self)})"
            )
        return self.load(name)()


BACKENDS = BackendRegistry(
    "backend",
    __package__,
    {
        "torch": ".torch.descriptor:TorchDescriptor",
        "onnx": ".onnx.descriptor:OnnxDescriptor",
        "tensorrt": ".tensorrt.descriptor:TensorRTDescriptor",
    },
)
"""Backend name -> ``"module:Descriptor"``, in the order their files are written (a later one may reuse an
earlier one's: TensorRT builds its engines from the standard ONNX graphs)."""

__all__ = ["BACKENDS", "Backend", "BackendDescriptor"]
