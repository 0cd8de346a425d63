"""A draft source written outside the runtime, for ``tests/test_drafting_seam.py``: what adding a source costs.

It drafts by following, from the round's input token, the token that most recently came after each token in
the sequence so far, for up to ``length`` tokens. This file plus one ``SOURCES`` entry is all of it: its options
live under its name in the plan's ``sources`` and are checked here, read once with the plan (``ReadPlan.options``);
no other runtime file learns about it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from speccompile.runtime.artifact.manifest import DraftPlan
from speccompile.runtime.drafting import ReadPlan
from speccompile.runtime.drafting.drafter import Draft, LookupSource, RoundContext, SourceOptions
from speccompile.runtime.errors import ArtifactError


@dataclass
class SuccessorOptions(SourceOptions):
    length: int = 3

    def check(self, plan: DraftPlan) -> None:
        if not 1 <= self.length <= 16:
            raise ArtifactError(f"plan '{plan.name}': sources.successor.length must be in 1..16, got {self.length}")


class SuccessorDrafter(LookupSource):
    name = "successor"
    Options = SuccessorOptions

    def __init__(self, length: int):
        self.length, self.after = length, {}

    @classmethod
    def from_plan(cls, plan: ReadPlan, root=None) -> "SuccessorDrafter":
        return cls(plan.options("successor").length)

    @staticmethod
    def describe(found: SuccessorOptions, plan: DraftPlan) -> str:
        return f"latest successors ({found.length} tokens)"

    def start(self, prompt: Sequence[int]) -> None:
        self.after, self.seen = {}, 0

    def lookup(self, history: Sequence[int], tail: Sequence[int], limit: int) -> list[int]:
        for i in range(max(self.seen - 1, 0), len(history) - 1):
            self.after[int(history[i])] = int(history[i + 1])
        self.seen = len(history)
        found, token = [], int(tail[-1])
        while len(found) < min(limit, self.length) and token in self.after:
            token = self.after[token]
            found.append(token)
        return found

    def propose(self, ctx: RoundContext) -> Draft:
        tokens = self.lookup(ctx.history, ctx.history, ctx.limit)
        return Draft(tokens, [None] * len(tokens), [self.name] * len(tokens))
