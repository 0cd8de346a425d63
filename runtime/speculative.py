"""Draft-and-verify decoding, written once for every backend (gpt-fast style, in numpy).

A backend provides three calls on its static KV cache (see ``runtime/backend.py``):
``forward`` (full model), ``draft`` (one token through a plan's subgraph) and ``verify`` (full-model
logits for a round's tokens; for early-exit plans it reuses the draft's prefix). Rollback after a
rejection is only a smaller ``pos`` for the next call.

Greedy: accept drafted tokens while they equal the verifier's argmax, then take the verifier's token
(exact up to floating-point near-ties, DESIGN.md section 6). Sampling: Leviathan/Chen speculative
sampling with rejection, so the output has the plain sampler's distribution.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator, Protocol, Sequence

import numpy as np

from .manifest import ArchConfig, DraftPlan
from .sampling import SamplingParams, probabilities, sample, softmax


class Backend(Protocol):
    max_len: int
    config: "ArchConfig"

    def reserve(self, max_len: int) -> None: ...

    def forward(self, tokens: Sequence[int], pos: int) -> np.ndarray: ...  # [T, V]

    def draft(self, plan: DraftPlan, token: int, pos: int) -> np.ndarray: ...  # [V]

    def verify(self, plan: DraftPlan, tokens: Sequence[int], pos: int, n_reuse: int) -> np.ndarray: ...  # [T, V]


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

    @property
    def mean_accepted(self) -> float | None:
        """Mean tokens per verify round, the verifier's own token included (tau in EAGLE/Medusa)."""
        if not self.speculative or self.rounds == 0:
            return None
        return (self.accepted + self.rounds) / self.rounds

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
            "new_tokens": self.new_tokens, "rounds": self.rounds if self.speculative else None,
            "drafted": self.drafted, "accepted": self.accepted, "mean_accepted": self.mean_accepted,
            "acceptance_rate": self.acceptance_rate, "tokens_per_s": self.tokens_per_s,
            "seconds": self.seconds, "prefill_seconds": self.prefill_seconds, "stop_reason": self.stop_reason,
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


def decode(
    backend: Backend,
    request: DecodeRequest,
    plan: DraftPlan | None,
    policy: DraftPolicy | None,
    stats: Stats,
) -> Iterator[list[int]]:
    """Yield the new tokens of each step (plain) or round (speculative) until a stop condition."""
    rng = np.random.default_rng(request.seed)
    params = request.params
    stats.speculative = plan is not None
    start = time.perf_counter()
    prompt = request.prompt_ids
    logits = backend.forward(prompt, 0)[-1]
    stats.prefill_seconds = time.perf_counter() - start
    token = _pick(logits, params, rng)
    new, stop = _emit([token], request, stats)
    stats.new_tokens += 1
    yield new
    pos = len(prompt)  # position of `token`, whose KV is not yet written
    while not stop:
        budget = _budget(request, backend, stats.new_tokens, pos)
        if budget <= 0:
            stats.stop_reason = "length" if stats.new_tokens >= request.max_new_tokens else "context"
            break
        if plan is None or budget == 1:
            token = _pick(backend.forward([token], pos)[-1], params, rng)
            new = [token]
            pos += 1
        else:
            new = _speculative_round(backend, plan, policy, params, rng, token, pos, budget, stats)
            pos += len(new)
            token = new[-1]
        new, stop = _emit(new, request, stats)
        stats.new_tokens += len(new)
        yield new
    stats.seconds = time.perf_counter() - start


def reserve_cache(backend: Backend, request: DecodeRequest, policy: DraftPolicy | None) -> None:
    """Size the backend's static cache for ``request``: prompt, new tokens, one round's drafts, capped at
    the model's context (generation stops there)."""
    room = policy.max_draft + 1 if policy is not None else 1
    needed = len(request.prompt_ids) + request.max_new_tokens + room
    backend.reserve(min(backend.config.max_position_embeddings, needed))


def decode_all(backend: Backend, request: DecodeRequest, plan: DraftPlan | None = None) -> tuple[list[int], Stats]:
    """Decode ``request`` to the end (plain when ``plan`` is None); the new tokens and the stats."""
    stats = Stats()
    policy = DraftPolicy.from_plan(plan) if plan is not None else None
    reserve_cache(backend, request, policy)
    produced: list[int] = []
    for new in decode(backend, request, plan, policy, stats):
        produced.extend(new)
    return produced, stats


def _speculative_round(backend, plan, policy, params, rng, token, pos, budget, stats) -> list[int]:
    """One draft-then-verify round starting from ``token`` at ``pos``; returns the tokens it commits."""
    max_draft = min(policy.max_draft, budget - 1)
    drafted: list[int] = []
    draft_probs: list[np.ndarray] = []
    current = token
    for j in range(max_draft):
        logits = backend.draft(plan, current, pos + j)
        if params.greedy:
            current = int(np.argmax(logits))
            confidence = float(softmax(logits)[current])
        else:
            q = probabilities(logits, params)
            current = sample(q, rng)
            draft_probs.append(q)
            confidence = float(q.max())
        drafted.append(current)
        if confidence < policy.threshold:
            break
    verify_logits = backend.verify(plan, [token] + drafted, pos, len(drafted))
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
            q = draft_probs[i]
            if rng.random() < min(1.0, p[d] / q[d]):
                committed.append(d)
                continue
            residual = np.maximum(p - q, 0.0)
            committed.append(sample(residual / residual.sum(), rng) if residual.sum() > 0 else sample(p, rng))
            break
        else:
            committed.append(sample(probabilities(verify_logits[len(drafted)], params), rng))
        n = len(committed) - 1
    stats.rounds += 1
    stats.drafted += len(drafted)
    stats.accepted += n
    stats.round_log.append((len(drafted), n))
    policy.update(len(drafted), n)
    return committed
