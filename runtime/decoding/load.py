"""Speculation that adapts to load: how much each sequence of a batch drafts this round (zero included).

Alone, a sequence's verify of k drafted tokens costs about one plain step (the weights' bytes dominate), so
drafting is nearly free. In a batch the plain step already shares the weights' read among every sequence,
and a drafted token is a row of compute that someone pays for: past some load, drafting slows the batch
down (vLLM turns speculation off above a batch size; SmartSpec / TurboSpec choose draft lengths by goodput).
Here each round chooses, from

- the measured cost of the backend's calls (``CallCosts``: a call of n one-token rows, a row of w tokens
  alone; timed at load, and by the build when it has the time),
- each sequence's expected accepted tokens for a draft of length k, from its own running acceptance
  (``expected_tokens``),

the drafts that maximise tokens per second over the whole batch. Doing nothing is always one of the
choices, so, as far as the costs are right, a round is never slower than plain batched decoding. The
choice only sets draft lengths: every committed token is still the verifier's, so it changes no output.

Two call shapes (``Backend.rows_pad_to_widest``):
- ONNX Runtime (``False``): one-token rows of all sequences share one call; a wider row (a verify) runs as
  a call of its own (GroupQueryAttention takes a batch only with one new token per sequence);
- torch (``True``): every row is in one call, padded to the widest, so one sequence's draft widens all.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from ..segments import Row, full_model

PRIOR_ACCEPTANCE = 0.6  # a sequence's acceptance before it has drafted (a typical lookup / self-draft rate)


def expected_tokens(acceptance: float, drafted: int) -> float:
    """Tokens a round commits on average when each drafted token is accepted with probability ``acceptance``
    (given the ones before it) and ``drafted`` are verified: 1 + a + a^2 + ... + a^drafted."""
    a = min(max(acceptance, 0.0), 0.999)
    return (1.0 - a ** (drafted + 1)) / (1.0 - a)


@dataclass
class CallCosts:
    """Seconds of the backend's calls: ``batched[n]`` a call of n one-token rows, ``alone[w]`` one row of w
    tokens; between and beyond the measured points, linear interpolation and extrapolation."""

    batched: dict[int, float]
    alone: dict[int, float]
    pad_to_widest: bool = False
    measured: dict = field(default_factory=dict)

    @staticmethod
    def _curve(points: dict[int, float], x: float) -> float:
        xs = sorted(points)
        if x <= xs[0]:
            return points[xs[0]]
        if x >= xs[-1]:
            if len(xs) == 1:
                return points[xs[-1]] * x / xs[-1]
            slope = (points[xs[-1]] - points[xs[-2]]) / (xs[-1] - xs[-2])
            return points[xs[-1]] + slope * (x - xs[-1])
        return float(np.interp(x, xs, [points[k] for k in xs]))

    def round_cost(self, widths: Sequence[int]) -> float:
        """Seconds of one verify round whose rows have these widths (1: a plain step)."""
        if not widths:
            return 0.0
        if self.pad_to_widest:
            return self._curve(self.batched, len(widths) * max(widths))
        ones = sum(1 for w in widths if w == 1)
        return (self._curve(self.batched, ones) if ones else 0.0) + sum(
            self._curve(self.alone, w) for w in widths if w > 1
        )

    def as_dict(self) -> dict:
        return {
            "batched": {str(k): float(f"{v:.6g}") for k, v in sorted(self.batched.items())},
            "alone": {str(k): float(f"{v:.6g}") for k, v in sorted(self.alone.items())},
            "pad_to_widest": self.pad_to_widest,
        }

    @classmethod
    def from_dict(cls, data: dict) -> "CallCosts":
        return cls(
            {int(k): float(v) for k, v in data["batched"].items()},
            {int(k): float(v) for k, v in data["alone"].items()},
            bool(data.get("pad_to_widest", False)),
        )

    @classmethod
    def measure(cls, backend, max_rows: int, max_width: int, context: int = 64, repeats: int = 3) -> "CallCosts":
        """Time the backend's calls on its own slots: n one-token rows for n = 1, 2, 4, .. ``max_rows`` and one
        row of w = 2 .. ``max_width`` tokens, at ``context`` positions of past, each the best of ``repeats``
        after a warm-up. Seconds, on the machine and threads that will decode."""
        full = full_model(backend.config.num_layers)
        backend.reserve(context + max_width + 2, slots=max(max_rows, 1))
        backend.run_rows(full, [Row(s, 0, [1] * context) for s in range(max_rows)])  # a past to attend to

        def best(rows: list[Row]) -> float:
            backend.run_rows(full, rows)
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                backend.run_rows(full, rows)
                times.append(time.perf_counter() - start)
            return min(times)

        counts = sorted({1, max_rows} | {2**i for i in range(1, 8) if 2**i < max_rows})
        batched = {n: best([Row(s, context, [1]) for s in range(n)]) for n in counts}
        alone = {1: batched[1]}
        alone.update({w: best([Row(0, context, [1] * w)]) for w in range(2, max_width + 1)})
        return cls(batched, alone, backend.rows_pad_to_widest)


@dataclass
class Choice:
    """One sequence's part of a round, as the policy sees it: its acceptance and the tokens its lookup
    proposed (or what its model may draft)."""

    acceptance: float
    available: int


def choose_lengths(costs: CallCosts, choices: Sequence[Choice]) -> list[int]:
    """Each sequence's draft length (<= its ``available``) that maximises expected tokens per second over the
    batch; all zeros (plain batched decoding) whenever drafting does not pay."""
    n = len(choices)
    plain = [0] * n
    best, best_rate = plain, n / max(costs.round_cost([1] * n), 1e-12)
    if costs.pad_to_widest:  # one cap for everyone: the call is as wide as its widest row
        for cap in range(1, max((c.available for c in choices), default=0) + 1):
            lengths = [min(cap, c.available) for c in choices]
            tokens = sum(expected_tokens(c.acceptance, k) for c, k in zip(choices, lengths))
            rate = tokens / max(costs.round_cost([k + 1 for k in lengths]), 1e-12)
            if rate > best_rate:
                best, best_rate = lengths, rate
        return best

    # one-token rows share a call, wider rows run alone: let sequences draft in the order of their own
    # tokens per second alone, and keep the prefix of that order that maximises the batch's rate
    def own_rate(i: int) -> float:
        c = choices[i]
        return (expected_tokens(c.acceptance, c.available) - 1.0) / max(costs.round_cost([c.available + 1]), 1e-12)

    order = sorted((i for i in range(n) if choices[i].available > 0), key=own_rate, reverse=True)
    lengths = list(plain)
    for i in order:
        lengths[i] = choices[i].available
        tokens = sum(expected_tokens(c.acceptance, k) for c, k in zip(choices, lengths))
        rate = tokens / max(costs.round_cost([k + 1 for k in lengths]), 1e-12)
        if rate > best_rate:
            best, best_rate = list(lengths), rate
    return best


def draft_pays(costs: CallCosts, acceptance: float, length: int, draft_step: float, batch: int) -> bool:
    """Whether one sequence's draft of ``length`` tokens (``draft_step`` seconds a token to draft: a model draft's
    steps, 0 for a lookup) and its verify make a batch of ``batch`` sequences produce more tokens per second
    than leaving it in the plain step. Decided before drafting: a model draft's steps are its price, and a
    lookup's host time is saved when even the longest draft would not pay."""
    if batch <= 1:
        return True
    plain = batch / max(costs.round_cost([1] * batch), 1e-12)
    spent = length * draft_step + costs.round_cost([1] * (batch - 1) + [length + 1])
    return (batch - 1 + expected_tokens(acceptance, length)) / max(spent, 1e-12) > plain


def longest_draft(plan) -> int:
    """The longest chain a round of ``plan`` verifies besides its input token (what ``CallCosts`` should time)."""
    from ..drafting import has_model_part, options

    lengths = [plan.lookup_max_draft if plan.lookup else 0]
    if has_model_part(plan):
        lengths.append(options(plan, "model").max_draft)
    return max(lengths + [1])


__all__ = [
    "CallCosts",
    "Choice",
    "PRIOR_ACCEPTANCE",
    "choose_lengths",
    "expected_tokens",
    "longest_draft",
    "draft_pays",
]
