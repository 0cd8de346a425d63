"""What the toolkit knows of one backend, in one place: how it opens, what it checks first, what writes its
files and what tunes on it.

A backend is one package under ``runtime/backends/`` holding its ``Backend`` and a ``BackendDescriptor``
subclass, plus one line in ``BACKENDS`` (``__init__.py``). Loading (``runtime/model.py``), ``inspect``'s checks
(``weights_check.check_before_open``), the artifact writer (``speccompile/artifact_writer.py``), the build's option
checks and the tuner's runner (``speccompile/runners.py``) all ask the descriptor, never the backend's name.

The build side (the writer, the tuning runner) lives in the ``speccompile`` layer, which the runtime must not
import: the descriptor names them as ``"module:function"`` strings, which only that layer resolves.
"""

from __future__ import annotations

from pathlib import Path

from ..artifact.manifest import Manifest
from .base import Backend


class BackendDescriptor:
    """One backend; see the module docstring. Subclasses set ``name`` and ``writer`` and implement ``open``."""

    name: str = ""
    writer: str = ""
    """``"module:function"`` of the build layer that writes this backend's files: ``write(root, ir, records,
    onnx_memory)`` returns the manifest's ``backends[name]`` record (``records``: the backends written before it,
    in ``BACKENDS``' order, so a backend may reuse another's files)."""
    runner: str = "speccompile.passes.tuning:TorchRunner"
    """``"module:Class"`` of the tuning runner that times plans on this backend (``Class(ir, workdir)``); the torch
    runner where the backend has none of its own."""
    canonical_only: bool = True
    """Whether it needs the canonical decoder (the generic torch path runs on torch alone)."""

    def open(self, root: Path, manifest: Manifest, plans: dict, device: str) -> Backend:
        """The opened backend for the artifact at ``root`` (``plans``: its plans read); a one-line
        ``BackendUnavailableError`` when its packages are missing."""
        raise NotImplementedError

    def check_before_open(self, root: Path, manifest: Manifest) -> None:
        """The manifest's geometry against the headers of the weights ``open`` would read (no weights loaded)."""

    def check_available(self) -> None:
        """A one-line error when this machine cannot run the backend at all (checked before a build's slow part)."""

    def speculation_refusal(self, backend: Backend) -> str | None:
        """Why the opened ``backend`` must not speculate on this machine (None: it may)."""
        return None


__all__ = ["BackendDescriptor"]
