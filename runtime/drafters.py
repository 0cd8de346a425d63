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
from .sampling import SamplingParams, probabilities, sample


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
        """This draft followed by ``other`` (a chain, which must not need prefix reuse of its own). A model
        draft's tree (its chain, then leaves beside it: ``ModelDrafter``) continues below the chain's last
        token; the leaves stay where they are in the tree, after the new tokens."""
        if self.parents is None:
            return Draft(self.tokens + other.tokens, self.q + other.q, self.sources + other.sources, self.reuse,
                         self.verify_plan)
        n, m = len(self.first_branch().tokens), len(other.tokens)
        if any(p >= n for p in self.parents[n:]):
            raise ValueError("only a chain with leaves beside it can be extended")
        return Draft(self.tokens[:n] + other.tokens + self.tokens[n:], self.q[:n] + other.q + self.q[n:],
                     self.sources[:n] + other.sources + self.sources[n:], self.reuse, self.verify_plan,
                     self.parents[:n] + list(range(n - 1, n - 1 + m)) + self.parents[n:])

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


def remember(items: list, item, most: int) -> None:
    """Put ``item`` first in ``items`` (moved there if it is already in), keeping the ``most`` most recent: the
    bounded most-recent-first lists of the sources that learn from the verifier (lookahead's pool, Token
    Recycling's successors)."""
    if item in items:
        items.remove(item)
    items.insert(0, item)
    del items[most:]


class DraftStep(Protocol):
    def __call__(self, token: int, pos: int, ctx: RoundContext) -> tuple[int, float, np.ndarray | None]:
        """Draft the token after ``token`` (at ``pos``): (drafted token, confidence, q or None when greedy)."""

    def runner_ups(self, most: int) -> list[tuple[int, float]]:
        """The last step's next-best tokens after the one it drafted, with their draft probabilities, best
        first (at most ``most``): a model-draft tree's leaves (``ModelDrafter``)."""


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
        # the last greedy step's exp(logits - top logit) and its sum: the draft's probabilities, for runner_ups
        self._weights: np.ndarray | None = None
        self._total = 1.0
        self._drafted = -1

    def __call__(self, token: int, pos: int, ctx: RoundContext) -> tuple[int, float, np.ndarray | None]:
        logits = self.kind.draft(self.backend, token, pos)
        if ctx.params.greedy:
            # Only the drafted token's probability is needed (the draft policy's confidence), so one exp pass in the
            # logits' own precision instead of a float64 softmax: 40 us against 340 us over SmolLM2's 49k-token
            # vocabulary, which was 5% of an int8 draft step on ONNX Runtime. A drafting heuristic: whatever it
            # rounds to, the verifier decides every token.
            drafted = self._drafted = int(np.argmax(logits))
            with np.errstate(under="ignore", invalid="ignore"):
                self._weights = np.exp(logits - logits[drafted])  # <= 1 everywhere; 0 at -inf (a draft vocabulary)
            self._total = float(self._weights.sum(dtype=np.float64))
            return drafted, 1.0 / self._total, None
        q = probabilities(logits, ctx.params)
        drafted = sample(q, ctx.rng)
        return drafted, float(q.max()), q

    def runner_ups(self, most: int) -> list[tuple[int, float]]:
        weights = self._weights
        if weights is None or most < 1:
            return []
        top = np.argpartition(weights, -(most + 1))[-(most + 1):]
        top = [int(t) for t in top[np.argsort(-weights[top], kind="stable")] if t != self._drafted][:most]
        return [(t, float(weights[t]) / self._total) for t in top]


# A runner-up less likely than this under the draft is not worth a verify row. SmolLM2-135M's int8 draft on ONNX
# Runtime (issue 24): leaves above 0.05 were the model's token 6% of the time, above 0.2 10%, above 0.3 17%;
# a leaf pays there from about 8% (one more token per hit against a row's cost in a ~7-row verify).
BRANCH_MIN_PROBABILITY = 0.2


class ModelDrafter:
    """Drafts with a plan's subgraph of the model under a ``DraftPolicy``.

    With ``plan.draft_branches`` > 1 (greedy rounds) the draft is a token tree (``runtime/tree.py``): its chain,
    then, beside each drafted token, up to ``draft_branches - 1`` of the draft's runner-ups as leaves (source
    ``branch``) where the draft gave them at least ``BRANCH_MIN_PROBABILITY``. A leaf costs a verify row and no
    draft step; it pays where the draft's first choice is wrong and its second right, which is where a chain's
    round ends (the top-k branches of SpecInfer / EAGLE-2 trees, cut to one level so that the draft runs once
    per depth)."""

    name = "model"
    branch = "branch"  # the source name of a tree's runner-up leaves

    def __init__(self, plan: DraftPlan, step: DraftStep, policy: DraftPolicy):
        from .draft_kinds import kind_of

        self.plan, self.step, self.policy = plan, step, policy
        self.kind = kind_of(plan)
        self.drafts_trees = plan.draft_branches > 1  # tree rounds run on the host (``speculative.decode``)

    def start(self, prompt: Sequence[int]) -> None:
        pass

    def propose(self, ctx: RoundContext) -> Draft:
        draft = Draft(verify_plan=self.plan)
        leaves: list[tuple[int, int]] = []  # (parent node, token)
        current = ctx.history[-1]
        most = min(self.policy.max_draft, ctx.limit)
        branches = self.plan.draft_branches - 1 if ctx.params.greedy else 0
        for j in range(most):
            current, confidence, q = self.step(current, ctx.pos + j, ctx)
            draft.tokens.append(current)
            draft.q.append(q)
            draft.sources.append(self.name)
            if branches and 1.0 - confidence >= BRANCH_MIN_PROBABILITY:  # else no runner-up can reach the floor
                leaves += [(j - 1, t) for t, p in self.step.runner_ups(branches) if p >= BRANCH_MIN_PROBABILITY]
            if confidence < self.policy.threshold:
                break
        draft.reuse = self.kind.reuse(len(draft.tokens))
        room = ctx.limit - len(draft.tokens)
        if leaves and room > 0:
            leaves = leaves[:room]
            draft.parents = list(range(-1, len(draft.tokens) - 1)) + [parent for parent, _ in leaves]
            draft.tokens += [token for _, token in leaves]
            draft.q += [None] * len(leaves)
            draft.sources += [self.branch] * len(leaves)
        return draft

    def feedback(self, draft: Draft, accepted: int) -> None:
        drafted = draft.sources.count(self.name)  # the chain's tokens (a tree's leaves did not set its length)
        self.policy.update(drafted, min(accepted, drafted))


__all__ = ["BRANCH_MIN_PROBABILITY", "BackendStep", "Draft", "DraftPolicy", "DraftStep", "Drafter", "ModelDrafter",
           "ObservesSources", "RoundContext", "remember"]
