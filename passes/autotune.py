"""Autotuning passes: choose a draft plan by the expected-speedup objective (DESIGN.md section 5).

``CosineAutotune`` ranks sublayers by cos(h_in, h_out) on calibration text (a sublayer that barely
turns the residual stream is cheap to drop) and scores "skip the n most similar" for every n.
``ExitLayerAutotune`` scores an early exit after every block. Both keep the best plan, with the
draft-length policy that maximises it, and record what they measured.
"""

from __future__ import annotations

import time

from tqdm.auto import tqdm

from speccompile.runtime.manifest import DraftPlan

from .base import Pass
from .ir import DecoderIR
from .plans import EarlyExitHeads, LayerSkip
from .tuning import TuningContext


def cosine_ranking(context: TuningContext) -> list[tuple[str, int, float]]:
    """Sublayers, most skippable (highest cosine similarity) first."""
    rows = [("attn", i, float(c)) for i, c in enumerate(context.cosine[0])]
    rows += [("mlp", i, float(c)) for i, c in enumerate(context.cosine[1])]
    return sorted(rows, key=lambda row: -row[2])


def skip_plan(ranking: list[tuple[str, int, float]], n: int, name: str = "layer-skip") -> DraftPlan:
    chosen = ranking[:n]
    return DraftPlan(
        name=name, skip_attn=sorted(i for kind, i, _ in chosen if kind == "attn"),
        skip_mlp=sorted(i for kind, i, _ in chosen if kind == "mlp"),
    )


class CosineAutotune(Pass):
    name = "cosine_autotune"

    def __init__(self, context: TuningContext, plan_name: str = "layer-skip", show_progress: bool = True):
        self.context, self.plan_name, self.show_progress = context, plan_name, show_progress

    def run(self, ir: DecoderIR) -> DecoderIR:
        start = time.perf_counter()
        ranking = cosine_ranking(self.context)
        best_n, best = 0, None
        for n in tqdm(range(1, len(ranking)), desc="cosine: scoring skip counts", disable=not self.show_progress):
            estimate = self.context.score(skip_plan(ranking, n))
            self.context.cosine_scores[n] = estimate.expected_speedup
            if best is None or estimate.expected_speedup > best.expected_speedup:
                best_n, best = n, estimate
        plan = skip_plan(ranking, best_n, self.plan_name)
        measured = self.context.record(
            "cosine", best, tuning_seconds=round(time.perf_counter() - start, 2),
            cosine_ranking=[[kind, i, round(c, 5)] for kind, i, c in ranking],
        )
        return LayerSkip(plan.skip_attn, plan.skip_mlp, best.max_draft, best.threshold, self.plan_name, measured).run(ir)


class ExitLayerAutotune(Pass):
    name = "exit_autotune"

    def __init__(self, context: TuningContext, plan_name: str = "early-exit", show_progress: bool = True):
        self.context, self.plan_name, self.show_progress = context, plan_name, show_progress

    def run(self, ir: DecoderIR) -> DecoderIR:
        start = time.perf_counter()
        scores = {}
        for exit_layer in tqdm(range(1, ir.config.num_layers), desc="early-exit: scoring exit layers",
                               disable=not self.show_progress):
            scores[exit_layer] = self.context.score(DraftPlan(name="candidate", exit_layer=exit_layer))
        exit_layer = max(scores, key=lambda e: scores[e].expected_speedup)
        best = scores[exit_layer]
        measured = self.context.record(
            "early-exit", best, tuning_seconds=round(time.perf_counter() - start, 2),
            per_exit_layer={str(e): {"acceptance_rate": round(s.acceptance_rate, 4),
                                     "expected_speedup": round(s.expected_speedup, 4)} for e, s in scores.items()},
        )
        return EarlyExitHeads(exit_layer, best.max_draft, best.threshold, self.plan_name, measured).run(ir)
