"""The time budget of an ``auto`` build, and the bounds that let it skip passes that cannot pay.

``Budget`` starts with the build command and covers everything: loading the model, calibration, the tuning
passes, confirmation and writing the artifact. Its default (``default_seconds``) is ``BUDGET_STEPS`` plain
decode steps of the model as timed here, capped by the model's size (``cap_seconds``: 50 s plus 0.25 s per
million parameters, so 84 s for a 135M-parameter model, 199 s for a 0.6B one, 360 s for a 1.24B one): a fast machine
builds in less, a slow one never in more. The cap is known once the model is loaded, before calibration,
which is sized by it (``planned``): the target's continuations stop at ``CALIBRATION_SHARE`` of the budget
(fewer, shorter continuations on a big model), the reference pass over them at ``REFERENCE_SHARE``, timings
take ``TIMING_SHARE`` each, and confirmation's minimum turns are made short enough to fit ``CONFIRM_SHARE``.
Confirmation and the artifact's export get a reserve (``reserve``); tuning passes run in what is left before
it (``tuning_left``). A confirmation turn starts only if it can end by the deadline, so a build overruns its
budget by at most its final write.

Bounds. Before a tuning pass spends its time it publishes an upper bound on the expected speedup any plan
it can add reaches, from cheap signals, and ``PassManager`` skips it when the bound is below the incumbent.
A model draft's bound is the geometric round model (every drafted token accepted independently with
probability ``rate``) at the best draft length, with the plan's draft step cost and the backend's measured
verify-cost curve (``geometric_bound``). ``rate`` is optimistic: the draft's measured agreement with the
target on the calibration continuations plus ``RATE_SLACK`` (early exit, layer skip), or, for a draft that
must still be trained (an exit adapter), the shared-head agreement at its exit with a share
``ADAPTER_GAIN`` of the remaining gap closed. These are estimates, not theorems: the pass table records each
pass's bound next to what it then reached, so a bound that was beaten shows.
"""

from __future__ import annotations

import time

import torch
from tqdm.auto import tqdm

from speccompile.runtime.artifact.manifest import DraftPlan

RATE_SLACK = 0.1  # added to a measured agreement: the subset it was measured on, and correlated matches
ADAPTER_GAIN = 0.5  # share of the shared-head exit's disagreements an adapter may fix: optimistic, above the share
# measured (docs/history.md, 'Figures behind the code's constants'), as a bound must be
BUDGET_STEPS = 2500  # default budget in plain decode steps (torch sublayer timings), enough that a build on fast
# (packed) torch steps, whose fixed costs do not shrink with the step, still reaches the precision pass instead of
# shipping a slower lookup plan (figures: docs/history.md, 'Figures behind the code's constants')
MIN_SECONDS, MAX_SECONDS = 15.0, 3600.0
CAP_BASE_SECONDS, CAP_SECONDS_PER_MILLION = 50.0, 0.25  # the default budget's cap by model size (``cap_seconds``)
CALIBRATION_SHARE = 0.2  # of the planned budget: the most the target's calibration continuations take
REFERENCE_SHARE = 0.15  # ... the reference pass over them (what it takes on a 0.6B model's shape: docs/history.md,
# 'Figures behind the code's constants')
TIMING_SHARE = 0.05  # ... each of the two timings (torch sublayers, the runner's steps), beyond a few rounds
CONFIRM_SHARE = 0.3  # ... the minimum confirmation turns (their length is cut to fit)
AGREEMENT_STRIDE = 4  # every 4th calibration position scores exit agreement: it ranks the exits almost as every
# position does (measured: docs/history.md, 'Figures behind the code's constants')
MIN_AGREEMENT_POSITIONS = 256  # ... unless that leaves fewer positions than this


def cap_seconds(parameters: int) -> float:
    """The most a default budget may be for a model of ``parameters``: ``CAP_BASE_SECONDS`` plus
    ``CAP_SECONDS_PER_MILLION`` per million parameters (a bigger model needs longer calibration, timings and
    confirmation turns; not proportionally longer, or a 1B model would take tens of minutes)."""
    return float(min(max(CAP_BASE_SECONDS + CAP_SECONDS_PER_MILLION * parameters / 1e6, MIN_SECONDS), MAX_SECONDS))


