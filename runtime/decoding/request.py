"""What one request is and what it produced: ``DecodeRequest``, ``Stats``, and what a request needs before
it decodes (its cache length, its drafter on a backend). Shared by the batch round (``batch.py``) and the
single-request entry points (``speculative.py``), which both import it and nothing imports back."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..artifact.manifest import DraftPlan
from ..backends.base import Backend
from ..drafting.drafter import Draft
from ..drafting.factory import make_drafter
from ..drafting.model_draft import BackendStep
from ..drafting.plan import ReadPlan, read_plan
from ..sampling import SamplingParams


@dataclass
class Stats:
    new_tokens: int = 0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    seconds: float = 0.0
    prefill_seconds: float = 0.0
    reused_prompt_tokens: int = 0  # prompt tokens whose KV a batch copied from an earlier prompt's
    stop_reason: str = "length"
    speculative: bool = True
    round_log: list[tuple[int, int]] = field(default_factory=list)  # (drafted, accepted) per round
    round_sources: list[str] = field(default_factory=list)  # per round: which sources drafted ("model+ngram")
    per_source: dict[str, list[int]] = field(default_factory=dict)  # source -> [drafted, accepted]

    tree_rounds: int = 0  # rounds that verified a token tree (``drafted`` then counts its nodes)

    def record(self, draft: Draft, accepted: int, path: list[int] | None = None) -> None:
        """One round: ``accepted`` drafted tokens were kept (a tree's: the nodes on ``path``)."""
        self.rounds += 1
        self.drafted += len(draft.tokens)
        self.accepted += accepted
        self.tree_rounds += path is not None
        self.round_log.append((len(draft.tokens), accepted))
        self.round_sources.append(draft.label)
        kept = set(path) if path is not None else set(range(accepted))
        for i, source in enumerate(draft.sources):
            counts = self.per_source.setdefault(source, [0, 0])
            counts[0] += 1
            counts[1] += i in kept

    @property
    def source_mix(self) -> dict[str, int]:
        """Rounds per combination of sources ("none": no candidate, a plain step)."""
        mix: dict[str, int] = {}
        for label in self.round_sources:
            mix[label] = mix.get(label, 0) + 1
        return mix

    def source_report(self) -> dict[str, dict]:
        return {
            source: {"drafted": d, "accepted": a, "acceptance_rate": round(a / d, 4) if d else None}
            for source, (d, a) in self.per_source.items()
        }

    @property
    def mean_accepted(self) -> float | None:
        """Mean tokens per verify round, the verifier's own token included (tau in EAGLE/Medusa)."""
        if not self.speculative or self.rounds == 0:
            return None
        return (self.accepted + self.rounds) / self.rounds

    @property
    def drafted_per_round(self) -> float | None:
        """Tokens verified per round beside the input token (a tree's nodes)."""
        if not self.speculative or self.rounds == 0:
            return None
        return self.drafted / self.rounds

    @property
    def acceptance_rate(self) -> float | None:
        if not self.speculative or self.drafted == 0:
            return None
        return self.accepted / self.drafted

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict:
        return {
            "new_tokens": self.new_tokens,
            "rounds": self.rounds if self.speculative else None,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "mean_accepted": self.mean_accepted,
            "drafted_per_round": self.drafted_per_round,
            "tree_rounds": self.tree_rounds if self.speculative else None,
            "acceptance_rate": self.acceptance_rate,
            "tokens_per_s": self.tokens_per_s,
            "seconds": self.seconds,
            "prefill_seconds": self.prefill_seconds,
            "stop_reason": self.stop_reason,
            "sources": self.source_report() if self.speculative else None,
            "round_mix": self.source_mix if self.speculative else None,
        }


@dataclass
class DecodeRequest:
    prompt_ids: list[int]
    max_new_tokens: int
    params: SamplingParams = field(default_factory=SamplingParams)
    eos_ids: frozenset[int] = frozenset()
    seed: int | None = None


def draft_room(plan: DraftPlan | ReadPlan | None, max_draft: int | None = None) -> int:
    """Most tokens one round of ``plan`` may draft (what the KV cache must hold beyond the output)."""
    return 0 if plan is None else read_plan(plan).draft_room(max_draft)


def cache_length(
    backend: Backend, request: DecodeRequest, plan: DraftPlan | ReadPlan | None, max_draft: int | None = None
) -> int:
    """Cache positions ``request`` needs: prompt, new tokens, one round's drafts, capped at the model's context
    (generation stops there)."""
    needed = len(request.prompt_ids) + request.max_new_tokens + draft_room(plan, max_draft) + 1
    return min(backend.config.max_position_embeddings, needed)


def backend_drafter(
    backend: Backend, plan: DraftPlan | ReadPlan | None, root: Path | None = None, max_draft: int | None = None
):
    """The drafter for ``plan`` running on ``backend`` (None, plain decoding, when ``plan`` is None)."""
    if plan is None:
        return None
    plan = read_plan(plan, backend.config.num_layers)
    backend.check_plans({plan.name: plan})  # a plan this backend cannot run is refused before any work
    no_trees = backend.tree_unsupported() if plan.lookup_branches > 1 or plan.model.branches > 1 else None
    if no_trees is not None:
        import warnings

        warnings.warn(
            f"plan {plan.name!r} drafts token trees, which the {backend.name} backend cannot verify here "
            f"({no_trees}); it drafts chains (its first branch)",
            stacklevel=2,
        )
        plan = plan.with_options(model={"branches": 1}).replace(lookup_branches=1)
    if plan.draft_head_file is not None:  # an exit adapter / reduced vocabulary, from ``root``
        backend.load_draft_head(plan.draft_head_file, root)
    return make_drafter(plan, BackendStep(backend, plan), root, max_draft)


__all__ = ["DecodeRequest", "Stats", "backend_drafter", "cache_length", "draft_room"]
