"""The drafter seam: every draft source proposes candidates behind one small interface.

A round of draft-and-verify asks a drafter for a ``Draft`` (candidate tokens, each with the draft
distribution q it was sampled from, or ``None`` for a deterministic source whose q is one-hot), then
verifies ``[token] + draft.tokens`` with the full model and tells the drafter how many were accepted.
The acceptance rule (greedy match, Leviathan/Chen rejection) is written once over drafts, in
``runtime/acceptance.py``; a drafter sees the verifier's rows only when it declares that it
learns from them (``Drafter.observes``).

Here: ``Draft``, ``RoundContext``, the ``Drafter`` interface with its declared capabilities, ``LookupSource``
(what a model-free source adds) and ``SourceOptions`` (a source's options, under its name in the plan).
The sources are one module each beside this one (``model_draft.py``, ``ngram.py``, ``retrieval.py``,
``lookahead.py``, ``logitspec.py``, ``recycling.py``), registered in ``SOURCES`` (``__init__.py``); the
compositions are ``hybrid.py`` (a lookup hit, else the model, extended by a lookup) and ``tree_lookup.py``
(token trees of the lookups); ``factory.make_drafter(plan, ...)`` builds a plan's drafter.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Generator, Sequence

import numpy as np

from ..artifact.manifest import DraftPlan
from ..artifact.schema import REJECT_UNKNOWN
from ..sampling import SamplingParams


@dataclass
class Draft:
    """Candidate tokens for one round.

    ``q[i]`` is the distribution ``tokens[i]`` was sampled from (sampling only), ``None`` where the
    source is deterministic (one-hot q: rejection sampling then accepts with probability p(token)).
    ``reuse`` is how many of the round's inputs (``[token] + tokens[:-1]``) already ran through the
    verifier's prefix blocks (early exit), which the verifier therefore skips. ``sources[i]`` names the
    source of ``tokens[i]``. ``parents``: None for a chain, else a token tree (``runtime/tree.py``):
    ``parents[i]`` is the index of ``tokens[i]``'s parent, -1 for a child of the round's input token.
    """

    tokens: list[int] = field(default_factory=list)
    q: list[np.ndarray | None] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)
    reuse: int = 0
    verify_plan: object | None = None  # the model part's plan, read (``plan.ReadPlan``): its kind verifies
    parents: list[int] | None = None

    @property
    def is_tree(self) -> bool:
        from ..tree import is_chain

        return not is_chain(self.parents)

    @property
    def tree_parents(self) -> list[int]:
        """``parents`` as a tree's, for a chain too (each token the child of the one before)."""
        from ..tree import chain_parents

        return self.parents if self.parents is not None else chain_parents(len(self.tokens))

    def nodes_of(self, tokens: Sequence[int]) -> list[int]:
        """The nodes holding ``tokens`` from the root down, as far as this draft holds them (``tree.follow``)."""
        from ..tree import follow

        return follow(self.tokens, self.tree_parents, tokens)

    def first_branch(self) -> "Draft":
        """A tree's first branch (node 0, then each node's first child) as a chain."""
        if self.parents is None:
            return self
        n = 0
        while n < len(self.parents) and self.parents[n] == n - 1:
            n += 1
        return Draft(self.tokens[:n], self.q[:n], self.sources[:n], self.reuse, self.verify_plan)

    def extend(self, other: "Draft") -> "Draft":
        """This draft followed by ``other`` (a chain, which must not need prefix reuse of its own). A model
        draft's tree (its chain, then leaves beside it: ``ModelDrafter``) continues below the chain's last
        token; the leaves stay where they are in the tree, after the new tokens."""
        if self.parents is None:
            return Draft(
                self.tokens + other.tokens, self.q + other.q, self.sources + other.sources, self.reuse, self.verify_plan
            )
        n, m = len(self.first_branch().tokens), len(other.tokens)
        if any(p >= n for p in self.parents[n:]):
            raise ValueError("only a chain with leaves beside it can be extended")
        return Draft(
            self.tokens[:n] + other.tokens + self.tokens[n:],
            self.q[:n] + other.q + self.q[n:],
            self.sources[:n] + other.sources + self.sources[n:],
            self.reuse,
            self.verify_plan,
            self.parents[:n] + list(range(n - 1, n - 1 + m)) + self.parents[n:],
        )

    @property
    def label(self) -> str:
        """The sources of this round, in order, e.g. ``model+ngram``; ``none`` for an empty draft."""
        seen: list[str] = []
        for source in self.sources:
            if source not in seen:
                seen.append(source)
        return "+".join(seen) or "none"


@dataclass
class RoundContext:
    """What a drafter may look at: the committed tokens (``history[-1]`` is the round's input token,
    at position ``pos``, whose KV is not written yet), how many tokens it may draft, and how many steps its model
    part may run this round (``runtime/decoding/load.py`` decides under load; lookups are always free)."""

    history: Sequence[int]
    pos: int
    limit: int
    params: SamplingParams
    rng: np.random.Generator
    model_steps: int | None = None  # most model draft steps this round (None: the drafter's own limit; 0: none,
    # a batch under load has no time for them)

    @property
    def model_allowed(self) -> bool:
        return self.model_steps != 0


