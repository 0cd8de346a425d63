"""Draft-and-verify decoding, written once for every backend and every draft source (gpt-fast style, numpy).

A backend (``runtime/backends/base.py``) runs segments of the model on its static KV cache; a plan's
draft kind (``runtime/drafting/kinds/``) turns a draft step and a verify into segments (an early exit's
verify reuses the draft's prefix). Rollback after a rejection is only a smaller ``pos`` for the next call.

Each round asks a drafter (``runtime/drafting/base.py``) for candidates and verifies them in one call. A
backend may keep the round on its device instead (``device_round``: the torch backend on CUDA,
``runtime/backends/torch/device_round.py``: one host read per round, none per drafted token); the round below is the
host round, which every other backend runs.
Greedy: accept drafted tokens while they equal the verifier's argmax, then take the verifier's token
(exact up to floating-point near-ties, docs/design.md section 6). Sampling: Leviathan/Chen speculative
sampling with rejection over the draft's q (one-hot for lookup sources), so the output has the plain
sampler's distribution.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Iterator

import numpy as np

from ..artifact.manifest import DraftPlan
from ..backends.base import Backend
from ..drafting import has_model_part, options
from ..drafting.base import Draft, RoundContext
from ..drafting.factory import make_drafter
from ..drafting.model import BackendStep
from ..sampling import SamplingParams, probabilities, sample
from ..tree import greedy_path, kv_moves, sample_path


@dataclass
class Stats:
    new_tokens: int = 0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    seconds: float = 0.0
    prefill_seconds: float = 0.0
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


def _budget(request: DecodeRequest, backend: Backend, produced: int, pos: int) -> int:
    """How many more tokens may be produced: the user's limit and the context both bound it."""
    return min(request.max_new_tokens - produced, backend.max_len - pos)


def _emit(new: list[int], request: DecodeRequest, stats: Stats) -> tuple[list[int], bool]:
    """Cut ``new`` at the first EOS (kept, as transformers does); True when generation must stop."""
    for i, token in enumerate(new):
        if token in request.eos_ids:
            stats.stop_reason = "eos"
            return new[: i + 1], True
    return new, False


