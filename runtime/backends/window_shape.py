"""How much of the cache a model draft attends to at long context: its first positions (attention sinks) and a
window of the most recent ones (StreamingLLM), so that a draft step's cost stops growing with the context.

Why: a precision self-draft shares the verifier's cache, so each draft step attends over the whole past, and at
thousands of positions that attention is most of the step (SmolLM2-135M on ONNX Runtime, Intel Xeon, 2 threads:
an int8 draft step 10.5 ms at 256 positions, 51 ms at 7,168, where a plain step costs 66 ms): the drafts then cost
more than they save. The sizes below were chosen by measurement on SmolLM2 at 7K tokens (docs/long_inputs.md):
the draft agrees with the whole-context model on most tokens with 4 sinks and 512 recent positions, and a window
of 256 or of 1,024-2,048 decoded slower. Each backend applies it its own way:
``runtime/backends/onnx/draft_window.py`` (a buffer of its own, bound in place of the cache) and the torch
decoder's ``Positions.windowed`` (the cache sliced).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WindowShape:
    """``sinks``: the first positions every draft step attends to; ``window``: the most recent positions it
    attends to (on ONNX Runtime between ``window`` and ``2 * window`` of them, the buffer sliding in steps of
    ``window``; on torch exactly ``window``); ``margin``: the widest draft row that uses the window (a wider one,
    a prompt's catch-up, attends to the whole past). A row uses the window from ``min_context`` positions on,
    where the window is at most half the past."""

    sinks: int = 4
    window: int = 512
    margin: int = 64

    @property
    def capacity(self) -> int:
        return self.sinks + 2 * self.window + self.margin

    @property
    def min_context(self) -> int:
        return self.sinks + 2 * self.window


__all__ = ["WindowShape"]
