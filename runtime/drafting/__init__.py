"""Drafting: every way the runtime proposes tokens for the verifier, behind one interface.

A plan (``DraftPlan``, plain data in the manifest) names its sources: the model part (a draft kind,
``kinds/``, drafting through ``model.ModelDrafter``) and the model-free sources in ``plan.lookup``, tried
in order. Each source is one module with its own options dataclass, stored under the source's name in
``plan.sources`` and checked by the source (``options``); ``SOURCES`` below is the one registry. A new
source is one module (a ``LookupSource`` subclass with an ``Options`` dataclass) plus one line here.

``factory.make_drafter`` composes a plan's sources into the drafter the round runs (``hybrid``,
``tree_lookup``); ``check_plan`` is what loading an artifact checks of a plan beyond its data types.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..artifact.manifest import DraftPlan, Manifest
from ..artifact.schema import build_dataclass
from ..errors import ArtifactError
from .registry import Registry

if TYPE_CHECKING:
    from .base import SourceOptions

SOURCES = Registry(
    "draft source",
    __name__,
    {
        "model": ".model:ModelDrafter",
        "ngram": ".ngram:NgramDrafter",
        "retrieval": ".retrieval:RetrievalDrafter",
        "lookahead": ".lookahead:LookaheadDrafter",
        "logitspec": ".logitspec:LogitSpecDrafter",
        "recycling": ".recycling:RecyclingDrafter",
    },
)
"""Source name -> ``"module:Class"``. ``model`` is the plan's model part; the others may be named in
``plan.lookup``."""


def options(plan: DraftPlan, source: str) -> "SourceOptions":
    """``plan``'s options for ``source`` (``plan.sources[source]``, defaults filled), checked by the source."""
    cls = SOURCES.load(source).Options
    found = build_dataclass(cls, plan.sources.get(source, {}), f"plans[{plan.name[:64]!r}].sources[{source[:64]!r}]")
    found.check(plan)
    return found


def has_model_part(plan: DraftPlan) -> bool:
    """Whether ``plan`` drafts with a subgraph of the model (its draft kind has a model part)."""
    from .kinds import kind_of

    return kind_of(plan).has_model_part


def check_plan(plan: DraftPlan, num_layers: int) -> None:
    """Everything a plan must satisfy to load: its data rules (``DraftPlan.validate``), its kind fits it, its
    sources exist and their options are valid, and it drafts with something. A one-line ``ArtifactError``
    otherwise."""
    from .kinds import kind_of

    plan.validate(num_layers)
    kind = kind_of(plan, num_layers)
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
        options(plan, source)
    if kind.has_model_part:
        model = options(plan, "model")
        if model.branches > 1 and plan.exit_layer is not None:
            raise ArtifactError(
                f"plan {plan.name[:64]!r}: an early exit's verify reuses its draft's prefix, which a "
                "tree's branches do not have; set sources.model.branches to 1"
            )
    elif not plan.lookup:
        raise ArtifactError(
            f"plan {plan.name[:64]!r} drafts with nothing (no skipped sublayers, no exit layer, no "
            "lookup source); rebuild the artifact"
        )
    elif options(plan, "model").branches > 1:
        raise ArtifactError(
            f"plan {plan.name[:64]!r}: sources.model.branches is above 1 but the plan has no model draft; set it to 1"
        )
    if plan.lookup_branches > 1 and kind.has_model_part:
        raise ArtifactError(
            f"plan {plan.name[:64]!r}: token trees (lookup_branches > 1) are drafted by lookup sources "
            "alone; give the plan lookup sources and no model part, or set lookup_branches to 1"
        )


def check_plans(manifest: Manifest) -> None:
    for plan in manifest.plans.values():
        check_plan(plan, manifest.config.num_layers)


def describe(plan: DraftPlan) -> str:
    """One line of what ``plan`` drafts with, for ``inspect`` and messages."""
    from .kinds import kind_of
    from .kinds.draft_head import describe as describe_head

    lookups = [
        SOURCES.load(name).describe(options(plan, name), plan) if name in SOURCES else name for name in plan.lookup
    ]
    if plan.lookup_branches > 1:
        lookups = [
            f"token trees of {' and '.join(lookups)} (up to {plan.lookup_branches} branches each, "
            f"{plan.max_tree_nodes} tokens)"
        ]
    parts = list(lookups)
    kind = kind_of(plan)
    if kind.has_model_part:
        branches = options(plan, "model").branches
        leaves = f", up to {branches - 1} runner-up(s) per drafted token as tree leaves" if branches > 1 else ""
        parts.append(kind.describe() + describe_head(plan) + leaves)
    return ", else ".join(parts) if len(parts) > 1 else (parts[0] if parts else "nothing")


__all__ = ["SOURCES", "check_plan", "check_plans", "describe", "has_model_part", "options"]
