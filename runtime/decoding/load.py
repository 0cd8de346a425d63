"""Speculation that adapts to load: how much each sequence of a batch drafts this round (zero included).

Alone, a sequence's verify of k drafted tokens costs about one plain step (the weights' bytes dominate), so
drafting is nearly free. In a batch the plain step already shares the weights' read among every sequence,
and a drafted token is a row of compute that someone pays for: past some load, drafting slows the batch
down (vLLM turns speculation off above a batch size; SmartSpec / TurboSpec choose draft lengths by goodput).
Here each round chooses, from

- the measured cost of the backend's calls (``CallCosts``: a call of n one-token rows, a row of w tokens
  alone; timed by the build when it has the time and stored in the manifest, reused at load on the machine
  they were timed on, timed at load elsewhere: ``call_costs``),
- each sequence's expected accepted tokens for a draft of length k, from its own running acceptance
  (``expected_tokens``),

the drafts that maximise tokens per second over the whole batch. A model draft's steps are priced from their own
curve (``CallCosts.draft``: a call of n one-token rows of the plan's draft segment), shared among the sequences
that draft together: one batched draft step serves them all, so charging each the cost of a full-model step
(what the policy did without the curve) kept cheap int8 drafts out of every batch. Doing nothing is always one of the
choices, so, as far as the costs are right, a round is never slower than plain batched decoding. The
choice only sets draft lengths: every committed token is still the verifier's, so it changes no output.

Two call shapes (``Backend.rows_in_one_call``):
- ONNX Runtime on graphs exported before ``packed_rows`` (``False``): one-token rows of all sequences share one
  call; a wider row (a verify) runs as a call of its own (GroupQueryAttention takes a batch only with one new
  token per sequence there);
- torch, and ONNX Runtime on packed graphs (``True``): every row is in one call, its products on all the rows'
  tokens packed, so a call costs what a call of that many one-token rows costs, and each drafted token is
  priced on its own.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from ..artifact.measured import check_call_costs
from ..machine import machine_key
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
    tokens; between and beyond the measured points, linear interpolation and extrapolation. ``machine`` is
    where they were timed (``runtime/machine.machine_key``); ``source`` says whether they were timed now or
    read from the artifact's manifest (the build times them when it has the time: ``tuning["call_costs"]``)."""

    batched: dict[int, float]
    alone: dict[int, float]
    one_call: bool = False
    measured: dict = field(default_factory=dict)
    machine: str = ""
    source: str = "timed"
    draft: dict[int, float] = field(default_factory=dict)
    draft_segment: str = ""  # the segment ``draft`` timed (``Segment.describe()``): a plan drafting with another
    # segment times its own

    def draft_step(self, rows: int) -> float:
        """Seconds of one model-draft step of ``rows`` sequences in one call. Without a timed curve: a plain
        step of as many rows (a draft runs a part of the model, so never more)."""
        return self._curve(self.draft or self.batched, max(rows, 1))

    def has_draft(self, segment) -> bool:
        """Whether ``draft`` was timed on ``segment`` (a ``Segment``)."""
        return bool(self.draft) and self.draft_segment == segment.describe()

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
        if self.one_call:  # the rows' tokens packed in one call
            return self._curve(self.batched, sum(widths))
        ones = sum(1 for w in widths if w == 1)
        return (self._curve(self.batched, ones) if ones else 0.0) + sum(
            self._curve(self.alone, w) for w in widths if w > 1
        )

    def covers(self, max_rows: int, max_width: int) -> bool:
        """Whether the timed points reach ``max_rows`` one-token rows and a row of ``max_width`` tokens (beyond
        them the curves are extrapolated)."""
        return max(self.batched) >= max_rows and max(self.alone) >= max_width

    def as_dict(self) -> dict:
        def points(curve: dict[int, float]) -> dict[str, float]:
            return {str(k): float(f"{v:.6g}") for k, v in sorted(curve.items())}

        data = {
            "batched": points(self.batched),
            "alone": points(self.alone),
            "one_call": self.one_call,
            "machine": self.machine,
        }
        if self.draft:
            data["draft"] = {"segment": self.draft_segment, "batched": points(self.draft)}
        return data

    @classmethod
    def from_dict(cls, data, where: str = "call costs") -> "CallCosts":
        """The costs ``as_dict`` wrote; a one-line ``ArtifactError`` naming ``where`` when they are malformed."""
        parts = check_call_costs(data, where)
        return cls(
            parts["batched"],
            parts["alone"],
            parts["one_call"],
            machine=parts["machine"],
            source="manifest",
            draft=parts["draft"],
            draft_segment=parts["draft_segment"],
        )

    @staticmethod
    def row_counts(max_rows: int) -> list[int]:
        """The one-token row counts ``measure`` times: 1, 2, 4, .. below ``max_rows``, and ``max_rows``."""
        return sorted({1, max_rows} | {2**i for i in range(1, 8) if 2**i < max_rows})

    @classmethod
    def measure(
        cls, backend, max_rows: int, max_width: int, context: int = 64, repeats: int = 3, draft=None
    ) -> "CallCosts":
        """Time the backend's calls on its own slots: n one-token rows for n = 1, 2, 4, .. ``max_rows`` and one
        row of w = 2 .. ``max_width`` tokens, at ``context`` positions of past, each the best of ``repeats``
        after a warm-up; with ``draft`` (a ``Segment``: the plan's draft step), n one-token rows of it too.
        Seconds, on the machine and threads that will decode. The past is computed once, in slot 0, and copied
        to the other slots (a prefill of every slot would cost ``max_rows`` times more)."""
        full = full_model(backend.config.num_layers)
        shared_past(backend, max_rows, context + max_width + 2, context)
        batched = {
            n: _best(backend, full, [Row(s, context, [1]) for s in range(n)], repeats) for n in cls.row_counts(max_rows)
        }
        alone = {1: batched[1]}
        alone.update({w: _best(backend, full, [Row(0, context, [1] * w)], repeats) for w in range(2, max_width + 1)})
        costs = cls(batched, alone, backend.rows_in_one_call, machine=machine_key(backend))
        if draft is not None:
            costs.time_draft(backend, draft, max_rows, context, repeats, past_ready=True)
        return costs

    def time_draft(self, backend, segment, max_rows: int, context: int = 64, repeats: int = 3, past_ready=False):
        """Time n one-token rows of the draft ``segment`` (n as ``measure``'s rows) into ``draft``. The draft
        steps read the verifier's KV of the past and write their own one position after it, as in a round."""
        if not past_ready:
            shared_past(backend, max_rows, context + 2, context)
        self.draft = {
            n: _best(backend, segment, [Row(s, context, [1]) for s in range(n)], repeats)
            for n in self.row_counts(max_rows)
        }
        self.draft_segment = segment.describe()


