"""The two plan-defining passes: attach an early-exit head, or a layer-skip draft subgraph.

Neither adds weights: an exit head is the shared final norm + lm_head applied at block E, and a
layer-skip draft is the same blocks with some sublayers passed through.
"""

from __future__ import annotations

from speccompile.runtime.artifact.manifest import DraftPlan
from speccompile.runtime.drafting.model_draft import ModelOptions

from .ir import DecoderIR
from .pass_manager import Pass, PassResult


def tuned_target(measured: dict) -> float:
    """Steer the adaptive threshold toward the acceptance rate the tuner measured at its chosen threshold,
    so that on traffic like the calibration set the runtime stays at the tuned operating point."""
    rate = measured.get("acceptance_rate")
    return round(min(max(rate, 0.05), 0.95), 4) if rate is not None else ModelOptions.target_acceptance


class EarlyExitHeads(Pass):
    """Attach an exit head after block ``exit_layer`` (zero new weights)."""

    name = "early_exit_heads"

    def __init__(
        self,
        exit_layer: int,
        max_draft: int = 6,
        threshold: float = 0.0,
        plan_name: str | None = None,
        measured: dict | None = None,
    ):
        self.exit_layer, self.max_draft, self.threshold = exit_layer, max_draft, threshold
        self.plan_name, self.measured = plan_name or f"exit-{exit_layer}", measured or {}

    def call(self, ir: DecoderIR) -> PassResult:
        before = dict(ir.plans)
        ir.add_plan(
            DraftPlan.of(
                name=self.plan_name,
                exit_layer=self.exit_layer,
                head=f"exit:{self.exit_layer}",
                measured=dict(self.measured),
                sources={
                    "model": {
                        "max_draft": self.max_draft,
                        "threshold": self.threshold,
                        "target_acceptance": tuned_target(self.measured),
                    }
                },
            )
        )
        return PassResult.after(ir, before)


class LayerSkipPlan(Pass):
    """Define a draft subgraph that skips the given attention and MLP sublayers."""

    name = "layer_skip"

    def __init__(
        self,
        skip_attn,
        skip_mlp,
        max_draft: int = 6,
        threshold: float = 0.0,
        plan_name: str = "layer-skip",
        measured: dict | None = None,
    ):
        self.skip_attn, self.skip_mlp = sorted(set(skip_attn)), sorted(set(skip_mlp))
        self.max_draft, self.threshold, self.plan_name = max_draft, threshold, plan_name
        self.measured = measured or {}

    def call(self, ir: DecoderIR) -> PassResult:
        before = dict(ir.plans)
        ir.add_plan(
            DraftPlan.of(
                name=self.plan_name,
                skip_attn=self.skip_attn,
                skip_mlp=self.skip_mlp,
                measured=dict(self.measured),
                sources={
                    "model": {
                        "max_draft": self.max_draft,
                        "threshold": self.threshold,
                        "target_acceptance": tuned_target(self.measured),
                    }
                },
            )
        )
        return PassResult.after(ir, before)
