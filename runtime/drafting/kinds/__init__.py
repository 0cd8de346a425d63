"""Draft kinds: one module per way of drafting with the model, and the registry that picks one.

``kind_of(plan, num_layers)`` builds the kind the plan names (every plan names one: an older manifest's plan
that named none is given one when it is read, ``runtime/artifact/legacy.py``). A new kind is one module plus
one line in ``KINDS``; its options live in the plan's ``params``.
"""

from __future__ import annotations

from ...artifact.manifest import DraftPlan
from ...registry import Registry
from .draft_kind import DraftKind

KINDS = Registry(
    "draft kind",
    __name__,
    {
        "early_exit": ".early_exit:EarlyExit",
        "layer_skip": ".layer_skip:LayerSkip",
        "lookup": ".lookup:LookupOnly",
        "precision": ".precision:PrecisionDraft",
    },
)
"""Kind name -> ``"module:Class"`` (``.name`` in this package, or an absolute module)."""


def kind_class(name: str) -> type[DraftKind]:
    return KINDS.load(name)


def kind_of(plan: DraftPlan, num_layers: int | None = None) -> DraftKind:
    """The draft kind ``plan`` names (``num_layers``: the model's block count, needed by kinds that run the
    model's later blocks); a one-line ``ArtifactError`` for a kind this runtime does not know."""
    return kind_class(plan.kind)(plan, num_layers)


__all__ = ["KINDS", "DraftKind", "kind_class", "kind_of"]
