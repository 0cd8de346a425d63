"""The draft head wrapper: a trained exit adapter and/or a reduced draft vocabulary (``runtime/artifact/draft_head_file.py``).

Any model draft may end in a draft head instead of the shared head (``DraftKind.head``: the plan's
``draft_head_file``); the verifier always uses the full head, so output is unchanged. What such a head
adds to a draft step, priced from the torch sublayer timings: an exit adapter is a gated MLP of the
model's MLP width (one MLP sublayer); a reduced vocabulary scales the head's product by
``draft_vocab / vocab_size`` (a saving).
"""

from __future__ import annotations


def head_extra(plan, sublayers) -> float:
    """Seconds ``plan``'s draft head adds to one draft step over the shared head (negative: a saving)."""
    extra = sublayers.mlp[0] if plan.head.startswith("adapter:") else 0.0
    if plan.draft_vocab and sublayers.vocab_size:
        extra -= sublayers.head[0] * (1.0 - min(plan.draft_vocab / sublayers.vocab_size, 1.0))
    return extra


def describe(plan) -> str:
    return f" (draft vocabulary {plan.draft_vocab})" if plan.draft_vocab is not None else ""


__all__ = ["describe", "head_extra"]