def default_seconds(plain_step_seconds: float, parameters: int | None = None) -> float:
    """The default budget of a build: ``BUDGET_STEPS`` plain decode steps of this model on this machine, at
    most ``cap_seconds(parameters)``."""
    seconds = BUDGET_STEPS * plain_step_seconds
    if parameters is not None:
        seconds = min(seconds, cap_seconds(parameters))
    return float(min(max(seconds, MIN_SECONDS), MAX_SECONDS))


class Budget:
    """Seconds for the whole build from ``start``; ``clock`` is injectable (tests). ``total`` None: set
    later from the measured step time (``default_seconds``); until then ``cap`` (from the model's size, once
    it is loaded) is what calibration is sized by."""

    exempt = frozenset({"confirm_plans", "choose_default_plan"})  # always run, on the reserve

    def __init__(self, total: float | None = None, clock=time.perf_counter, cap: float | None = None):
        self.total, self.clock, self.start, self.cap = total, clock, clock(), cap
        self.reserve = 0.0  # seconds kept for confirmation and writing the artifact
        self.write_reserve = 0.0  # the part of it kept for writing the artifact
        self.measure_reserve = 0.0  # the part of confirmation's kept for what the build measures after it
        self.user_set = total is not None

    def planned(self) -> float | None:
        """The budget's seconds as far as known: the total, or before it is set the cap."""
        return self.total if self.total is not None else self.cap

    def share(self, fraction: float) -> float | None:
        """``fraction`` of the planned budget, in seconds (None: no budget planned)."""
        planned = self.planned()
        return None if planned is None else fraction * planned

    def elapsed(self) -> float:
        return self.clock() - self.start

    def left(self) -> float:
        return (self.total or 0.0) - self.elapsed()

    def progress(self) -> str:
        """What the progress lines show: the seconds left of the whole budget."""
        planned = self.planned()
        if planned is None:
            return f"{self.elapsed():.0f}s used"
        return f"{max(planned - self.elapsed(), 0):.0f}s of {planned:.0f}s left"

    def tuning_left(self) -> float:
        return self.left() - self.reserve

    def tuning_deadline(self) -> float:
        """When tuning passes should be done, as a ``time.perf_counter`` time."""
        return time.perf_counter() + self.tuning_left()

    def final_deadline(self) -> float:
        """When confirmation should be done (the measurements after it and the artifact still to come), as a
        ``time.perf_counter`` time."""
        return time.perf_counter() + self.left() - self.write_reserve - self.measure_reserve

    def as_dict(self) -> dict:
        return {
            "seconds": round(self.total or 0.0, 1),
            "default": not self.user_set,
            **({"cap": round(self.cap, 1)} if self.cap is not None else {}),
            "reserve": round(self.reserve, 1),
            "used": round(self.elapsed(), 1),
        }


class BudgetBar(tqdm):
    """A progress bar that shows the build's time budget left next to its count (``budget`` None: a plain bar)."""

    def __init__(self, *args, budget: Budget | None = None, **kwargs):
        self.budget = budget
        super().__init__(*args, **kwargs)
        self._show_budget()

    def update(self, n=1):
        self._show_budget()
        return super().update(n)

    def _show_budget(self) -> None:
        if self.budget is not None and not self.disable:
            self.set_postfix_str(self.budget.progress(), refresh=False)


def geometric_bound(rate: float, draft_cost: float, verify, max_draft: int) -> tuple[float, int]:
    """Best expected speedup over draft lengths 1..max_draft (and the length) of a draft whose tokens are each
    accepted with probability ``rate``; ``draft_cost`` and ``verify(t)`` in plain-step units."""
    rate = min(max(rate, 0.0), 1.0)
    best = (0.0, 1)
    for k in range(1, max_draft + 1):
        tokens = sum(rate**i for i in range(k + 1))
        best = max(best, (tokens / (k * draft_cost + verify(k + 1)), k))
    return best


def model_draft_bound(context, plan: DraftPlan, rate: float) -> float:
    """``geometric_bound`` of ``plan`` (early exit: the verifier reuses its prefix) on the runner's costs."""
    costs = context.costs
    plain = costs.plain_step()
    return geometric_bound(
        rate, costs.draft_step(plan) / plain, lambda t: costs.verify(plan, t) / plain, context.max_draft
    )[0]


PERFECT = 1.0  # the acceptance rate of a draft that is always right: its geometric bound needs no signal


