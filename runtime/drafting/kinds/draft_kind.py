"""What a draft kind is: everything about one way of drafting with the model, in one class.

A kind is built from a ``DraftPlan`` (data, in the manifest) and owns every decision that depends on
what the plan is (the pattern of vLLM's proposers and transformers' candidate generators):

- ``draft_segment``, ``segments()``: the subgraphs its draft steps and verifies run (exporters export
  exactly these, backends refuse a plan whose segments they cannot run, before any work);
- ``draft`` / ``verify``: one draft step and one verify, as calls of ``Backend.run``; ``reuse``: how
  many of a round's verify inputs already ran the verifier's prefix (early exit);
- ``draft_calls`` / ``verify_calls``: the same calls as (segment, token count) pairs, which the cost
  model prices (``passes/cost_model.py``), so the estimate describes what runs;
- ``estimate_hidden``: the draft's hidden states over a calibration sequence in one parallel pass
  (``passes/acceptance_estimate.py`` supplies the estimator);
- ``describe``: its part of ``inspect`` and error lines.

Backends, the decode loop, the cost model, the estimator and the exporters call these and never ask
what kind a plan is. A new kind is one module here plus one line in ``KINDS`` (``__init__.py``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Sequence

import numpy as np

from ...artifact.manifest import DraftPlan
from ...errors import ArtifactError, quote
from ...segments import FINAL_HEAD, Segment, full_model


class DraftKind(ABC):
    """One kind of model draft (or none: ``lookup``); see the module docstring."""

    name: str = ""
    has_model_part: bool = True
    param_keys: tuple[str, ...] | None = None
    """The ``params`` keys the kind reads: ``check`` refuses others, so a misspelt option is not silently
    ignored (None: the kind checks its params itself)."""

    def __init__(self, plan: DraftPlan, num_layers: int | None = None):
        self.plan = plan
        self.num_layers = num_layers

    def check(self) -> None:
        """A one-line ``ArtifactError`` when the plan's options (its ``params``) do not fit the kind."""
        if self.param_keys is None:
            return
        unknown = sorted(set(self.plan.params) - set(self.param_keys))
        if unknown:
            known = ", ".join(self.param_keys) or "none"
            raise ArtifactError(
                f"plan {self.plan.name[:64]!r}: params {quote(unknown, 120)} are not options of the {self.name} draft "
                f"kind (its options: {known}); remove them or rebuild the artifact"
            )

    # -- what runs ------------------------------------------------------------------------------------
    @property
    @abstractmethod
    def draft_segment(self) -> Segment:
        """The segment one draft step runs on the round's latest token."""

    def segments(self) -> list[Segment]:
        """Every segment ``draft`` and ``verify`` may run, besides the full model."""
        return [self.draft_segment]

    def draft(self, backend, token: int, pos: int) -> np.ndarray:
        """Logits ``[vocab]`` of one draft step on ``token`` at ``pos``."""
        return backend.run(self.draft_segment, pos, tokens=[token])[-1]

    def verify(self, backend, tokens: Sequence[int], pos: int, reuse: int) -> np.ndarray:
        """Full-model logits ``[T, vocab]`` for a round's tokens (the input token, then the drafts)."""
        return backend.forward(tokens, pos)

    def reuse(self, drafted: int) -> int:
        """How many of a round's verify inputs already ran the verifier's blocks, after ``drafted`` steps."""
        return 0

    # -- what it costs ---------------------------------------------------------------------------------
    def draft_calls(self) -> list[tuple[Segment, int]]:
        """The ``(segment, tokens)`` calls of one draft step."""
        return [(self.draft_segment, 1)]

    def verify_calls(self, tokens: int, reuse: int) -> list[tuple[Segment, int]]:
        """The ``(segment, tokens)`` calls of a verify of ``tokens`` tokens, ``reuse`` of them reused."""
        return [(full_model(self.layers), tokens)]

    def head_extra(self, sublayers) -> float:
        """Seconds a draft step's head adds over the shared head (``draft_head.head_extra``)."""
        from .draft_head import head_extra

        return head_extra(self.plan, sublayers)

    # -- what it is --------------------------------------------------------------------------------------
    def estimate_hidden(self, estimator):
        """The draft's hidden states before its head over a calibration sequence, in one parallel pass. A
        real draft attends to the verifier's KV at accepted positions: the estimator's mixed attention."""
        return estimator.mixed(self.draft_segment)

    def describe(self) -> str:
        """Its model part for ``inspect`` (empty without one)."""
        return ""

    # -- helpers ---------------------------------------------------------------------------------------------
    @property
    def layers(self) -> int:
        if self.num_layers is None:
            raise ValueError("this draft kind needs the model's layer count (read_plan(plan, num_layers))")
        return self.num_layers

    @property
    def head(self) -> str:
        """The head a draft step ends in: the plan's draft head file, else the model's shared head."""
        return self.plan.draft_head_file or FINAL_HEAD


HEAD_PARAMS = ("head", "draft_vocab", "draft_head_file")
"""The draft head's options, which any model draft may have (``head`` above, ``draft_head.py``)."""


__all__ = ["HEAD_PARAMS", "DraftKind"]
