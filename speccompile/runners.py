"""Runners: the backend an artifact will run on, made available to the tuner for timing.

Costs and confirmation runs must come from the backend that runs the artifact (docs/design.md section 5): on CPU
what an 8-token verify costs in steps differs between ONNX Runtime and torch (measured: docs/design.md section 5),
so a plan tuned on one is wrong on the other. The torch runner lives in ``passes`` (it needs only the runtime); the
ONNX runner exports the graphs the plans need into the tuning run's scratch folder, with the same writer the
artifact uses, and opens them with the runtime's ``OnnxBackend`` on the weights in memory.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

from speccompile.backend_parts import runner_class
from speccompile.passes.ir import DecoderIR
from speccompile.runtime.memory import drop_file_pages, return_freed_memory


class OnnxRunner:
    """The ONNX Runtime sessions of the plans asked for last, over an export in the tuning run's scratch folder.

    The build holds the weights about once: while the sessions are open (they hold ONNX Runtime's packed copy)
    the torch decoder's weights, pages of the mapped model file, are dropped from memory
    (``runtime/memory.drop_file_pages``), and a pass that needs the torch side at length (the int8 twin's
    bound) first ``release``s the sessions, which the next ``backend`` call opens again from the same export."""

    name = "onnx"

    def __init__(self, ir: DecoderIR, workdir: Path):
        self.ir, self.workdir = ir, Path(workdir)
        self._key = None
        self._backend = None
        self._export = None  # (folder, record, arrays) of the last export, reopened after a release
        self._exports = 0

    def backend(self, plans: dict | None = None):
        from speccompile.artifact_writer import model_plans, write_backend_files

        plans = model_plans(plans or {})
        key = tuple(sorted((name, p.kind, repr(p.params)) for name, p in plans.items()))  # the model parts exported
        if key == self._key and self._backend is not None:
            return self._backend
        self._backend = None
        return_freed_memory()  # the last sessions' packed weights go before the next ones are made
        if key != self._key:
            self._export = None
            folder = self.workdir / f"onnx-export-{self._exports}"
            shutil.rmtree(self.workdir / f"onnx-export-{self._exports - 1}", ignore_errors=True)  # one copy on disk
            self._exports += 1
            folder.mkdir(parents=True)
            heads = {
                p.draft_head_file: self.ir.extra_files[p.draft_head_file]
                for p in plans.values()
                if p.draft_head_file in self.ir.extra_files
            }  # exported as graphs (exporters/onnx_blocks.py)
            ir = dataclasses.replace(self.ir, plans=dict(plans), extra_files=heads)
            # Tensors several sessions share come from the memory the torch decoder and the quantized copies
            # already hold (not a private copy of weights.bin per export); the others each session reads itself.
            arrays: dict = {}
            record = write_backend_files(folder, ir, ["onnx"], onnx_memory={"arrays": arrays})["onnx"]
            self._export, self._key = (folder, record, arrays), key
        self._backend = self._open()
        return self._backend

    def _open(self):
        from speccompile.runtime.backends.onnx import OnnxBackend

        folder, record, arrays = self._export
        drop_file_pages(self.ir.weights.values())  # before the sessions pack their copy, and after
        backend = OnnxBackend(folder, record, self.ir.config, initializers=arrays)
        drop_file_pages(self.ir.weights.values())
        return backend

    def plain_backend(self):
        """A backend whose full model runs plain and batched calls (the call costs' timing): the sessions open
        now, or those of the last export opened again, without exporting for other plans."""
        if self._backend is None and self._export is not None:
            self._backend = self._open()
        return self._backend if self._backend is not None else self.backend({})

    def release(self) -> None:
        """Drop the sessions (ONNX Runtime's packed weights) until a backend is asked for again: the same plans'
        sessions are then opened again from the export, without exporting anew."""
        if self._backend is None:
            return
        self._backend = None
        return_freed_memory()


def make_runner(name: str, ir: DecoderIR, workdir: Path):
    """The tuning runner of backend ``name``: its descriptor's (``runtime/backends/descriptor.py``)."""
    return runner_class(name)(ir, workdir)
