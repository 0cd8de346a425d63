"""Layer skip (Draft & Verify, SWIFT): every block runs, less the plan's skipped attention / MLP sublayers.

The draft writes KV only for the sublayers it runs, at the positions it drafts; the full-model verify
rewrites every layer at those positions, so no stale draft entry survives (docs/design.md section 3). The
verify reuses nothing.
"""

from __future__ import annotations

from ...segments import Segment
from .draft_kind import HEAD_PARAMS, DraftKind


class LayerSkip(DraftKind):
    name = "layer_skip"
    param_keys = ("skip_attn", "skip_mlp", *HEAD_PARAMS)

    @property
    def draft_segment(self) -> Segment:
        return Segment(0, self.layers, frozenset(self.plan.skip_attn), frozenset(self.plan.skip_mlp), self.head)

    def describe(self) -> str:
        return f"skip {len(self.plan.skip_attn)} attention + {len(self.plan.skip_mlp)} MLP sublayers"


__all__ = ["LayerSkip"]
