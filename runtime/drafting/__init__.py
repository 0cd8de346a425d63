"""Drafting: every way the runtime proposes tokens for the verifier, behind one interface.

A plan (``DraftPlan``, plain data in the manifest) names its sources: the model part (a draft kind,
``kinds/``, drafting through ``model_draft.ModelDrafter``) and the model-free sources in ``plan.lookup``, tried
in order. Each source is one module with its own options dataclass, stored under the source's name in
``plan.sources`` and checked by the source; ``SOURCES`` (``sources.py``) is the one registry. A new source is
one module (a ``LookupSource`` subclass with an ``Options`` dataclass) plus one line there.

``check_plan`` is what loading an artifact checks of a plan beyond its data types; it returns the plan read
once (``plan.ReadPlan``: its kind and each source's options), which everything after loading takes.
``factory.make_drafter`` composes a read plan's sources into the drafter the round runs (``hybrid``,
``tree_lookup``). ``options``, ``has_model_part`` and ``describe`` here are conveniences for code that holds a
plan's data (the tuner's candidates): each reads the plan first.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..artifact.manifest import DraftPlan, Manifest
from ..errors import ArtifactError
from .plan import ReadPlan, read_plan, read_plans
from .sources import SOURCES

if TYPE_CHECKING:
    from .drafter import SourceOptions


def options(plan: "DraftPlan | ReadPlan", source: str) -> "SourceOptions":
    """``plan``'s options for ``source``, checked by the source (``ReadPlan.options``; a ``DraftPlan`` is read
    first). For code that holds a plan's data only; a read plan answers ``plan.options(source)`` itself."""
    return read_plan(plan).options(source)


def has_model_part(plan: "DraftPlan | ReadPlan") -> bool:
    """Whether ``plan`` drafts with a subgraph of the model (its draft kind has a model part)."""
    return read_plan(plan).has_model_part


def describe(plan: "DraftPlan | ReadPlan") -> str:
    """One line of what ``plan`` drafts with, for ``inspect`` and messages (``ReadPlan.describe``)."""
    return read_plan(plan).describe()


def check_plan(plan: DraftPlan, num_layers: int) -> ReadPlan:
    """Everything a plan must satisfy to load: its data rules (``DraftPlan.validate``), its kind fits it, its
    sources exist and their options are valid, and it drafts with something; the plan read (``ReadPlan``). A
    one-line ``ArtifactError`` otherwise."""
    plan.validate(num_layers)
    read = ReadPlan(plan, num_layers)
    kind = read.kind
    kind.check()
    unknown = sorted(set(plan.sources) - set(SOURCES))
    if unknown:
        raise ArtifactError(
            f"plan {plan.name[:64]!r} has options for draft sources {unknown} that this runtime does not "
            f"know (known: {', '.join(SOURCES)}); upgrade speccompile"
        )
    if "model" in plan.lookup:
        raise ArtifactError(
            f"plan {plan.name[:64]!r} lists 'model' among its lookup sources; the model part is the "
            "plan's draft kind: rebuild the artifact"
        )
    for source in plan.lookup:
        read.options(source)
    if kind.has_model_part:
        if read.model.branches > 1 and plan.exit_layer is not None:
            raise ArtifactError(
                f"plan {plan.name[:64]!r}: an early exit's verify reuses its draft's prefix, which a "
                "tree's branches do not have; set sources.model.branches to 1"
            )
    elif not plan.lookup:
        raise ArtifactError(
            f"plan {plan.name[:64]!r} drafts with nothing (no skipped sublayers, no exit layer, no "
            "lookup source); rebuild the artifact"
        )
    elif read.model.branches > 1:
        raise ArtifactError(
            f"plan {plan.name[:64]!r}: sources.model.branches is above 1 but the plan has no model draft; set it to 1"
        )
    if plan.lookup_branches > 1 and kind.has_model_part:
        raise ArtifactError(
            f"plan {plan.name[:64]!r}: token trees (lookup_branches > 1) are drafted by lookup sources "
            "alone; give the plan lookup sources and no model part, or set lookup_branches to 1"
        )
    return read


def check_plans(manifest: Manifest) -> dict[str, ReadPlan]:
    """Every plan of ``manifest`` checked (``check_plan``) and read, by name."""
    return {name: check_plan(plan, manifest.config.num_layers) for name, plan in manifest.plans.items()}


__all__ = [
    "SOURCES",
    "ReadPlan",
    "check_plan",
    "check_plans",
    "describe",
    "has_model_part",
    "options",
    "read_plan",
    "read_plans",
]
