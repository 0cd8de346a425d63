"""Hybrid drafting: per round, a lookup hit when there is one, the model's own draft otherwise.

A lookup draft costs almost nothing, so when a model-free source (n-gram, retrieval; tried in the
plan's order) has a continuation, the round uses it; otherwise the model's subgraph drafts, and a lookup
continuation of the model's draft may extend it (the model's tokens then form the lookup's query). With
no model subgraph in the plan a round without a hit is a plain step. Whether a plan has a model part,
its draft lengths and the n-gram sizes are chosen at build time by the expected-speedup objective,
replaying this same class over the calibration continuations.
"""

from __future__ import annotations

from typing import Sequence

from .drafter import Composite, Draft, LookupSource, RoundContext, drive
from .model_draft import ModelDrafter


class HybridDrafter(Composite):
    name = "hybrid"

    def __init__(self, lookups: list[LookupSource], model: ModelDrafter | None = None, extend: bool = True):
        self.lookups, self.model, self.extend = lookups, model, extend

    def start(self, prompt: Sequence[int]) -> None:
        for source in self._sources():
            source.start(prompt)

    @property
    def drafts_trees(self) -> bool:  # type: ignore[override]
        return self.model is not None and self.model.drafts_trees

    @property
    def model_part(self) -> ModelDrafter | None:
        return self.model

    def _sources(self):
        return self.lookups + ([self.model] if self.model is not None else [])

    def propose(self, ctx: RoundContext) -> Draft:
        return drive(self.drafting(ctx), self.model.step if self.model is not None else None, ctx)

    def drafting(self, ctx: RoundContext):
        for source in self.lookups:
            draft = source.propose(ctx)
            if draft.tokens:
                return draft
        if self.model is None or not ctx.model_allowed:
            return Draft()
        draft = yield from self.model.drafting(ctx)
        room = ctx.limit - len(draft.tokens)
        if self.extend and room > 0 and draft.tokens:
            tail = list(ctx.history[-8:]) + draft.first_branch().tokens  # a model tree's chain, not its leaves
            for source in self.lookups:
                more = source.lookup(ctx.history, tail, room)
                if more:
                    return draft.extend(Draft(more, [None] * len(more), [source.name] * len(more)))
        return draft

    def feedback(self, draft: Draft, accepted: int) -> None:
        if self.model is not None and self.model.name in draft.sources:
            self.model.feedback(draft, accepted)
