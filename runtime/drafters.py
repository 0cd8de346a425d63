"""The drafter seam: every draft source proposes candidates behind one small interface.

A round of draft-and-verify asks a drafter for a ``Draft`` (candidate tokens, each with the draft
distribution q it was sampled from, or ``None`` for a deterministic source whose q is one-hot), then
verifies ``[token] + draft.tokens`` with the full model and tells the drafter how many were accepted.
The acceptance rule (greedy match, Leviathan/Chen rejection) is written once over drafts, in
``runtime/speculative.py``; a drafter never sees logits of the verifier.

Sources (one file each):
- ``ModelDrafter`` (here): a plan's subgraph of the model itself (its draft kind,
  ``runtime/draft_kinds/``); its draft steps go through a ``DraftStep``, which the runtime backs with
  the backend and the tuner backs with a precomputed profile, so both replay the *same* policy object.
- ``runtime/ngram.py``: prompt lookup over the prompt and the text generated so far.
- ``runtime/retrieval.py``: lookup in a datastore built from calibration text at build time.
- ``runtime/hybrid.py``: per round, a lookup hit when there is one, the model's draft otherwise, and a
  lookup continuation that extends the model's draft.

``runtime/drafter_factory.py``'s ``make_drafter(plan, ...)`` turns a plan (data, in the manifest) into its
drafter.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence

import numpy as np

from .manifest import DraftPlan
from .sampling import SamplingParams, probabilities, sample, softmax


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
    verify_plan: DraftPlan | None = None
    parents: list[int] | None = None

    @property
    def is_tree(self) -> bool:
        from .tree import is_chain

        return not is_chain(self.parents)

    @property
    def tree_parents(self) -> list[int]:
        """``parents`` as a tree's, for a chain too (each token the child of the one before)."""
        from .tree import chain_parents

        return self.parents if self.parents is not None else chain_parents(len(self.tokens))

    def nodes_of(self, tokens: Sequence[int]) -> list[int]:
        """The nodes holding ``tokens`` from the root down, as far as this draft holds them (``tree.follow``)."""
        from .tree import follow

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
        """This draft followed by ``other`` (which must not need prefix reuse of its own)."""
        return Draft(self.tokens + other.tokens, self.q + other.q, self.sources + other.sources, self.reuse,
                     self.verify_plan)

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
    at position ``pos``, whose KV is not written yet) and how many tokens it may draft."""

    history: Sequence[int]
    pos: int
    limit: int
    params: SamplingParams
    rng: np.random.Generator


class Drafter(Protocol):
    name: str

    def start(self, prompt: Sequence[int]) -> None:
        """A new sequence begins with ``prompt`` (drafters with per-sequence state reset it)."""

    def propose(self, ctx: RoundContext) -> Draft:
        """Candidates for this round, at most ``ctx.limit`` tokens (an empty draft means a plain step)."""

    def feedback(self, draft: Draft, accepted: int) -> None:
        """The verifier accepted the first ``accepted`` tokens of ``draft``."""


class ObservesSources:
    """For drafters made of lookup sources (``self.lookups``): the sources that learn from the verifier's
    outputs (``observe``: lookahead's Jacobi window, LogitSpec's next-next guesses) see every round's rows.
    ``observes`` tells the decode loop to keep such rounds on the host."""

    lookups: list

    @property
    def observes(self) -> bool:
        return any(hasattr(source, "observe") for source in self.lookups)

    def observe(self, draft: "Draft", logits, committed, ctx=None) -> None:
        for source in self.lookups:
            if hasattr(source, "observe"):
                source.observe(draft, logits, committed, ctx)


class DraftStep(Protocol):
    def __call__(self, token: int, pos: int, ctx: RoundContext) -> tuple[int, float, np.ndarray | None]:
        """Draft the token after ``token`` (at ``pos``): (drafted token, confidence, q or None when greedy)."""


@dataclass
class DraftPolicy:
    """Adaptive draft length (Draft & Verify): stop drafting when the draft's top-1 probability falls
    below ``threshold`` or at ``max_draft``; the threshold rises when acceptance falls below
    ``target_acceptance`` and falls when it is above."""

    max_draft: int
    threshold: float = 0.0
    adaptive: bool = True
    target_acceptance: float = 0.6
    step: float = 0.02

    @classmethod
    def from_plan(cls, plan: DraftPlan, max_draft: int | None = None) -> "DraftPolicy":
        return cls(max_draft=max_draft or plan.max_draft, threshold=plan.threshold, adaptive=plan.adaptive,
                   target_acceptance=plan.target_acceptance)

    def update(self, drafted: int, accepted: int) -> None:
        if not self.adaptive or drafted == 0:
            return
        if accepted / drafted < self.target_acceptance:
            self.threshold = min(self.threshold + self.step, 0.95)
        else:
            self.threshold = max(self.threshold - self.step, 0.0)


class BackendStep:
    """A model draft step of ``plan``'s kind on the backend (what the runtime uses)."""

    def __init__(self, backend, plan: DraftPlan):
        from .draft_kinds import kind_of

        self.backend, self.kind = backend, kind_of(plan, backend.config.num_layers)

    def __call__(self, token: int, pos: int, ctx: RoundContext) -> tuple[int, float, np.ndarray | None]:
        logits = self.kind.draft(self.backend, token, pos)
        if ctx.params.greedy:
            drafted = int(np.argmax(logits))
            return drafted, float(softmax(logits)[drafted]), None
        q = probabilities(logits, ctx.params)
        drafted = sample(q, ctx.rng)
        return drafted, float(q.max()), q


class ModelDrafter:
    """Drafts with a plan's subgraph of the model (layer skip or early exit) under a ``DraftPolicy``."""

    name = "model"

    def __init__(self, plan: DraftPlan, step: DraftStep, policy: DraftPolicy):
        from .draft_kinds import kind_of

        self.plan, self.step, self.policy = plan, step, policy
        self.kind = kind_of(plan)

    def start(self, prompt: Sequence[int]) -> None:
        pass

    def propose(self, ctx: RoundContext) -> Draft:
        draft = Draft(verify_plan=self.plan)
        current = ctx.history[-1]
        for j in range(min(self.policy.max_draft, ctx.limit)):
            current, confidence, q = self.step(current, ctx.pos + j, ctx)
            draft.tokens.append(current)
            draft.q.append(q)
            draft.sources.append(self.name)
            if confidence < self.policy.threshold:
                break
        draft.reuse = self.kind.reuse(len(draft.tokens))
        return draft

    def feedback(self, draft: Draft, accepted: int) -> None:
        drafted = draft.sources.count(self.name)
        self.policy.update(drafted, min(accepted, drafted))


__all__ = ["BackendStep", "Draft", "DraftPolicy", "DraftStep", "Drafter", "ModelDrafter", "ObservesSources",
           "RoundContext"]
