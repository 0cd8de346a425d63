"""Pass and PassManager (in the manner of onnx-ir's passes): each pass does one thing to a DecoderIR."""

from __future__ import annotations

import time
from typing import Callable

from .ir import DecoderIR


class Pass:
    """A transformation of the IR. Subclasses implement ``run``; ``name`` shows in logs and the manifest."""

    name = "pass"

    def run(self, ir: DecoderIR) -> DecoderIR:
        raise NotImplementedError

    def __call__(self, ir: DecoderIR) -> DecoderIR:
        return self.run(ir)


class PassManager:
    """Runs passes in order and records what each did and how long it took (into ``ir.tuning``)."""

    def __init__(self, passes: list[Pass], log: Callable[[str], None] = lambda message: None):
        self.passes, self.log = passes, log

    def __call__(self, ir: DecoderIR) -> DecoderIR:
        history = ir.tuning.setdefault("passes", [])
        for p in self.passes:
            start = time.perf_counter()
            self.log(f"pass {p.name} ...")
            ir = p(ir)
            seconds = time.perf_counter() - start
            history.append({"pass": p.name, "seconds": round(seconds, 3)})
            self.log(f"pass {p.name} done in {seconds:.1f}s")
        return ir
