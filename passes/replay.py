"""Replay the runtime's own drafter objects over the calibration continuations (docs/design.md section 5).

The target's greedy continuation of each calibration prompt is what a real run verifies, so a round
can be replayed without the model: the drafter (the same ``make_drafter`` object the runtime builds,
n-gram index, retrieval datastore, hybrid choice and model draft policy included) proposes
candidates for the committed history, and the accepted count is the run of candidates equal to the
continuation. The model part's draft steps read a ``Profile`` (the plan's argmax and confidence at
every position, from one parallel forward, ``acceptance_estimate.profile_plan``) instead of running the
backend. Each round's cost then comes from the backend's measured step costs (``StepCosts``), so the
estimate describes the same policy the runtime runs, on the backend it runs on.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from speccompile.runtime.artifact.manifest import DraftPlan
from speccompile.runtime.drafting import has_model_part, read_plan
from speccompile.runtime.drafting.drafter import RoundContext
from speccompile.runtime.drafting.factory import make_drafter
from speccompile.runtime.sampling import SamplingParams

from .acceptance_estimate import Profile, Reference, RoundEstimate

GREEDY = SamplingParams()


class ProfileStep:
    """A model draft step read from one sequence's profile: what the plan's subgraph drafts after the
    target's own prefix (exact for the first token of a round, docs/design.md section 5)."""

    def __init__(
        self,
        tops: np.ndarray,
        confidences: np.ndarray,
        prompt_len: int,
        runners: tuple[np.ndarray, np.ndarray] | None = None,
    ):
        self.tops, self.confidences, self.prompt_len, self.runners = tops, confidences, prompt_len, runners
        self._last = -1

    def __call__(self, token: int, pos: int, ctx) -> tuple[int, float, None]:
        i = self._last = pos - self.prompt_len
        if not 0 <= i < len(self.tops):
            return -1, 0.0, None
        return int(self.tops[i]), float(self.confidences[i]), None

    def runner_ups(self, most: int) -> list[tuple[int, float]]:
        """The profile's next-best tokens at the last step's position (``Profile.runner_ups``)."""
        i = self._last
        if self.runners is None or not 0 <= i < len(self.tops):
            return []
        tokens, probs = self.runners
        return [(int(t), float(p)) for t, p in zip(tokens[i][:most], probs[i][:most])]


@dataclass
class ReplayedRound:
    drafted: int
    accepted: int
    model_tokens: int  # drafted by the model subgraph (each costs a draft step)
    lookups: int  # lookup calls made this round (approximate: one per lookup source asked)
    reuse: int  # verifier inputs whose prefix the draft computed (early exit)
    label: str


def replay(
    plan: DraftPlan, references: list[Reference], profile: Profile | None = None, root: Path | None = None
) -> list[ReplayedRound]:
    """Every round of ``plan``'s drafter over every calibration continuation, as
    ``runtime.decoding.speculative.decode`` would run it (the last token of a sequence, with no room to draft, is a
    plain step and not a round)."""
    if has_model_part(plan) and (profile is None or profile.tops is None):
        raise ValueError(f"plan {plan.name!r} has a model part: replay needs its profile")
    rounds: list[ReplayedRound] = []
    for s, ref in enumerate(references):
        tokens = ref.tokens[0].tolist()
        prompt, target = tokens[: ref.prompt_len], tokens[ref.prompt_len :]
        runners = (profile.runner_ups[s], profile.runner_up_probs[s]) if profile and profile.runner_ups else None
        step = (
            ProfileStep(profile.tops[s], profile.confidences[s], ref.prompt_len, runners)
            if has_model_part(plan)
            else None
        )
        drafter = make_drafter(plan, step, root)
        drafter.start(prompt)
        produced, n = 1, len(target)
        while n - produced > 1:
            ctx = RoundContext(
                history=tokens[: ref.prompt_len + produced],
                pos=ref.prompt_len + produced - 1,
                limit=n - produced - 1,
                params=GREEDY,
                rng=None,
            )
            draft = drafter.propose(ctx)
            accepted = len(draft.nodes_of(target[produced:]))  # a chain's or a tree's path along the continuation
            drafter.feedback(draft, accepted)
            model = draft.sources.count("model")
            rounds.append(
                ReplayedRound(
                    len(draft.tokens), accepted, model, len(plan.lookup) if plan.lookup else 0, draft.reuse, draft.label
                )
            )
            produced += accepted + 1
    return rounds


def estimate_rounds(rounds: list[ReplayedRound], plan: DraftPlan, costs) -> RoundEstimate:
    """Expected speedup of replayed rounds: tokens per second of the rounds over plain decoding's."""
    plan = read_plan(plan)
    if not rounds:
        return RoundEstimate(1.0, 0.0, 0.0, 0.0, plan.model.max_draft, plan.model.threshold)
    draft_step = costs.draft_step(plan) if plan.has_model_part else 0.0
    total_cost = 0.0
    for r in rounds:
        total_cost += r.model_tokens * draft_step + r.lookups * costs.lookup
        # a round the model drafted is priced as its plan's verify (prefix reuse; a verify right after the
        # draft's steps, which may cost more than back-to-back: StepCosts.verify_after_draft)
        total_cost += costs.verify(plan if r.reuse or r.model_tokens else None, r.drafted + 1, r.reuse)
    tokens = sum(r.accepted + 1 for r in rounds)
    drafted = sum(r.drafted for r in rounds)
    return RoundEstimate(
        tokens_per_round=tokens / len(rounds),
        drafted_per_round=drafted / len(rounds),
        acceptance_rate=sum(r.accepted for r in rounds) / max(drafted, 1),
        expected_speedup=tokens / total_cost * costs.plain_step(),
        max_draft=plan.model.max_draft,
        threshold=plan.model.threshold,
    )


def round_mix(rounds: list[ReplayedRound]) -> dict[str, float]:
    """Share of rounds per source combination (what the hybrid chose)."""
    mix: dict[str, int] = {}
    for r in rounds:
        mix[r.label] = mix.get(r.label, 0) + 1
    return {label: round(count / len(rounds), 4) for label, count in sorted(mix.items())}