class Drafter:
    """What a round asks of a drafter, and the capabilities it reads (declared here, never probed).

    - ``drafts_trees``: ``propose`` may return a token tree, so rounds verify on the host with a tree mask.
    - ``observes``: the drafter learns from the verifier's rows (``observe``: lookahead's Jacobi window,
      LogitSpec's next-next guesses, Token Recycling's runner-ups), so rounds stay on the host, where
      those rows are.
    - ``model_part`` / ``lookup_part``: what the drafter is made of, for a round that runs the model draft
      and the lookups itself (the torch backend's on-device round).
    - ``steps_on_device``: a model part whose steps such a round can run itself (its ``kind``, ``policy``
      and ``chain`` for the tokens it drafted there).
    - ``ngram_sizes``: a lookup source that is prompt lookup, as ``(min_n, max_n, max_draft, short_n)``, so
      that such a round can look it up over its own token buffer (None: it looks up on the host).
    """

    name: str = ""
    drafts_trees: bool = False
    observes: bool = False
    steps_on_device: bool = False
    ngram_sizes: tuple[int, int, int, int] | None = None

    @property
    def model_part(self) -> "Drafter | None":
        return None

    @property
    def lookup_part(self) -> "Sequence[LookupSource]":
        return ()

    def start(self, prompt: Sequence[int]) -> None:
        """A new sequence begins with ``prompt`` (drafters with per-sequence state reset it)."""

    def propose(self, ctx: RoundContext) -> Draft:
        """Candidates for this round, at most ``ctx.limit`` tokens (an empty draft means a plain step)."""
        raise NotImplementedError

    def drafting(self, ctx: RoundContext) -> Generator[tuple[int, int], object, Draft]:
        """``propose`` as a generator of model draft steps: it yields ``(token, pos)`` for each step it needs,
        is sent back the step's ``(drafted token, confidence, q)``, and returns the draft. A batch runs the
        steps of every sequence's drafter together, one call per step for all (``runtime/decoding/batch.py``);
        ``drive`` runs them one by one. A drafter without a model part needs no step."""
        return self.propose(ctx)
        yield  # a generator that returns at once

    def feedback(self, draft: Draft, accepted: int) -> None:
        """The verifier accepted the first ``accepted`` tokens of ``draft``."""

    def observe(self, draft: Draft, logits, committed: Sequence[int], ctx: RoundContext | None = None) -> None:
        """The verifier's rows of the round (``logits[i]`` follows ``([token] + draft.tokens)[i]``) and the tokens
        it committed. Called only when ``observes``."""


def drive(drafting: Generator[tuple[int, int], object, Draft], step, ctx: RoundContext) -> Draft:
    """Run a drafter's ``drafting`` generator to its draft, each model step through ``step(token, pos, ctx)``."""
    try:
        request = next(drafting)
        while True:
            request = drafting.send(step(*request, ctx))
    except StopIteration as done:
        return done.value


@dataclass
class SourceOptions:
    """A draft source's options: plain JSON under the source's name in ``DraftPlan.sources``, read back as
    this dataclass (defaults filled, types checked like every manifest field) and checked by ``check``."""

    def check(self, plan: DraftPlan) -> None:
        """A one-line ``ArtifactError`` naming the plan when the options are out of range."""


# An option a source does not know is a typo or a newer toolkit's: refuse it rather than draft otherwise than asked.
setattr(SourceOptions, REJECT_UNKNOWN, True)


class LookupSource(Drafter):
    """A model-free source: it drafts from what it has seen (the prompt and output, a datastore, the verifier's
    rows), with a one-hot q. Besides ``propose`` (a chain), the compositions ask it for ``lookup`` (a continuation
    of a model's draft, ``hybrid.py``) and ``continuations`` (several, for token trees, ``tree_lookup.py``)."""

    Options: type[SourceOptions] = SourceOptions

    @property
    def lookup_part(self) -> "Sequence[LookupSource]":
        return (self,)

    @classmethod
    def from_plan(cls, plan, root: Path | None = None) -> "LookupSource":
        """The source as ``plan`` (a ``plan.ReadPlan``: its ``options(name)``) configures it (``root``: the artifact
        folder, for sources that read files)."""
        raise NotImplementedError

    @staticmethod
    def describe(options: SourceOptions, plan: DraftPlan) -> str:
        """The source's part of ``describe(plan)``."""
        return ""

    def lookup(self, history: Sequence[int], tail: Sequence[int], limit: int) -> list[int]:
        """A continuation of ``tail`` (the committed ``history`` plus uncommitted drafts), at most ``limit`` tokens."""
        return []

    def draft_of(self, tokens: Sequence[int]) -> Draft:
        """The draft of ``tokens`` looked up by this source (the device round looks up without ``propose``)."""
        return Draft(tokens=list(tokens), q=[None] * len(tokens), sources=[self.name] * len(tokens))

    def continuations(self, history: Sequence[int], limit: int, most: int) -> list[list[int]]:
        """Up to ``most`` different continuations of ``history`` (the first is ``propose``'s), for token trees."""
        found = self.lookup(history, history, limit)
        return [found] if found else []


class Composite(Drafter):
    """A drafter made of lookup sources (and maybe a model part): it observes when any of its sources does."""

    lookups: list[LookupSource]

    @property
    def lookup_part(self) -> Sequence[LookupSource]:
        return self.lookups

    @property
    def observes(self) -> bool:  # type: ignore[override]
        return any(source.observes for source in self.lookups)

    def observe(self, draft: Draft, logits, committed, ctx=None) -> None:
        for source in self.lookups:
            if source.observes:
                source.observe(draft, logits, committed, ctx)


def remember(items: list, item, most: int) -> None:
    """Put ``item`` first in ``items`` (moved there if it is already in), keeping the ``most`` most recent: the
    bounded most-recent-first lists of the sources that learn from the verifier (lookahead's pool, Token
    Recycling's successors)."""
    if item in items:
        items.remove(item)
    items.insert(0, item)
    del items[most:]


__all__ = ["Composite", "Draft", "Drafter", "LookupSource", "RoundContext", "SourceOptions", "remember"]
