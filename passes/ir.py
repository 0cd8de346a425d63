"""DecoderIR: the thing every pass takes and returns.

The canonical decoder's config and weights plus the draft plans attached so far. It lives in passes/
(not speccompile/) because passes transform it and dependencies point speccompile -> passes -> runtime.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from speccompile.runtime.artifact.manifest import ArchConfig, DraftPlan


@dataclass
class DecoderIR:
    config: ArchConfig
    weights: dict[str, Any]  # canonical name -> torch.Tensor
    plans: dict[str, DraftPlan] = field(default_factory=dict)
    default_plan: str | None = None
    tuning: dict[str, Any] = field(default_factory=dict)
    dtype: str = "float32"
    device: str = "cpu"
    extra_files: dict[str, Any] = field(default_factory=dict)  # artifact-relative path -> file to copy there
    _decoder: Any = field(default=None, repr=False)

    def attach_decoder(self, decoder) -> None:
        """Use ``decoder`` (the generic path's ``HFDecoder``, which holds its own weights) for the passes."""
        self._decoder = decoder

    def decoder(self):
        """The runnable torch decoder for these weights (built once, shared by the passes)."""
        if self._decoder is None and self.config.decoder == "generic":
            raise RuntimeError("a generic-path IR carries its decoder: call attach_decoder first")
        if self._decoder is None:
            import torch

            from speccompile.runtime.backends.torch.decoder import build_decoder

            self._decoder = build_decoder(self.config, self.weights, getattr(torch, self.dtype), self.device)
        return self._decoder

    def add_plan(self, plan: DraftPlan, make_default: bool = False) -> None:
        plan.validate(self.config.num_layers)
        self.plans[plan.name] = plan
        if make_default or self.default_plan is None:
            self.default_plan = plan.name
