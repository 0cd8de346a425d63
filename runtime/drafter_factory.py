"""From a plan (data, in the manifest) to its drafter: the model part, the lookup sources, or both.

Kept apart from the drafter interface (``runtime/drafters.py``) so that every source module, the hybrid
included, imports the interface and nothing imports back.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from .drafters import DraftPolicy, DraftStep, ModelDrafter
from .errors import ArtifactError
from .hybrid import HybridDrafter
from .manifest import DraftPlan

# Model-free sources by name: module (relative to this package) and class. A new source is one file
# plus one line here.
LOOKUP_SOURCES = {"ngram": ("ngram", "NgramDrafter"), "retrieval": ("retrieval", "RetrievalDrafter"),
                  "lookahead": ("lookahead", "LookaheadDrafter"), "logitspec": ("logitspec", "LogitSpecDrafter"),
                  "recycling": ("recycling", "RecyclingDrafter")}


def lookup_drafter(source: str, plan: DraftPlan, root: Path | None):
    if source not in LOOKUP_SOURCES:
        raise ArtifactError(f"plan {plan.name!r} uses draft source {source[:64]!r}, which this runtime does not know "
                            f"(known: {', '.join(LOOKUP_SOURCES)}); upgrade speccompile")
    module, cls = LOOKUP_SOURCES[source]
    return getattr(importlib.import_module(f".{module}", __package__), cls).from_plan(plan, root)


def make_drafter(plan: DraftPlan, step: DraftStep | None, root: Path | None = None, max_draft: int | None = None):
    """The drafter a plan describes: its model subgraph (through ``step``), its lookups, or both."""
    model = ModelDrafter(plan, step, DraftPolicy.from_plan(plan, max_draft)) if plan.has_model_draft else None
    lookups = [lookup_drafter(source, plan, root) for source in plan.lookup]
    if plan.lookup_branches > 1 and model is None:  # token trees over the lookup sources (runtime/tree_lookup.py)
        from .tree_lookup import TreeLookupDrafter

        return TreeLookupDrafter(lookups, plan.lookup_branches, plan.max_tree_nodes)
    if model is not None and not lookups:
        return model
    return HybridDrafter(lookups, model, extend=plan.extend)


__all__ = ["LOOKUP_SOURCES", "lookup_drafter", "make_drafter"]
