"""Tune lookahead decoding (``runtime/drafting/lookahead.py``) and LogitSpec (``runtime/drafting/logitspec.py``) by running them:
their drafts come from the verifier's own outputs, so no replay over the calibration continuations can
stand in for the model (the lookup tuner's ``passes/replay.py`` can). Each candidate (window ``W``, pooled n-gram length ``N``, and, where the backend
verifies token trees, pooled n-grams as more branches next to the window) decodes the first calibration
prompts with the runner's backend; its rounds, as the runtime ran them, are priced with the backend's
measured step costs, like every other plan (``replay.estimate_rounds``). The best becomes plan
``lookahead``. LogitSpec is tried behind the lookup plan (a chain: its best guess when the lookup finds
nothing) and, where the backend verifies trees, in the lookup plan's tree; the best becomes plan
``logitspec``. Token Recycling (``runtime/drafting/recycling.py``) is tried alone and behind the lookup plan, as chains
and trees; the best becomes plan ``recycling``. Confirmation then times them against plain decoding like any
plan.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import replace

from speccompile.runtime.artifact.manifest import DraftPlan
from speccompile.runtime.decoding.speculative import DecodeRequest, decode_all
from speccompile.runtime.drafting import has_model_part

from .ir import DecoderIR
from .pass_manager import Pass, PassResult
from .plans import tuned_target
from .replay import ReplayedRound, estimate_rounds, round_mix
from .tuning import TuningContext

WINDOWS = (2, 4, 6)
# pooled 3-grams are accepted less than 2-grams (measured: docs/history.md, 'Figures behind the code's constants')
NGRAMS = (2,)
TREE_BRANCHES = 3  # pooled n-grams verified next to the window in a tree plan


LOGITSPEC_TOP_K = (2, 4, 8)


def logitspec_grid(trees: bool, behind: DraftPlan | None):
    """LogitSpec behind the lookup plan ``behind`` (a chain), and in its token tree where ``trees``."""
    if behind is None or not behind.lookup or has_model_part(behind) or "logitspec" in behind.lookup:
        return
    for k in LOGITSPEC_TOP_K:
        chain = replace(
            behind.with_options(logitspec={"top_k": k}),
            name="logitspec",
            lookup=behind.lookup + ["logitspec"],
            measured={},
        )
        yield chain
        if trees:
            yield replace(
                chain, lookup_branches=max(k, 2), lookup_max_draft=max(chain.lookup_max_draft, 4), tree_nodes=16
            )


RECYCLING_TREE_NODES = (8, 16)


def recycling_grid(trees: bool, behind: DraftPlan | None):
    """Token Recycling alone and behind the lookup plan ``behind`` (its sources draft when they hit), as chains and,
    where ``trees``, as token trees of ``RECYCLING_TREE_NODES`` tokens. Why both: where the lookup plan drafts
    most rounds, recycling alone runs well below it; where lookup misses most rounds, recycling behind it beats
    the lookup chain (measured: docs/history.md, 'Figures behind the code's constants')."""
    alone = DraftPlan.of(name="recycling", lookup=["recycling"], lookup_max_draft=4)
    bases = [alone]
    if behind is not None and behind.lookup and not has_model_part(behind) and "recycling" not in behind.lookup:
        bases.append(replace(behind, name="recycling", lookup=behind.lookup + ["recycling"], measured={}))
    for base in bases:
        yield base
        if trees:
            for nodes in RECYCLING_TREE_NODES:
                yield replace(base, lookup_branches=4, lookup_max_draft=max(base.lookup_max_draft, 4), tree_nodes=nodes)


def lookahead_grid(trees: bool, behind: DraftPlan | None = None, windows=WINDOWS, ngrams=NGRAMS):
    """Lookahead alone (chains, and trees of pooled n-grams next to the window where ``trees``), and behind the
    lookup plan ``behind`` when given (its sources draft when they hit, lookahead otherwise)."""
    for window, ngram in itertools.product(windows, ngrams):
        chain = DraftPlan.of(
            name="lookahead", lookup=["lookahead"], sources={"lookahead": {"window": window, "ngram": ngram}}
        )
        yield chain
        if trees:
            yield replace(chain, lookup_branches=TREE_BRANCHES + 1, tree_nodes=window + TREE_BRANCHES * (ngram - 1))
        if behind is not None and behind.lookup and not has_model_part(behind) and "lookahead" not in behind.lookup:
            yield replace(
                behind.with_options(lookahead={"window": window, "ngram": ngram}),
                name="lookahead",
                lookup=behind.lookup + ["lookahead"],
                measured={},
            )


class LookaheadTune(Pass):
    name = "lookahead_tune"
    adds = ("lookahead", "logitspec", "recycling")

    def __init__(self, context: TuningContext, prompts: int = 3, new_tokens: int = 32, quick: bool = False):
        """``quick`` (the ``auto`` method): window 2 only, on fewer tokens."""
        self.context, self.prompts, self.new_tokens, self.quick = context, prompts, new_tokens, quick

    def least_seconds(self) -> float:
        return 4 * self.prompts * self.new_tokens * self.context.costs.plain_step()

    def _rounds(self, backend, plan: DraftPlan) -> list[ReplayedRound]:
        if (
            plan.option("retrieval", "datastore") and self.context.confirm_datastore
        ):  # not the datastore holding these prompts' answers
            plan = plan.with_options(retrieval={"datastore": self.context.confirm_datastore})
        rounds = []
        for ref in self.context.references[: self.prompts]:
            prompt = ref.tokens[0, : ref.prompt_len].tolist()
            request = DecodeRequest(prompt, self.new_tokens, eos_ids=self.context.eos)
            _, stats = decode_all(backend, request, plan, self.context.workdir)
            rounds += [
                ReplayedRound(d, a, 0, 1, 0, label) for (d, a), label in zip(stats.round_log, stats.round_sources)
            ]
        return rounds

    def _add(self, ir: DecoderIR, best, start: float) -> None:
        plan, estimate, rounds = best
        plan.measured = self.context.record(
            plan.name,
            estimate,
            tuning_seconds=round(time.perf_counter() - start, 2),
            round_mix=round_mix(rounds),
            drafted_per_round=round(estimate.drafted_per_round, 4),
        )
        plan.set_option("model", "target_acceptance", tuned_target(plan.measured))
        ir.add_plan(plan)

    def _best(self, backend, plans, behind: DraftPlan | None, scale: float, required: bool):
        """The plan of ``plans`` with the best expected speedup (a plan behind the lookup plan ``behind``, whose
        sources it drafts first, scaled by ``scale``), within the pass's deadline; ``required``: score at least
        one whatever the time."""
        best = None
        for plan in plans:
            if (best is not None or not required) and (left := self.seconds_left()) is not None and left <= 0:
                break
            rounds = self._rounds(backend, plan)
            estimate = estimate_rounds(rounds, plan, self.context.costs)
            if behind is not None and behind.lookup and plan.lookup[: len(behind.lookup)] == behind.lookup:
                estimate = replace(estimate, expected_speedup=estimate.expected_speedup * scale)
            if best is None or estimate.expected_speedup > best[1].expected_speedup:
                best = (plan, estimate, rounds)
        return best

    def call(self, ir: DecoderIR) -> PassResult:
        start, before = time.perf_counter(), dict(ir.plans)
        backend = self.context.runner.backend({})
        grid = dict(windows=(2,), ngrams=(2,)) if self.quick else {}
        behind = ir.plans.get("lookup")
        scale = 1.0  # a plan behind the lookup plan: its gain over that plan on these prompts, times its estimate
        if behind is not None and behind.measured.get("expected_speedup"):
            alone = estimate_rounds(self._rounds(backend, behind), behind, self.context.costs).expected_speedup
            scale = behind.measured["expected_speedup"] / alone
        self._add(
            ir,
            self._best(backend, lookahead_grid(self.context.trees, behind, **grid), behind, scale, required=True),
            start,
        )
        if not self.quick:
            for grid in (logitspec_grid(self.context.trees, behind), recycling_grid(self.context.trees, behind)):
                best = self._best(backend, grid, behind, scale, required=False)
                if best is not None:
                    self._add(ir, best, start)
        return PassResult.after(ir, before)


__all__ = ["LookaheadTune", "lookahead_grid", "recycling_grid"]
