"""Precision self-drafts: the model drafts for itself with weight-only quantized products (int8 / int4).

The draft is the model's own graph (every block, or the plan's early exit or skipped sublayers) with each
linear layer's weights quantized (in blocks, ``MatMulNBits``, on ONNX Runtime; per output channel, int8 only,
in the decoder's int8 twin on torch: ``runtime/backends/torch/int8_twin.py``), verified by the untouched
full-precision model, so the output stays the full model's. Like a layer-skip draft it needs no cache of
its own: it reads the verifier's KV at every accepted position and writes its own only at the positions it
drafts, which the verify then rewrites (docs/design.md section 3). Nothing is reused by the verify: the draft's
hidden states are not the full model's.

Options live in the plan's ``params``: ``precision`` (``"int4"`` or ``"int8"``), ``block_size`` (default 32) and
``symmetric`` (default False); ``exit_layer`` / ``skip_attn`` / ``skip_mlp`` there make it an int4 early exit or
layer skip, and a draft head (``draft_head.py``) may end it. A backend without a kernel for the scheme refuses the
plan before any work (torch refuses int4: its CPU int4 product is slower than the fp32 one,
``runtime/backends/torch/int8_twin.py``; the standard ONNX graphs have no ``MatMulNBits`` draft). Tuned by
``passes/precision_tune.py``.
"""

from __future__ import annotations

from ...errors import ArtifactError
from ...segments import Segment
from .draft_kind import HEAD_PARAMS, DraftKind

SCHEMES = ("int4", "int8")


def precision_of(params: dict) -> str:
    """The segment's precision string for a plan's ``params``: ``int4``, ``int4/b128``, ``int8/b32s``, ..."""
    scheme = params.get("precision", "int4")
    if scheme not in SCHEMES:
        raise ArtifactError(
            f"precision draft: params.precision {str(scheme)[:16]!r} must be one of {', '.join(SCHEMES)}; "
            "rebuild the artifact"
        )
    block = params.get("block_size", 32)
    if not isinstance(block, int) or block < 16 or block & (block - 1):
        raise ArtifactError(f"precision draft: params.block_size must be a power of two >= 16, not {block!r}")
    symmetric = bool(params.get("symmetric", False))
    if block == 32 and not symmetric:
        return scheme
    return f"{scheme}/b{block}{'s' if symmetric else ''}"


class PrecisionDraft(DraftKind):
    name = "precision"
    param_keys = ("precision", "block_size", "symmetric", "exit_layer", "skip_attn", "skip_mlp", *HEAD_PARAMS)

    def check(self) -> None:
        super().check()
        precision_of(self.plan.params)

    @property
    def draft_segment(self) -> Segment:
        stop = self.plan.exit_layer if self.plan.exit_layer is not None else self.layers
        return Segment(
            0,
            stop,
            frozenset(self.plan.skip_attn),
            frozenset(self.plan.skip_mlp),
            self.head,
            precision=precision_of(self.plan.params),
        )

    def describe(self) -> str:
        part = (
            f"early exit after block {self.plan.exit_layer - 1}" if self.plan.exit_layer is not None else "every block"
        )
        if self.plan.skip_attn or self.plan.skip_mlp:
            part += f" less {len(self.plan.skip_attn)} attention + {len(self.plan.skip_mlp)} MLP sublayers"
        return f"{part} with {precision_of(self.plan.params)} weights (a precision self-draft)"


__all__ = ["PrecisionDraft", "SCHEMES", "precision_of"]
