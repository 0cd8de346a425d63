"""From a plan (data, in the manifest) to its drafter: the model part, the lookup sources, or both.

Kept apart from the drafter interface (``drafter.py``) so that every source module, the compositions
included, imports the interface and nothing imports back.
"""

from __future__ import annotations

from pathlib import Path

from ..artifact.manifest import DraftPlan
from . import SOURCES
from .drafter import Drafter, LookupSource
from .hybrid import HybridDrafter
from .model_draft import DraftPolicy, DraftStep, ModelDrafter
from .plan import ReadPlan, read_plan
from .tree_lookup import TreeLookupDrafter


def lookup_drafter(source: str, plan: DraftPlan | ReadPlan, root: Path | None) -> LookupSource:
    """The model-free source ``source`` as ``plan`` configures it (``root``: the artifact, for files it reads)."""
    return SOURCES.load(source).from_plan(read_plan(plan), root)


def make_drafter(
    plan: DraftPlan | ReadPlan, step: DraftStep | None, root: Path | None = None, max_draft: int | None = None
) -> Drafter:
    """The drafter a plan describes: its model subgraph (through ``step``), its lookups, or both."""
    plan = read_plan(plan)
    model = ModelDrafter(plan, step, DraftPolicy.from_plan(plan, max_draft)) if plan.has_model_part else None
    lookups = [lookup_drafter(source, plan, root) for source in plan.lookup]
    if plan.lookup_branches > 1 and model is None:  # token trees over the lookup sources
        return TreeLookupDrafter(lookups, plan.lookup_branches, plan.max_tree_nodes)
    if model is not None and not lookups:
        return model
    return HybridDrafter(lookups, model, extend=plan.extend)


__all__ = ["lookup_drafter", "make_drafter"]