def _pick(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    return int(np.argmax(logits)) if params.greedy else sample(probabilities(logits, params), rng)


def decode(backend: Backend, request: DecodeRequest, drafter, stats: Stats) -> Iterator[list[int]]:
    """Yield the new tokens of each step (plain, ``drafter`` None) or round (speculative) until a stop."""
    rng = np.random.default_rng(request.seed)
    params = request.params
    stats.speculative = drafter is not None
    start = time.perf_counter()
    prompt = list(request.prompt_ids)
    logits = backend.forward(prompt, 0)[-1]
    stats.prefill_seconds = time.perf_counter() - start
    token = _pick(logits, params, rng)
    history = prompt + [token]
    round_ = None
    if drafter is not None:
        drafter.start(prompt)
        # token trees, and drafters that read the verifier's outputs, run the host round
        if not (drafter.drafts_trees or drafter.observes):
            round_ = backend.device_round(drafter, request.seed)
    new, stop = _emit([token], request, stats)
    stats.new_tokens += 1
    yield new
    pos = len(prompt)  # position of `token`, whose KV is not yet written
    while not stop:
        budget = _budget(request, backend, stats.new_tokens, pos)
        if budget <= 0:
            stats.stop_reason = "length" if stats.new_tokens >= request.max_new_tokens else "context"
            break
        if drafter is None or budget == 1:
            new = [_pick(backend.forward([token], pos)[-1], params, rng)]
        else:
            ctx = RoundContext(history=history, pos=pos, limit=budget - 1, params=params, rng=rng)
            new = round_(ctx, stats) if round_ is not None else _speculative_round(backend, drafter, ctx, stats)
        pos += len(new)
        token = new[-1]
        history.extend(new)
        new, stop = _emit(new, request, stats)
        stats.new_tokens += len(new)
        yield new
    stats.seconds = time.perf_counter() - start


def draft_room(plan: DraftPlan | None, max_draft: int | None = None) -> int:
    """Most tokens one round of ``plan`` may draft (what the KV cache must hold beyond the output)."""
    if plan is None:
        return 0
    model = options(plan, "model")
    room = (max_draft or model.max_draft) * model.branches if has_model_part(plan) else 0
    return room + (plan.max_tree_nodes if plan.lookup else 0)


def reserve_cache(
    backend: Backend, request: DecodeRequest, plan: DraftPlan | None, max_draft: int | None = None
) -> None:
    """Size the backend's static cache for ``request``: prompt, new tokens, one round's drafts, capped at
    the model's context (generation stops there)."""
    needed = len(request.prompt_ids) + request.max_new_tokens + draft_room(plan, max_draft) + 1
    backend.reserve(min(backend.config.max_position_embeddings, needed))


def backend_drafter(backend: Backend, plan: DraftPlan | None, root: Path | None = None, max_draft: int | None = None):
    """The drafter for ``plan`` running on ``backend`` (None, plain decoding, when ``plan`` is None)."""
    if plan is None:
        return None
    backend.check_plans({plan.name: plan})  # a plan this backend cannot run is refused before any work
    no_trees = backend.tree_unsupported() if plan.lookup_branches > 1 or options(plan, "model").branches > 1 else None
    if no_trees is not None:
        import warnings

        warnings.warn(
            f"plan {plan.name!r} drafts token trees, which the {backend.name} backend cannot verify here "
            f"({no_trees}); it drafts chains (its first branch)",
            stacklevel=2,
        )
        plan = replace(plan.with_options(model={"branches": 1}), lookup_branches=1)
    if plan.draft_head_file is not None:  # an exit adapter / reduced vocabulary, from ``root``
        backend.load_draft_head(plan.draft_head_file, root)
    return make_drafter(plan, BackendStep(backend, plan), root, max_draft)


def decode_all(
    backend: Backend, request: DecodeRequest, plan: DraftPlan | None = None, root: Path | None = None
) -> tuple[list[int], Stats]:
    """Decode ``request`` to the end (plain when ``plan`` is None); the new tokens and the stats.
    ``root`` is the artifact folder, for plans whose drafters read files (a retrieval datastore)."""
    stats = Stats()
    reserve_cache(backend, request, plan)
    produced: list[int] = []
    for new in decode(backend, request, backend_drafter(backend, plan, root), stats):
        produced.extend(new)
    return produced, stats


def _verify(backend: Backend, token: int, draft: Draft, pos: int) -> np.ndarray:
    tokens = [token] + draft.tokens
    if draft.verify_plan is not None:
        return backend.verify(draft.verify_plan, tokens, pos, draft.reuse)
    return backend.forward(tokens, pos)


def _speculative_round(backend: Backend, drafter, ctx: RoundContext, stats: Stats) -> list[int]:
    """One draft-then-verify round starting from the last token of ``ctx.history``; the tokens it commits."""
    draft = drafter.propose(ctx)
    if draft.is_tree:
        if backend.tree_fits(ctx.pos, len(draft.tokens) + 1):
            return _tree_round(backend, drafter, draft, ctx, stats)
        draft = draft.first_branch()  # a call this backend cannot make exactly: the tree's first branch, a chain
    token, params, rng = ctx.history[-1], ctx.params, ctx.rng
    verify_logits = _verify(backend, token, draft, ctx.pos)
    drafted = draft.tokens
    if params.greedy:
        targets = np.argmax(verify_logits, axis=-1)
        n = 0
        while n < len(drafted) and drafted[n] == targets[n]:
            n += 1
        committed = drafted[:n] + [int(targets[n])]
    else:
        committed = []
        for i, d in enumerate(drafted):
            p = probabilities(verify_logits[i], params)
            q = draft.q[i]
            q_d = 1.0 if q is None else q[d]  # a lookup source's q is one-hot on its token
            if rng.random() < min(1.0, p[d] / q_d):
                committed.append(d)
                continue
            if q is None:
                residual = p.copy()
                residual[d] = 0.0
            else:
                residual = np.maximum(p - q, 0.0)
            committed.append(sample(residual / residual.sum(), rng) if residual.sum() > 0 else sample(p, rng))
            break
        else:
            committed.append(sample(probabilities(verify_logits[len(drafted)], params), rng))
    return _finish_round(drafter, draft, verify_logits, committed, ctx, stats)


def _tree_round(backend: Backend, drafter, draft: Draft, ctx: RoundContext, stats: Stats) -> list[int]:
    """Verify a token tree in one call (``runtime/tree.py``), commit its accepted path and keep only that
    path's KV, moved to the slots its positions name."""
    logits = backend.forward_tree([ctx.history[-1]] + draft.tokens, draft.parents, ctx.pos)
    if ctx.params.greedy:
        path, final = greedy_path(draft.tokens, draft.parents, logits)
    else:
        path, final = sample_path(draft.tokens, draft.parents, logits, ctx.params, ctx.rng)
    backend.keep_rows(ctx.pos, kv_moves(path))
    return _finish_round(drafter, draft, logits, [draft.tokens[i] for i in path] + [final], ctx, stats, path)


def _finish_round(
    drafter,
    draft: Draft,
    logits: np.ndarray,
    committed: list[int],
    ctx: RoundContext,
    stats: Stats,
    path: list[int] | None = None,
) -> list[int]:
    """What every round ends with: its stats, the drafter's feedback, and the verifier's rows for drafters
    that learn from them (``observes``); ``committed`` ends with the verifier's own token."""
    accepted = len(committed) - 1
    stats.record(draft, accepted, path)
    drafter.feedback(draft, accepted)
    if drafter.observes:
        drafter.observe(draft, logits, committed, ctx)
    return committed
