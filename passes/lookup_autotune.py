"""Tune model-free and hybrid plans by replaying their drafters over the calibration continuations.

Small real models are rarely redundant enough for a cheap subgraph draft; what pays there are drafts
that cost nothing (docs/design.md section 2). This pass scores, with the same objective as the subgraph
tuners (expected speedup from replayed rounds and the runner's measured step costs):

- ``lookup``: n-gram lookup over the prompt and output (and, with a datastore, retrieval from the
  calibration text), over a small grid of n-gram sizes and draft lengths;
- ``hybrid``: the best lookup sources in front of each model plan already in the IR (a lookup hit
  drafts the round, the model's subgraph drafts otherwise, extended by a lookup continuation), with
  the model part's draft length and threshold and the smallest n-gram size re-chosen for the hybrid.

Retrieval is scored honestly: each half of the calibration sequences is replayed against a datastore
built from the *other* half (a datastore always contains the text it was built from); the artifact's
datastore is then built from all of them.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import replace

from speccompile.runtime.artifact.manifest import DraftPlan
from speccompile.runtime.drafting import describe, has_model_part, options
from speccompile.runtime.drafting.retrieval import Datastore

from .acceptance_estimate import THRESHOLDS
from .budget import hybrid_bound
from .ir import DecoderIR
from .pass_manager import Pass, PassResult
from .plans import tuned_target
from .replay import estimate_rounds, replay, round_mix
from .tuning import LOOKUP_MAX_DRAFT, TuningContext

DATASTORE_FILE = "retrieval/datastore.safetensors"
HELD_OUT_DATASTORE_FILE = "retrieval/confirm-held-out.safetensors"  # tuning only, never in the artifact
NGRAM_SIZES = ((1, 3), (2, 3), (2, 5), (3, 5), (1, 5))
LOOKUP_DRAFTS = (2, 4, 6, 8, LOOKUP_MAX_DRAFT)
CHAIN_PLAN = "lookup-chain"  # the best chain, kept beside a tree that was priced above it


def lookup_grid(retrieval: bool):
    """Every lookup plan the tuner scores: sources x n-gram sizes x draft length x the longest match that
    drafts one token only (0: none; a 1- or 2-token match predicts the next token far more often than
    the ones after it, and a 2-token verify costs about one step where a longer one costs more)."""
    sources = [["ngram"]] + ([["ngram", "retrieval"], ["retrieval"]] if retrieval else [])
    for lookup, (lo, hi), k in itertools.product(sources, NGRAM_SIZES, LOOKUP_DRAFTS):
        shorts = [0] + ([s for s in (1, 2) if lo <= s < hi] if "ngram" in lookup else [])
        for short in shorts:
            yield DraftPlan.of(
                name="lookup",
                lookup=lookup,
                lookup_max_draft=k,
                sources={
                    "ngram": {"min": lo, "max": hi, "short": short},
                    "retrieval": {"datastore": DATASTORE_FILE if "retrieval" in lookup else None},
                },
            )


TREE_BRANCHES = (2, 3, 4)


def tree_grid(chain: DraftPlan, most_tokens: int):
    """Token-tree variants of the best chain plan (``runtime/drafting/tree_lookup.py``): its sources and n-gram sizes, up to
    ``TREE_BRANCHES`` continuations, each up to a draft length of ``LOOKUP_DRAFTS``, in a tree of at most
    ``most_tokens`` nodes (the verify sizes the backend's costs were timed at)."""
    for branches, k in itertools.product(TREE_BRANCHES, LOOKUP_DRAFTS):
        for nodes in sorted({min(n, most_tokens) for n in (k + 2, k + 4, 2 * k, 3 * k)}):
            if nodes > k:
                yield replace(chain, lookup_branches=branches, lookup_max_draft=k, tree_nodes=nodes)


def _past(p: Pass) -> bool:
    left = p.seconds_left()
    return left is not None and left <= 0


class LookupAutotune(Pass):
    """The best lookup plan over ``lookup_grid`` (then, with ``hybrid_with``, its hybrids: ``HybridAutotune``).

    Where a token tree of the best chain's sources is priced above the chain, the tree becomes ``lookup`` and the
    chain stays beside it as ``lookup-chain``, so that confirmation times the two in turns and the default is the
    one that ran faster (where the turns cannot tell them apart, the tree: ``ChooseDefaultPlan`` settles a tie
    between plans priced alike by the higher price). Why: a tree's estimate leans on the verify-cost curve (a few
    timed calls per size), and the tree priced highest has run slower than its chain (measured: docs/history.md,
    'Figures behind the code's constants')."""

    name = "lookup_autotune"
    adds = ("lookup", CHAIN_PLAN, "hybrid")

    def __init__(
        self,
        context: TuningContext,
        retrieval: bool = False,
        hybrid_with: tuple[str, ...] = (),
        show_progress: bool = True,
    ):
        self.context, self.retrieval, self.hybrid_with = context, retrieval, hybrid_with
        self.show_progress = show_progress

    # -- scoring -----------------------------------------------------------------------------------
    def _score(self, plan: DraftPlan, profile=None):
        return score_lookup(self.context, plan, profile)

    def _build_datastores(self, ir: DecoderIR) -> None:
        refs = self.context.references
        sequences = [ref.tokens[0].tolist() for ref in refs]
        folder = self.context.workdir / "retrieval"
        folder.mkdir(parents=True, exist_ok=True)
        for fold in (0, 1):
            Datastore.build([s for i, s in enumerate(sequences) if i % 2 == fold]).save(
                folder / f"fold{fold}.safetensors"
            )
        Datastore.build(sequences).save(self.context.workdir / DATASTORE_FILE)
        # Confirmation decodes the first calibration prompts: it must not find their own continuations in
        # the datastore (a leak that "confirms" far more than the plan runs at), so it reads one built from the
        # other sequences.
        held_out = sequences[len(self.context.confirm_prompts) :] or [[]]
        Datastore.build(held_out).save(self.context.workdir / HELD_OUT_DATASTORE_FILE)
        self.context.confirm_datastore = HELD_OUT_DATASTORE_FILE

    def _best_lookup(self) -> tuple[tuple[DraftPlan, object, list], tuple[DraftPlan, object, list] | None]:
        """The best plan (a chain, or a tree priced above it) with its estimate and rounds, and the chain when
        the best is a tree."""
        best = None
        for plan in lookup_grid(self.retrieval):  # in full, budget or not: the cheapest pass, and the first plan
            estimate, rounds = self._score(plan)
            if best is None or estimate.expected_speedup > best[1].expected_speedup:
                best = (plan, estimate, rounds)
        self.trees = None
        if self.context.trees:  # token trees over the best chain's sources and sizes, where the backend verifies them
            chain, tree = best, None
            most = min(LOOKUP_MAX_DRAFT + 4, len(self.context.costs.forward) - 1)
            for plan in tree_grid(chain[0], most):
                estimate, rounds = self._score(plan)
                if tree is None or estimate.expected_speedup > tree[1].expected_speedup:
                    tree = (plan, estimate, rounds)
            if tree is not None:
                self.trees = {
                    name: {
                        "plan": describe(p),
                        "mean_accepted": round(e.tokens_per_round, 4),
                        "drafted_per_round": round(e.drafted_per_round, 4),
                        "expected_speedup": round(e.expected_speedup, 4),
                    }
                    for name, (p, e, _) in (("chain", chain), ("tree", tree))
                }
                if tree[1].expected_speedup > chain[1].expected_speedup:
                    return tree, chain
        return best, None

    def _keep(self, ir: DecoderIR, plan: DraftPlan, estimate, rounds: list, **extra) -> None:
        """Add ``plan`` to ``ir`` with its figures (``measured``) and the acceptance target they imply."""
        plan.measured = self.context.record(
            "lookup",
            estimate,
            round_mix=round_mix(rounds),
            drafted_per_round=round(estimate.drafted_per_round, 4),
            **extra,
        )
        plan.set_option("model", "target_acceptance", tuned_target(plan.measured))
        ir.add_plan(plan)

    # -- the pass ----------------------------------------------------------------------------------
    def call(self, ir: DecoderIR) -> PassResult:
        start, before = time.perf_counter(), dict(ir.plans)
        if self.retrieval:
            self._build_datastores(ir)
        (lookup, estimate, rounds), chain = self._best_lookup()
        extra = {"trees": self.trees} if self.trees else {}
        self._keep(ir, lookup, estimate, rounds, tuning_seconds=round(time.perf_counter() - start, 2), **extra)
        if chain is not None:
            self._keep(ir, replace(chain[0], name=CHAIN_PLAN), *chain[1:])
        self.context.signals["lookup_rounds"] = (rounds, lookup)
        if any("retrieval" in p.lookup for p in ir.plans.values()):
            ir.extra_files[DATASTORE_FILE] = self.context.workdir / DATASTORE_FILE
        if self.hybrid_with:
            hybrid = HybridAutotune(self.context, self.hybrid_with)
            hybrid.deadline = self.deadline
            ir = hybrid(ir).ir
        return PassResult.after(ir, before)


def score_lookup(context: TuningContext, plan: DraftPlan, profile=None):
    """Expected speedup and replayed rounds of a plan with a lookup part; retrieval is scored in two folds,
    each half of the sequences against the other half's datastore."""
    refs = context.references
    if "retrieval" not in plan.lookup:
        rounds = replay(plan, refs, profile, context.workdir)
    else:
        rounds = []
        for fold in (0, 1):
            held = [i for i in range(len(refs)) if i % 2 == fold]
            part = plan.with_options(retrieval={"datastore": f"retrieval/fold{1 - fold}.safetensors"})
            sub_profile = profile.subset(held) if profile is not None else None
            rounds += replay(part, [refs[i] for i in held], sub_profile, context.workdir)
    return estimate_rounds(rounds, plan, context.costs), rounds


class HybridAutotune(Pass):
    """The lookup plan in front of each model plan named in ``hybrid_with`` (a lookup hit drafts the round, the
    model's subgraph otherwise); keeps the best as plan ``hybrid``."""

    name = "hybrid_autotune"
    adds = ("hybrid",)

    def __init__(self, context: TuningContext, hybrid_with: tuple[str, ...], show_progress: bool = True):
        self.context, self.hybrid_with, self.show_progress = context, tuple(hybrid_with), show_progress
        self.needs = ("lookup", *self.hybrid_with)

    def _models(self, ir: DecoderIR) -> list[DraftPlan]:
        return [p for p in (ir.plans.get(name) for name in self.hybrid_with) if p is not None and has_model_part(p)]

    def requires(self, ir: DecoderIR) -> None:
        if "lookup" not in ir.plans:
            from .pass_manager import PassError

            raise PassError("hybrid_autotune puts the lookup plan in front of a model plan: run lookup_autotune first")

    def bound(self, ir: DecoderIR) -> float:
        """The lookup's own rounds where it drafts, each model plan's expected speedup (plus 10%) on the tokens of
        the rounds where it found nothing (``passes/budget.py``)."""
        return max(
            [hybrid_bound(self.context, 1.1 * (p.measured.get("expected_speedup") or 0.0)) for p in self._models(ir)],
            default=0.0,
        )

    def _best_hybrid(self, lookup: DraftPlan, model: DraftPlan) -> tuple[DraftPlan, object, list]:
        """The model part's draft length and threshold, and the smallest n-gram size worth a lookup round
        (a short match that beats the model's draft alone need not beat it in front of the model), chosen
        together; the lookup's sources and draft length stay the lookup plan's."""
        profile = self.context.profile(model)
        best = None
        sizes = sorted(set(NGRAM_SIZES) | {(options(lookup, "ngram").min, options(lookup, "ngram").max)})
        for (lo, hi), k, threshold in itertools.product(sizes, range(1, self.context.max_draft + 1), THRESHOLDS):
            if best is not None and _past(self):
                break
            plan = replace(
                model.with_options(
                    ngram={"min": lo, "max": hi, "short": min(options(lookup, "ngram").short, hi)},
                    retrieval={"datastore": lookup.option("retrieval", "datastore")},
                    model={"max_draft": k, "threshold": threshold, "adaptive": False},
                ),
                name="hybrid",
                lookup=list(lookup.lookup),
                lookup_max_draft=lookup.lookup_max_draft,
                measured={},
            )
            estimate, rounds = score_lookup(self.context, plan, profile)
            if best is None or estimate.expected_speedup > best[1].expected_speedup:
                best = (plan, estimate, rounds)
        return best

    def call(self, ir: DecoderIR) -> PassResult:
        before = dict(ir.plans)
        lookup = ir.plans["lookup"]
        hybrids = []
        for model in self._models(ir):
            t0 = time.perf_counter()
            hybrids.append(self._best_hybrid(lookup, model) + (model.name, time.perf_counter() - t0))
        if hybrids:
            plan, estimate, rounds, base, seconds = max(hybrids, key=lambda h: h[1].expected_speedup)
            plan.measured = self.context.record(
                "hybrid", estimate, tuning_seconds=round(seconds, 2), model_plan=base, round_mix=round_mix(rounds)
            )
            plan.set_option(
                "model", "target_acceptance", tuned_target(plan.measured)
            )  # adaptive stays off: the policy that was replayed
            ir.add_plan(plan)
        return PassResult.after(ir, before)
