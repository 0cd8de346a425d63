"""The model's own draft: a plan's subgraph (its draft kind, ``kinds/``) drafting under an adaptive policy.

Its draft steps go through a ``DraftStep``, which the runtime backs with the backend (``BackendStep``) and
the tuner backs with a precomputed profile, so both replay the *same* policy object. Its options
(``ModelOptions``) sit under ``"model"`` in the plan's ``sources``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from ..artifact.manifest import DraftPlan
from ..errors import ArtifactError
from ..sampling import probabilities, sample
from .drafter import Draft, Drafter, RoundContext, SourceOptions, drive

if TYPE_CHECKING:
    from .plan import ReadPlan


@dataclass
class ModelOptions(SourceOptions):
    """How the model part drafts: at most ``max_draft`` tokens a round, stopping early when the draft's top-1
    probability falls below ``threshold`` (which, when ``adaptive``, steers acceptance toward
    ``target_acceptance``); ``branches`` > 1 adds up to ``branches - 1`` runner-ups per drafted token as tree
    leaves (greedy rounds)."""

    max_draft: int = 6
    threshold: float = 0.0
    adaptive: bool = True
    target_acceptance: float = 0.6
    branches: int = 1

    def check(self, plan: DraftPlan) -> None:
        if self.max_draft < 1:
            raise ArtifactError(f"plan '{plan.name}': sources.model.max_draft must be >= 1, got {self.max_draft}")
        if not 0.0 <= self.threshold < 1.0:
            raise ArtifactError(f"plan '{plan.name}': sources.model.threshold must be in [0, 1), got {self.threshold}")
        if self.branches < 1:
            raise ArtifactError(f"plan '{plan.name}': sources.model.branches must be >= 1, got {self.branches}")


class DraftStep(Protocol):
    def __call__(self, token: int, pos: int, ctx: RoundContext) -> tuple[int, float, np.ndarray | None]:
        """Draft the token after ``token`` (at ``pos``): (drafted token, confidence, q or None when greedy)."""

    def runner_ups(self, most: int) -> list[tuple[int, float]]:
        """The last step's next-best tokens after the one it drafted, with their draft probabilities, best
        first (at most ``most``): a model-draft tree's leaves (``ModelDrafter``)."""


# Far into a long context a drafted token that the draft itself doubts is not worth its price: a verify row's
# attention reads the whole past while a windowed draft step does not (runtime/backends/window_shape.py), and the
# plan's threshold was tuned on short calibration prompts, where a verify of k tokens costs about one plain step.
# So from LONG_CONTEXT positions on, drafting stops below at least LONG_CONTEXT_THRESHOLD. SmolLM2's ONNX build,
# two inputs each, tokens/s with the plan's threshold (0) against 0.3, in turns: questions about a 7K-token
# document 26.3 / 29.1, about a 2K one 36.6 / 42.9; continuing 7K tokens of code 39.9 / 39.0, 2K 57.8 / 58.9
# (docs/long_inputs.md; drafts of at most 4 did better on questions and worse on code).
LONG_CONTEXT = 1024
LONG_CONTEXT_THRESHOLD = 0.3


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
    def from_plan(cls, plan: "ReadPlan", max_draft: int | None = None) -> "DraftPolicy":
        return cls.from_options(plan.model, max_draft)

    @classmethod
    def from_options(cls, options: ModelOptions, max_draft: int | None = None) -> "DraftPolicy":
        return cls(
            max_draft=max_draft or options.max_draft,
            threshold=options.threshold,
            adaptive=options.adaptive,
            target_acceptance=options.target_acceptance,
        )

    def threshold_at(self, pos: int) -> float:
        """The threshold a draft from ``pos`` stops below: this policy's, and from ``LONG_CONTEXT`` positions on at
        least ``LONG_CONTEXT_THRESHOLD`` (one rule for the host round and the device round)."""
        return max(self.threshold, LONG_CONTEXT_THRESHOLD) if pos >= LONG_CONTEXT else self.threshold

    def update(self, drafted: int, accepted: int) -> None:
        if not self.adaptive or drafted == 0:
            return
        if accepted / drafted < self.target_acceptance:
            self.threshold = min(self.threshold + self.step, 0.95)
        else:
            self.threshold = max(self.threshold - self.step, 0.0)


