"""Draft kinds: one module per way of drafting with the model, and the registry that picks one.

``kind_of(plan, num_layers)`` builds the plan's kind once: the ``kind`` the plan names, or, for plans
that name none, the first built-in kind that ``matches`` it. A new kind is one module plus one line in
``KINDS``; its options live in the plan's ``params``.
"""

from __future__ import annotations

from ...artifact.manifest import DraftPlan
from ...errors import ArtifactError
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
"""Kind name -> ``"module:Class"`` (``.name`` in this package, or an absolute module). Kinds a plan does not
name are inferred, tried in this order."""


def kind_class(name: str) -> type[DraftKind]:
    return KINDS.load(name)


def kind_of(plan: DraftPlan, num_layers: int | None = None) -> DraftKind:
    """The draft kind of ``plan`` (``num_layers``: the model's block count, needed by kinds that run
    the model's later blocks)."""
    if plan.kind is not None:
        return kind_class(plan.kind)(plan, num_layers)
    for name in KINDS:
        cls = kind_class(name)
        if cls.matches(plan):
            return cls(plan, num_layers)
    raise ArtifactError(f"plan {plan.name[:64]!r} matches no draft kind; rebuild the artifact")


__all__ = ["KINDS", "DraftKind", "kind_class", "kind_of"]