def needed(bounds_at_perfect: dict, floor: float | None) -> list:
    """The candidates whose bound with perfect drafts (``PERFECT``) reaches ``floor`` (None: all): only those need
    their signal measured, the others' bound is their perfect one, already short of the incumbent."""
    return [key for key, bound in bounds_at_perfect.items() if floor is None or bound >= floor]


@torch.inference_mode()
def exit_agreements(context, exits=None) -> dict[int, float]:
    """Shared-head agreement with the target after each block of ``exits`` (default: every block), on every
    ``AGREEMENT_STRIDE``-th position of the calibration continuations (every position of a small calibration
    set) (the reference pass's stored hidden states: one head product per exit). Each exit is computed once
    per tuning run, when first asked for, and shared by the early-exit, adapter and draft-vocabulary bounds."""
    decoder, L = context.ir.decoder(), context.ir.config.num_layers
    wanted = list(range(1, L)) if exits is None else list(exits)
    known = context.signals.setdefault("exit_agreements", {})
    missing = [e for e in wanted if e not in known]
    if missing:
        stride = _agreement_stride(context)
        hits, total = dict.fromkeys(missing, 0), 0
        for ref in context.references:
            targets = torch.as_tensor(ref.targets[::stride])
            if not len(targets) or ref.exits is None:
                continue
            total += len(targets)
            for e in missing:
                top = decoder.head(ref.exits[e][:, ::stride]).argmax(-1)[0].cpu()
                hits[e] += int((top == targets).sum())
        known.update({e: float(hits[e] / max(total, 1)) for e in missing})
    return {e: known[e] for e in wanted}


def _agreement_stride(context) -> int:
    """Every how many calibration positions ``exit_agreements`` scores (never fewer than the minimum)."""
    positions = sum(len(ref.targets) for ref in context.references)
    return max(1, min(AGREEMENT_STRIDE, positions // MIN_AGREEMENT_POSITIONS))


def agreement_seconds(context, exits=None) -> float:
    """About what ``exit_agreements`` still takes for ``exits`` (default: every block): one head product per
    scored position and exit not yet known, at the cost per position of one such product, timed once per
    tuning run on the first calibration sequence (the sublayer timings' head, a few cold tokens, priced it
    several times too high). A bound that reads them is not free on a big vocabulary: on a 1B model an early-exit
    bound can take more than the budget has left (measured: docs/history.md, 'Figures behind the code's constants')."""
    L = context.ir.config.num_layers
    wanted = range(1, L) if exits is None else exits
    known = context.signals.get("exit_agreements", {})
    missing = sum(1 for e in wanted if e not in known)
    scored_refs = [ref for ref in context.references if ref.exits is not None and len(ref.targets)]
    if not missing or not scored_refs:
        return 0.0
    stride = _agreement_stride(context)
    if "head_seconds_per_position" not in context.signals:
        hidden = scored_refs[0].exits[1 if L > 1 else 0][:, ::stride]
        head = context.ir.decoder().head
        with torch.inference_mode():
            head(hidden[:, :1])  # warm
            start = time.perf_counter()
            head(hidden)
        context.signals["head_seconds_per_position"] = (time.perf_counter() - start) / hidden.shape[1]
    scored = sum(len(ref.targets[::stride]) for ref in scored_refs)
    return missing * scored * context.signals["head_seconds_per_position"]


def lookup_hit_share(context, rounds, plan: DraftPlan) -> tuple[float, float, float]:
    """From a lookup plan's replayed rounds: (tokens, cost of the rounds where the lookup drafted, tokens of
    the rounds where it did not), cost in plain-step units."""
    costs = context.costs
    plain = costs.plain_step()
    tokens = hit_cost = miss_tokens = 0.0
    for r in rounds:
        tokens += r.accepted + 1
        if r.drafted:
            hit_cost += (r.lookups * costs.lookup + costs.verify(None, r.drafted + 1)) / plain
        else:
            miss_tokens += 1
    return tokens, hit_cost, miss_tokens


def hybrid_bound(context, model_speedup: float) -> float:
    """A hybrid of the lookup plan and a model draft of (optimistic) speedup ``model_speedup``: the lookup's own
    rounds where it drafts, the model's speed on the tokens of the rounds where it found nothing."""
    signal = context.signals.get("lookup_rounds")
    if signal is None:
        return float("inf")
    tokens, hit_cost, miss_tokens = lookup_hit_share(context, *signal)
    return tokens / (hit_cost + miss_tokens / max(model_speedup, 1e-9)) if tokens else 0.0