class BackendStep:
    """A model draft step of ``plan``'s kind on the backend (what the runtime uses)."""

    def __init__(self, backend, plan: "ReadPlan"):
        """``plan`` read for the backend's layer count (its kind runs the step's segments)."""
        self.backend, self.kind = backend, plan.kind
        # the last greedy step's exp(logits - top logit) and its sum: the draft's probabilities, for runner_ups
        self._weights: np.ndarray | None = None
        self._total = 1.0
        self._drafted = -1

    def __call__(self, token: int, pos: int, ctx: RoundContext) -> tuple[int, float, np.ndarray | None]:
        return self.from_logits(self.kind.draft(self.backend, token, pos), ctx)

    def from_logits(self, logits: np.ndarray, ctx: RoundContext) -> tuple[int, float, np.ndarray | None]:
        """The step's result from its logits ``[vocab]`` (computed here, or by a batch's call for every
        sequence's step at once)."""
        if ctx.params.greedy:
            # Only the drafted token's probability is needed (the draft policy's confidence), so one exp pass in the
            # logits' own precision instead of a float64 softmax, which over a large vocabulary is a noticeable
            # share of a cheap draft step (measured: docs/history.md, 'Figures behind the code's constants'). A
            # drafting heuristic: whatever it rounds to, the verifier decides every token.
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
        top = np.argpartition(weights, -(most + 1))[-(most + 1) :]
        top = [int(t) for t in top[np.argsort(-weights[top], kind="stable")] if t != self._drafted][:most]
        return [(t, float(weights[t]) / self._total) for t in top]


# A runner-up less likely than this under the draft is not worth a verify row: a leaf pays where it is the model's
# token often enough that one more token per hit outweighs a row's cost in the verify; leaves above this probability
# were, leaves above much lower ones were not (measured: docs/history.md, 'Figures behind the code's constants').
BRANCH_MIN_PROBABILITY = 0.2


class ModelDrafter(Drafter):
    """Drafts with a plan's subgraph of the model under a ``DraftPolicy``.

    With ``branches`` > 1 (``ModelOptions``; greedy rounds) the draft is a token tree (``runtime/tree.py``): its
    chain, then, beside each drafted token, up to ``branches - 1`` of the draft's runner-ups as leaves (source
    ``branch``) where the draft gave them at least ``BRANCH_MIN_PROBABILITY``. A leaf costs a verify row and no
    draft step; it pays where the draft's first choice is wrong and its second right, which is where a chain's
    round ends (the top-k branches of SpecInfer / EAGLE-2 trees, cut to one level so that the draft runs once
    per depth)."""

    name = "model"
    branch = "branch"  # the source name of a tree's runner-up leaves
    Options = ModelOptions
    steps_on_device = True

    def __init__(self, plan: "ReadPlan", step: DraftStep, policy: DraftPolicy | None = None):
        self.plan, self.step, self.kind = plan, step, plan.kind
        self.options = plan.model
        self.policy = policy or DraftPolicy.from_options(self.options)
        self.drafts_trees = self.options.branches > 1  # tree rounds run on the host (``speculative.decode``)

    @property
    def model_part(self) -> "ModelDrafter":
        return self

    def propose(self, ctx: RoundContext) -> Draft:
        return drive(self.drafting(ctx), self.step, ctx)

    def drafting(self, ctx: RoundContext):
        draft = Draft(verify_plan=self.plan)
        if not ctx.model_allowed:
            return draft
        leaves: list[tuple[int, int]] = []  # (parent node, token)
        current = ctx.history[-1]
        most = min(self.policy.max_draft, ctx.limit, ctx.model_steps if ctx.model_steps is not None else ctx.limit)
        branches = self.options.branches - 1 if ctx.params.greedy else 0
        threshold = self.policy.threshold_at(ctx.pos)
        for j in range(most):
            current, confidence, q = yield current, ctx.pos + j
            draft.tokens.append(current)
            draft.q.append(q)
            draft.sources.append(self.name)
            if branches and 1.0 - confidence >= BRANCH_MIN_PROBABILITY:  # else no runner-up can reach the floor
                leaves += [(j - 1, t) for t, p in self.step.runner_ups(branches) if p >= BRANCH_MIN_PROBABILITY]
            if confidence < threshold:
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

    def chain(self, tokens: list[int]) -> Draft:
        """The draft of a chain of ``tokens`` this drafter's steps drafted elsewhere (the device round's), as
        ``drafting`` would have returned it: what statistics and ``feedback`` read."""
        k = len(tokens)
        return Draft(list(tokens), [None] * k, [self.name] * k, self.kind.reuse(k), self.plan)

    def feedback(self, draft: Draft, accepted: int) -> None:
        drafted = draft.sources.count(self.name)  # the chain's tokens (a tree's leaves did not set its length)
        self.policy.update(drafted, min(accepted, drafted))


__all__ = [
    "BRANCH_MIN_PROBABILITY",
    "LONG_CONTEXT",
    "LONG_CONTEXT_THRESHOLD",
    "BackendStep",
    "DraftPolicy",
    "DraftStep",
    "ModelDrafter",
    "ModelOptions",
]
