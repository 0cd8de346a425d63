"""Autotuning passes: choose a draft plan by the expected-speedup objective (docs/design.md section 5).

``CosineAutotune`` ranks sublayers by cos(h_in, h_out) on calibration text (a sublayer that barely
turns the residual stream is cheap to drop) and scores "skip the n most similar" for every n.
``ExitLayerAutotune`` scores an early exit after every block. Both keep the best plan, with the
draft-length policy that maximises it, and record what they measured.
"""

from __future__ import annotations

import time

from tqdm.auto import tqdm

from speccompile.runtime.artifact.manifest import DraftPlan

from .acceptance_estimate import best_policy
from .budget import PERFECT, RATE_SLACK, agreement_seconds, exit_agreements, model_draft_bound, needed
from .ir import DecoderIR
from .pass_manager import BOUND_MARGIN, Pass, PassResult, incumbent
from .plans import EarlyExitHeads, LayerSkipPlan
from .tuning import TuningContext


def skip_units(context: TuningContext) -> list[tuple[str, int]]:
    """What a layer-skip plan can drop: every attention and MLP sublayer, or, on the generic path (which
    runs a model's blocks whole), every block but the first (block 0 always runs there)."""
    L = context.ir.config.num_layers
    if getattr(context.ir.decoder(), "whole_blocks", False):
        return [("block", i) for i in range(1, L)]
    return [(kind, i) for kind in ("attn", "mlp") for i in range(L)]


def cosine_ranking(context: TuningContext) -> list[tuple[str, int, float]]:
    """Skippable units, most skippable (highest cosine similarity of input and output) first."""
    rows = [(kind, i, float(context.cosine[1 if kind == "mlp" else 0, i])) for kind, i in skip_units(context)]
    return sorted(rows, key=lambda row: -row[2])


def skip_plan(ranking: list[tuple[str, int, float]], n: int, name: str = "layer-skip") -> DraftPlan:
    """Skip the first ``n`` units of ``ranking`` (a skipped block drops both of its sublayers)."""
    chosen = ranking[:n]
    return DraftPlan.of(
        name=name,
        skip_attn=sorted(i for kind, i, _ in chosen if kind in ("attn", "block")),
        skip_mlp=sorted(i for kind, i, _ in chosen if kind in ("mlp", "block")),
    )


