"""The build side of each backend, found through its runtime descriptor (``runtime/backends/descriptor.py``).

A descriptor names its writer and its tuning runner as ``"module:name"`` strings, because the runtime must not
import this layer; here they are imported, so that the artifact writer and the tuner ask the descriptor
rather than branch on a backend's name.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

from speccompile.runtime.backends import BACKENDS, BackendDescriptor


def named(reference: str) -> Any:
    """The object a ``"module:name"`` string names."""
    module, _, name = reference.partition(":")
    return getattr(importlib.import_module(module), name)


def descriptor(name: str) -> BackendDescriptor:
    return BACKENDS.descriptor(name)


def writer(name: str) -> Callable[..., dict]:
    """``write(root, ir, records, onnx_memory) -> record`` of backend ``name``."""
    return named(descriptor(name).writer)


def runner_class(name: str) -> type:
    """The tuning runner class of backend ``name`` (``Class(ir, workdir)``)."""
    return named(descriptor(name).runner)


def in_write_order(backends) -> list[str]:
    """``backends`` in ``BACKENDS``' order, which is the order their files are written (a later backend may
    reuse an earlier one's files)."""
    return [name for name in BACKENDS if name in backends]


__all__ = ["descriptor", "in_write_order", "named", "runner_class", "writer"]
