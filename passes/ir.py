"""DecoderIR: the thing every pass takes and returns.

The canonical decoder's config and weights plus the draft plans attached so far. It lives in passes/
(not speccompile/) because passes transform it and dependencies point speccompile -> passes -> runtime.
"""

from __future__ import annotations

from collections.abc import Mapping
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
    # ONNX exports' quantized weight copies (precision drafts), made once per build and reused by every export
    quantized: dict[str, Any] = field(default_factory=dict, repr=False)
    _decoder: Any = field(default=None, repr=False)
    # a TemporaryDirectory holding extra_files' sources, removed with the IR (or when the process exits)
    scratch: Any = field(default=None, repr=False)

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

            self._decoder = build_decoder(
                self.config, self.weights, getattr(torch, self.dtype), self.device, copy=False
            )
            if self.dtype == "float32" and str(self.device) == "cpu":  # the decoder holds these very tensors
                self.weights = LiveWeights(self._decoder, list(self.weights))
        return self._decoder

    def add_plan(self, plan: DraftPlan, make_default: bool = False) -> None:
        plan.validate(self.config.num_layers)
        self.plans[plan.name] = plan
        if make_default or self.default_plan is None:
            self.default_plan = plan.name


class LiveWeights(Mapping):
    """The canonical weights as the decoder holds them now, by name. The decoder may re-store a weight (the
    torch backend packs q/k/v and gate/up into one product each, the parts becoming views of it): a dict
    of the tensors it was built from would then keep a second copy alive, this reads the current ones."""

    def __init__(self, decoder, names: list[str]):
        self.decoder, self.names = decoder, names

    def _current(self) -> dict:
        return self.decoder.state_dict()

    def __getitem__(self, name: str):
        if name not in self.names:
            raise KeyError(name)
        return self._current()[name]

    def __iter__(self):
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def items(self):
        current = self._current()
        return [(name, current[name]) for name in self.names]

    def values(self):
        return [tensor for _, tensor in self.items()]