def skip_counts(largest: int, score, grid: int = 10):
    """Skip counts to score, coarse to fine: an even grid of about ``grid`` counts over 1..largest, then
    halving steps around the best so far (``score(n)`` reads a count's result once it was scored). On a
    30-block model that is ~16 scored plans instead of 59, each a parallel forward over the calibration set."""
    step = max(1, largest // grid)
    candidates = sorted(set(range(1, largest + 1, step)) | {largest})
    yield from candidates
    seen = set(candidates)
    while step > 1:
        step //= 2
        best = max(seen, key=score)
        for n in (best - step, best + step):
            if 1 <= n <= largest and n not in seen:
                seen.add(n)
                yield n


PROBES = 8  # skip counts the layer-skip bound probes, evenly over 1..all units
PROBE_MARGIN = 0.15  # a probe's estimate on a quarter of the sequences, raised by 15%, bounds the full one
SCORING_SHARE = 0.5  # budgeted passes score candidates on half the calibration sequences ...
RESCORED = 3  # ... then the best few on all of them
EXIT_CANDIDATES = 4  # a budgeted early-exit pass scores the exits of highest bound only


def _past(p: Pass) -> bool:
    left = p.seconds_left()
    return left is not None and left <= 0


class CosineAutotune(Pass):
    """Rank sublayers by cosine similarity and score "skip the n most similar" for every n (``full``), or,
    budgeted, on half the calibration sequences with the best few rescored on all, until the deadline."""

    name = "cosine_autotune"

    def __init__(
        self, context: TuningContext, plan_name: str = "layer-skip", show_progress: bool = True, full: bool = True
    ):
        self.context, self.plan_name, self.show_progress, self.full = context, plan_name, show_progress, full
        self.adds = (plan_name,)

    def _probes(self) -> tuple[list, list[int], dict[int, float]]:
        """(the cosine ranking, the coarse grid of skip counts, each count's bound were its drafts always right)."""
        ranking = cosine_ranking(self.context)
        largest = len(ranking) - 1
        probes = sorted(set(range(1, largest + 1, max(1, largest // PROBES))) | {largest})
        return ranking, probes, {n: model_draft_bound(self.context, skip_plan(ranking, n), PERFECT) for n in probes}

    def least_seconds(self) -> float:
        """The bound's probes (those that could beat the incumbent even if always right), each about a quarter
        of a reference pass (a quarter of the sequences, most of the blocks): on a big model the bound alone
        can take more than a budget has left (measured: docs/history.md, 'Figures behind the code's constants')."""
        _, _, perfect = self._probes()
        probed = len(needed(perfect, incumbent(self.context.ir) * (1 + BOUND_MARGIN)))
        return probed * 0.25 * self.context.timings.get("reference_pass", 0.0)

    def bound(self, ir: DecoderIR) -> float:
        """Probe the coarse grid of skip counts on a quarter of the calibration sequences: at each, the larger of
        the geometric bound at its agreement (plus slack) and its replayed estimate there plus ``PROBE_MARGIN``
        (the estimate sees runs of matches, which the geometric model does not)."""
        ranking, probes, perfect = self._probes()
        sample = self.context.sample(0.25)
        bounds = dict(perfect)  # a probe whose perfect drafts cannot beat the incumbent is not profiled
        for n in needed(perfect, incumbent(ir) * (1 + BOUND_MARGIN)):
            plan = skip_plan(ranking, n)
            profile = self.context.profile(plan, sample)
            estimate = best_policy(profile, plan, self.context.costs, self.context.max_draft).expected_speedup
            bounds[n] = min(
                perfect[n],
                max(
                    model_draft_bound(self.context, plan, profile.match_rate + RATE_SLACK),
                    estimate * (1 + PROBE_MARGIN),
                ),
            )
        return max(bounds.values())

    def call(self, ir: DecoderIR) -> PassResult:
        start, before = time.perf_counter(), dict(ir.plans)
        ranking = cosine_ranking(self.context)
        refs = None if self.full else self.context.sample(SCORING_SHARE)
        scores = {}
        stopped = "grid"
        with tqdm(desc="cosine: scoring skip counts", disable=not self.show_progress) as bar:
            for n in skip_counts(len(ranking) - 1, lambda n: scores[n].expected_speedup):
                if scores and _past(self):
                    stopped = "budget"
                    break
                scores[n] = self.context.score(skip_plan(ranking, n), refs)
                bar.update(1)
        if refs is not None and refs is not self.context.references:  # the best few, on every sequence
            for n in sorted(scores, key=lambda n: -scores[n].expected_speedup)[:RESCORED]:
                scores[n] = self.context.score(skip_plan(ranking, n))
            scores = {n: scores[n] for n in sorted(scores, key=lambda n: -scores[n].expected_speedup)[:RESCORED]}
        self.context.cosine_scores.update({n: s.expected_speedup for n, s in scores.items()})
        best_n = max(scores, key=lambda n: scores[n].expected_speedup)
        best = scores[best_n]
        plan = skip_plan(ranking, best_n, self.plan_name)
        measured = self.context.record(
            "cosine",
            best,
            tuning_seconds=round(time.perf_counter() - start, 2),
            cosine_ranking=[[kind, i, round(c, 5)] for kind, i, c in ranking],
            skip_counts_scored=len(scores),
        )
        LayerSkipPlan(plan.skip_attn, plan.skip_mlp, best.max_draft, best.threshold, self.plan_name, measured).run(ir)
        return PassResult.after(ir, before, stopped_by=stopped)


class ExitLayerAutotune(Pass):
    """Score an early exit after every block (``full``), or, budgeted, only the exits whose bound from the
    shared-head agreement (``passes/budget.py``) is highest."""

    name = "exit_autotune"

    def __init__(
        self, context: TuningContext, plan_name: str = "early-exit", show_progress: bool = True, full: bool = True
    ):
        self.context, self.plan_name, self.show_progress, self.full = context, plan_name, show_progress, full
        self.adds = (plan_name,)

    def exit_bounds(self, floor: float | None = None) -> dict[int, float]:
        """Each exit's bound at its shared-head agreement (plus slack); an exit whose bound with perfect drafts
        is below ``floor`` keeps that one (its agreement, a head product over the calibration, is not needed)."""
        bounds = self._perfect_bounds()
        for e, m in exit_agreements(self.context, needed(bounds, floor)).items():
            plan = DraftPlan.of(name="candidate", exit_layer=e)
            bounds[e] = min(bounds[e], model_draft_bound(self.context, plan, m + RATE_SLACK))
        return bounds

    def _perfect_bounds(self) -> dict[int, float]:
        """Each exit's bound were its drafts always right (cheap: costs only)."""
        return {
            e: model_draft_bound(self.context, DraftPlan.of(name="candidate", exit_layer=e), PERFECT)
            for e in range(1, self.context.ir.config.num_layers)
        }

    def bound(self, ir: DecoderIR) -> float:
        return max(self.exit_bounds(incumbent(ir) * (1 + BOUND_MARGIN)).values())

    def least_seconds(self) -> float:
        """The shared-head agreements its bound reads (``agreement_seconds``: the exits that could beat the
        incumbent even if always right), and one exit scored over the calibration (about half a reference
        pass)."""
        exits = needed(self._perfect_bounds(), incumbent(self.context.ir) * (1 + BOUND_MARGIN))
        return agreement_seconds(self.context, exits) + 0.5 * self.context.timings.get("reference_pass", 0.0)

    def call(self, ir: DecoderIR) -> PassResult:
        start, before = time.perf_counter(), dict(ir.plans)
        exits = list(range(1, ir.config.num_layers))
        if not self.full:
            bounds = self.exit_bounds(incumbent(ir) * (1 + BOUND_MARGIN))
            exits = sorted(exits, key=lambda e: -bounds[e])[:EXIT_CANDIDATES]
        scores = {}
        for exit_layer in tqdm(exits, desc="early-exit: scoring exit layers", disable=not self.show_progress):
            if scores and _past(self):
                break
            scores[exit_layer] = self.context.score(DraftPlan.of(name="candidate", exit_layer=exit_layer))
        exit_layer = max(scores, key=lambda e: scores[e].expected_speedup)
        best = scores[exit_layer]
        ir.tuning["best_exit_layer"] = exit_layer
        agreement = dict(sorted(self.context.signals.get("exit_agreements", {}).items())) if not self.full else {}
        measured = self.context.record(
            "early-exit",
            best,
            tuning_seconds=round(time.perf_counter() - start, 2),
            per_exit_layer={
                str(e): {
                    "acceptance_rate": round(s.acceptance_rate, 4),
                    "expected_speedup": round(s.expected_speedup, 4),
                }
                for e, s in scores.items()
            },
            **({"exit_agreement": {str(e): round(m, 4) for e, m in agreement.items()}} if agreement else {}),
        )
        EarlyExitHeads(exit_layer, best.max_draft, best.threshold, self.plan_name, measured).run(ir)
        return PassResult.after(ir, before, exits_scored=len(scores))
