"""A draft plan read once: the typed object everything past loading takes.

A manifest holds each plan as plain data (``DraftPlan``, the artifact layer, which knows nothing of
drafting). Reading it means building its draft kind (``kinds/``) and each source's options dataclass
(checked by the source); ``ReadPlan`` does that once, when an artifact is loaded or a tuner hands a
candidate to the cost model, and the drafter factory, the drafters, cache sizing, the load policy, the
backends' segment checks and the cost model take it. The plan's data fields read through, read-only
(``plan.name``, ``plan.lookup``, ``plan.lookup_max_draft``...: ``READ_THROUGH``), so code that only reads data
does not care which it holds.

``read_plan`` is the one conversion: the identity on a ``ReadPlan`` already read with the same layer count,
a read otherwise. Public entry points (``backend_drafter``, ``cache_length``, the cost model) call it, so
a caller may still pass a ``DraftPlan``; inside, nothing parses a plan's options again.
"""

from __future__ import annotations

import dataclasses
from operator import attrgetter
from typing import TYPE_CHECKING, Any

from ..artifact.manifest import MODEL_PARAMS, DraftPlan
from ..artifact.schema import build_dataclass

if TYPE_CHECKING:
    from .drafter import SourceOptions
    from .kinds.draft_kind import DraftKind


class ReadPlan:
    """``data`` (the manifest's plan), its draft ``kind`` (built for ``num_layers`` blocks: None where no
    segment is asked for), and its sources' options, each read once (``options``; ``model`` is the model
    part's). Read-only: ``replace`` and ``with_options`` read a changed copy."""

    __slots__ = ("data", "num_layers", "kind", "_options")

    def __init__(self, data: DraftPlan, num_layers: int | None = None):
        from .kinds import kind_of

        self.data, self.num_layers = data, num_layers
        self.kind: DraftKind = kind_of(data, num_layers)
        self._options: dict[str, SourceOptions] = {}

    def __repr__(self) -> str:
        return f"ReadPlan({self.data.name!r}, kind={self.kind.name!r})"

    def options(self, source: str) -> "SourceOptions":
        """``source``'s options (``data.sources[source]`` with the source's defaults filled in), checked by the
        source: a one-line ``ArtifactError`` when they do not fit. Read on first use, then kept."""
        found = self._options.get(source)
        if found is None:
            from .sources import SOURCES

            cls = SOURCES.load(source).Options
            where = f"plans[{self.data.name[:64]!r}].sources[{source[:64]!r}]"
            found = build_dataclass(cls, self.data.sources.get(source, {}), where)
            found.check(self.data)
            self._options[source] = found
        return found

    @property
    def model(self) -> "SourceOptions":
        """The model part's options, a ``model_draft.ModelOptions`` (their defaults for a plan without a model part)."""
        return self.options("model")

    @property
    def has_model_part(self) -> bool:
        return self.kind.has_model_part

    @property
    def longest_draft(self) -> int:
        """The longest chain a round verifies besides its input token (at least 1): what the load policy prices
        and ``CallCosts`` times."""
        lengths = [1, self.data.lookup_max_draft if self.data.lookup else 0]
        if self.has_model_part:
            lengths.append(self.model.max_draft)
        return max(lengths)

    def draft_room(self, max_draft: int | None = None) -> int:
        """Most tokens one round may draft (what the KV cache must hold beyond the output)."""
        room = (max_draft or self.model.max_draft) * self.model.branches if self.has_model_part else 0
        return room + (self.data.max_tree_nodes if self.data.lookup else 0)

    def replace(self, **changes: Any) -> "ReadPlan":
        """A copy with ``changes`` to the data's fields, read again."""
        return ReadPlan(dataclasses.replace(self.data, **changes), self.num_layers)

    def with_options(self, **changes: dict[str, Any]) -> "ReadPlan":
        """A copy whose ``sources[name]`` has ``changes[name]`` merged in, read again."""
        return ReadPlan(self.data.with_options(**changes), self.num_layers)

    def describe(self) -> str:
        """One line of what the plan drafts with, for ``inspect`` and messages."""
        from .kinds.draft_head import describe as describe_head
        from .sources import SOURCES

        data = self.data
        lookups = [
            SOURCES.load(name).describe(self.options(name), data) if name in SOURCES else name for name in data.lookup
        ]
        if data.lookup_branches > 1:
            lookups = [
                f"token trees of {' and '.join(lookups)} (up to {data.lookup_branches} branches each, "
                f"{data.max_tree_nodes} tokens)"
            ]
        parts = list(lookups)
        if self.has_model_part:
            branches = self.model.branches
            leaves = f", up to {branches - 1} runner-up(s) per drafted token as tree leaves" if branches > 1 else ""
            parts.append(self.kind.describe() + describe_head(data) + leaves)
        return ", else ".join(parts) if len(parts) > 1 else (parts[0] if parts else "nothing")


READ_THROUGH = (
    tuple(f.name for f in dataclasses.fields(DraftPlan) if f.name != "kind")
    + tuple(MODEL_PARAMS)
    + ("max_tree_nodes", "is_early_exit")
)
"""The data's fields, its shared model options (``MODEL_PARAMS``) and derived values a read plan answers itself
(read-only); ``kind`` is the draft kind object here (its name: ``kind.name``)."""
for _name in READ_THROUGH:
    setattr(ReadPlan, _name, property(attrgetter(f"data.{_name}"), doc=f"``data.{_name}``"))


def read_plan(plan: DraftPlan | ReadPlan, num_layers: int | None = None) -> ReadPlan:
    """``plan`` read (see the module docstring): the same object when it is already read for ``num_layers``
    blocks (or ``num_layers`` is None)."""
    if isinstance(plan, ReadPlan):
        if num_layers is None or plan.num_layers == num_layers:
            return plan
        return ReadPlan(plan.data, num_layers)
    return ReadPlan(plan, num_layers)


def read_plans(plans: dict[str, DraftPlan | ReadPlan], num_layers: int | None = None) -> dict[str, ReadPlan]:
    return {name: read_plan(plan, num_layers) for name, plan in plans.items()}


__all__ = ["ReadPlan", "read_plan", "read_plans"]