def shared_past(backend, slots: int, room: int, context: int) -> None:
    """Slots ``0..slots-1`` holding ``context`` positions of one past (computed once, copied) to attend to."""
    backend.reserve(room, slots=max(slots, 1))
    backend.run_rows(full_model(backend.config.num_layers), [Row(0, 0, [1] * context)])
    for slot in range(1, slots):
        backend.move_slot(0, slot, context)


def _best(backend, segment, rows: list[Row], repeats: int) -> float:
    """The fastest of ``repeats`` calls of ``rows`` on ``segment``, after a warm-up call."""
    backend.run_rows(segment, rows)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        backend.run_rows(segment, rows)
        times.append(time.perf_counter() - start)
    return min(times)


def call_costs(backend, stored, max_rows: int, max_width: int, draft=None) -> CallCosts:
    """What a batch of up to ``max_rows`` sequences drafting up to ``max_width - 1`` tokens prices its drafts with
    (``draft``: the plan's draft step segment, None for lookup-only plans): the build's costs (``stored``: a
    manifest's ``tuning["call_costs"]``, or None) when they were timed on this machine and backend and reach those
    sizes; otherwise timed now on ``backend`` (a few seconds). A stored curve of another draft segment (a server
    started with ``--plan``) is timed again alone."""
    if stored is not None:
        costs = CallCosts.from_dict(stored, "the manifest's tuning.call_costs")
        if costs.machine == machine_key(backend) and costs.covers(max_rows, max_width):
            if draft is not None and not (costs.has_draft(draft) and max(costs.draft) >= max_rows):
                costs.time_draft(backend, draft, max_rows)
            return costs
    return CallCosts.measure(backend, max_rows=max_rows, max_width=max_width, draft=draft)


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
    if costs.one_call:  # one call priced by its tokens: add drafted tokens in the order of what each brings
        a = {i: min(max(c.acceptance, 0.0), 0.999) for i, c in enumerate(choices)}
        gains = sorted(
            ((a[i] ** k, -k, i) for i, c in enumerate(choices) for k in range(1, c.available + 1)), reverse=True
        )  # the k-th drafted token of a sequence brings a^k expected tokens: each sequence's in order
        lengths, tokens = list(plain), float(n)
        for gain, _, i in gains:
            lengths[i] += 1
            tokens += gain
            rate = tokens / max(costs.round_cost([k + 1 for k in lengths]), 1e-12)
            if rate > best_rate:
                best, best_rate = list(lengths), rate
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
    """Whether one sequence's draft of some length up to ``length`` tokens (``draft_step`` seconds a token to draft:
    a model draft's steps, 0 for a lookup) and its verify make a batch of ``batch`` sequences produce more tokens
    per second than leaving it in the plain step (``best_draft_length``). Decided before drafting: a model draft's
    steps are its price, and a lookup's host time is saved when no draft it could make would pay."""
    return best_draft_length(costs, acceptance, length, draft_step, batch) > 0 if batch > 1 else True


def best_draft_length(costs: CallCosts, acceptance: float, length: int, draft_step: float, batch: int) -> int:
    """The draft length k <= ``length`` that makes a batch of ``batch`` sequences produce the most tokens per
    second when one of them drafts k tokens (``draft_step`` seconds each) and the others step plainly; 0 when
    no k beats the plain step. A long model draft may not pay under load where a short one does."""
    if batch <= 1:
        return length
    best, best_rate = 0, batch / max(costs.round_cost([1] * batch), 1e-12)
    for k in range(1, length + 1):
        spent = k * draft_step + costs.round_cost([1] * (batch - 1) + [k + 1])
        rate = (batch - 1 + expected_tokens(acceptance, k)) / max(spent, 1e-12)
        if rate > best_rate:
            best, best_rate = k, rate
    return best


def draft_step_segment(plan):
    """The segment one model draft step of ``plan`` (a plan read for the model's layer count) runs: what
    ``CallCosts.draft`` times; None for a plan without a model part."""
    return plan.kind.draft_segment if plan.has_model_part else None


def longest_draft(plan) -> int:
    """The longest chain a round of ``plan`` verifies besides its input token (what ``CallCosts`` should time)."""
    from ..drafting.plan import read_plan

    return read_plan(plan).longest_draft


__all__ = [
    "CallCosts",
    "Choice",
    "call_costs",
    "PRIOR_ACCEPTANCE",
    "choose_lengths",
    "expected_tokens",
    "longest_draft",
    "draft_pays",
    "best_draft_length",
    "draft_step_segment",
    "shared_past",
]
