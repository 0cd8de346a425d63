"""Runners: the backend an artifact will run on, made available to the tuner for timing.

Costs and confirmation runs must come from the backend that runs the artifact (docs/design.md section 5):
on CPU an 8-token verify costs 1.37x a step on ONNX Runtime and 1.44x on torch for SmolLM2, so a plan
tuned on one is wrong on the other. The torch runner lives in ``passes`` (it needs only the runtime);
the ONNX runner exports the graphs the plans need into the tuning run's scratch folder, with the same
writer the artifact uses, and opens them with the runtime's ``OnnxBackend`` on the weights in memory.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

from speccompile.passes.ir import DecoderIR
from speccompile.passes.tuning import TorchRunner


class OnnxRunner:
    name = "onnx"

    def __init__(self, ir: DecoderIR, workdir: Path):
        self.ir, self.workdir = ir, Path(workdir)
        self._key = None
        self._backend = None
        self._exports = 0

    def backend(self, plans: dict | None = None):
        from speccompile.artifact import model_plans, write_backend_files
        from speccompile.runtime.backends.onnx import OnnxBackend

        plans = model_plans(plans or {})
        key = tuple(
            sorted(
                (name, repr(p.skip_attn), repr(p.skip_mlp), p.exit_layer, p.draft_head_file, p.kind, repr(p.params))
                for name, p in plans.items()
            )
        )
        if key != self._key:
            self._backend = None
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
            # The sessions get the weights the torch decoder holds and the quantized copies from memory (not a
            # private copy of weights.bin per export): the build holds the model once however many exports
            arrays: dict = {}
            record = write_backend_files(folder, ir, ["onnx"], onnx_memory={"arrays": arrays})["onnx"]
            self._backend, self._key = OnnxBackend(folder, record, self.ir.config, initializers=arrays), key
        return self._backend

    def release(self) -> None:
        """Drop the last export's sessions (its ONNX Runtime packed weights) until a backend is asked for again."""
        self._backend, self._key = None, None


def make_runner(name: str, ir: DecoderIR, workdir: Path):
    """The runner for backend ``name`` ("torch" or "onnx")."""
    return OnnxRunner(ir, workdir) if name == "onnx" else TorchRunner(ir)
