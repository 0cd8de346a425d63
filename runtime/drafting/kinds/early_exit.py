"""Early exit with prefix reuse (LayerSkip, Kangaroo): draft with blocks 0..E-1 and a head.

Blocks 0..E-1 run exactly as the full model runs them, so their KV entries and the hidden states at E
are the verifier's own (docs/design.md section 2). Each draft step keeps its hidden state at its position;
the verify then runs blocks 0..E-1 only on the round's inputs the draft did not run (the last drafted
token), and blocks E..L-1 on all of them from the kept states. A backend that cannot keep hidden states
across calls (``Backend.reuses_prefix``) verifies with the full model instead.
"""

from __future__ import annotations

from ...errors import ArtifactError
from ...segments import FINAL_HEAD, Segment
from .draft_kind import HEAD_PARAMS, DraftKind


class EarlyExit(DraftKind):
    name = "early_exit"
    param_keys = ("exit_layer", *HEAD_PARAMS)

    def check(self) -> None:
        super().check()
        if self.plan.exit_layer is None:
            raise ArtifactError(
                f"plan {self.plan.name[:64]!r} is an early exit with no params.exit_layer; name the block to exit "
                "after, or rebuild the artifact"
            )

    @property
    def exit_layer(self) -> int:
        return self.plan.exit_layer

    @property
    def draft_segment(self) -> Segment:
        return Segment(0, self.exit_layer, head=self.head, keep_hidden=True)

    @property
    def prefix(self) -> Segment:
        return Segment(0, self.exit_layer, head=None, keep_hidden=True)

    @property
    def suffix(self) -> Segment:
        return Segment(self.exit_layer, self.layers, head=FINAL_HEAD)

    def segments(self):
        return [self.draft_segment, self.prefix, self.suffix]

    def verify(self, backend, tokens, pos, reuse):
        if not backend.reuses_prefix:
            return backend.forward(tokens, pos)
        fresh = list(tokens[reuse:])
        if fresh:
            backend.run(self.prefix, pos + reuse, tokens=fresh)
        return backend.run(self.suffix, pos, count=len(tokens))

    def reuse(self, drafted: int) -> int:
        # The prefix ran on the round's input token and every drafted token but the last.
        return drafted

    def verify_calls(self, tokens: int, reuse: int):
        return [(self.prefix, tokens - reuse), (self.suffix, tokens)]

    def estimate_hidden(self, estimator):
        # The prefix is the full model's own: the reference pass's hidden states after block E are exact.
        return estimator.reference_hidden(self.exit_layer)

    def describe(self) -> str:
        adapter = " + trained adapter" if self.plan.head.startswith("adapter:") else ""
        return f"early exit after block {self.exit_layer}{adapter}"


__all__ = ["EarlyExit"]
