"""Tune precision self-drafts (``runtime/drafting/kinds/precision.py``): the model's own graph with int8 / int4
products drafts, the full-precision model verifies.

A precision draft is priced and scored in three steps, each as close to what runs as it can be:

1. **Cost, timed in rounds on the backend** (``cost_model.measure_draft_rounds``): draft steps and the verify
   after them, alternating as a round runs them. Back-to-back timings may flatter a draft that runs apart from
   the verifier (on ONNX Runtime, when sessions' threads spin on after each call, a verify right after drafts
   costs far more than back-to-back: ``runtime/backends/onnx/backend.stop_spinning_after_runs``). The step and
   the verify's factor go into the costs every estimate reads (``StepCosts.draft_steps``, ``verify_after_draft``).
2. **First drafted token of a round, exactly** (``passes/acceptance_estimate.profile_plan`` with the draft's torch
   stand-in, ``passes/precision_estimate.py``): one parallel pass against the verifier's KV over every
   calibration continuation; the draft-length policy (alone) and the lookup sources' sizes (behind the lookup
   plan, a hybrid) are chosen on it as for any model draft.
3. **Later tokens, in the real loop** (``--method precision``; ``auto``'s quick pass keeps step 2's estimate):
   the best candidates decode the first calibration prompts with the backend (``decode_all``); their rounds,
   priced with the costs of step 1, give the estimate the plan keeps (the parallel pass reads the verifier's
   KV where a real round's later drafts read their own).

Schemes tried: int8 on torch (the int8 twin; torch has no fast int4 CPU product), int8 and int4 (block 32) on
ONNX Runtime. The best becomes plan ``precision``, the best of the other composition (alone, or behind lookup)
``precision-alone`` / ``precision-hybrid`` (``kept_compositions``); confirmation then times them in turns against
plain decoding.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import replace

import numpy as np
import torch

from speccompile.runtime.artifact.manifest import DraftPlan
from speccompile.runtime.backends.torch.decoder import Decoder
from speccompile.runtime.backends.torch.int8_twin import (
    SCALES_FILE,
    int8_kernel_missing,
    release_int8_twin,
    set_input_scales,
)
from speccompile.runtime.decoding.speculative import DecodeRequest, decode_all
from speccompile.runtime.drafting import has_model_part, options, read_plans
from speccompile.runtime.drafting.kinds.precision import precision_of
from speccompile.runtime.errors import ArtifactError
from speccompile.runtime.memory import return_freed_memory

from .acceptance_estimate import best_policy
from .budget import RATE_SLACK, geometric_bound, hybrid_bound
from .cost_model import _best_seconds, measure_draft_rounds
from .ir import DecoderIR
from .lookup_autotune import NGRAM_SIZES, score_lookup
from .pass_manager import Pass, PassResult
from .plans import tuned_target
from .precision_estimate import estimation_twin, int8_input_scales, release_twins
from .replay import ReplayedRound, estimate_rounds, round_mix
from .tuning import TuningContext

# ``least_seconds``' measured proportions: reference passes a scheme's scoring costs, its quantized export against
# the runner's first one, plain steps of the draft rounds' timing
PROFILE_PASSES, EXPORT_FACTOR, DRAFT_ROUND_STEPS = 4.0, 2.0, 50
SCHEMES = {"torch": ({"precision": "int8"},), "onnx": ({"precision": "int8"}, {"precision": "int4"})}
LOOKUP_FIELDS = ("lookup", "lookup_max_draft", "extend")
LOOKUP_SOURCES = ("ngram", "retrieval")  # the lookup plan's options a precision draft behind it keeps
REAL_LOOP_CANDIDATES = (
    2  # plans that decode in the real loop: the best alone and the best behind lookup, by the parallel estimate
)
TREE_BRANCHES = (2, 3)  # model-draft trees priced against each candidate's chain (``sources.model.branches``)
TREE_MARGIN = 1.03
"""How much higher than its chain the replay must price a model-draft tree for the tree to replace it. The replay
prices neither a draft step's runner-up search nor the tree verify's mask and cache compaction, and it has priced
trees within a fraction of a percent of their chains, while timed in turns
(``benchmarks/experiments/draft_branches.py``) the trees ran a few percent either side of them (measured:
docs/history.md, 'Figures behind the code's constants'). A replay that close cannot tell them apart, so the simpler
chain is kept."""


def precision_plan(params: dict, max_draft: int) -> DraftPlan:
    return DraftPlan.of(
        name="precision", kind="precision", params=dict(params), sources={"model": {"max_draft": max_draft}}
    )


def hybrid_ngram_sizes(lookup: DraftPlan) -> list[tuple[int, int]]:
    """The n-gram sizes a precision draft behind ``lookup`` is priced with: the lookup plan's own, and the
    pipeline's others (``lookup_autotune.NGRAM_SIZES``). Why not the lookup plan's alone: tuned to draft on its
    own, a lookup plan takes one-token matches, and behind a well-accepted draft those rounds cost more than they
    bring (measured: docs/history.md, 'Figures behind the code's constants')."""
    return sorted(set(NGRAM_SIZES) | {(options(lookup, "ngram").min, options(lookup, "ngram").max)})


def behind_lookup(plan: DraftPlan, lookup: DraftPlan) -> DraftPlan:
    """``plan`` behind ``lookup``'s sources (a lookup hit drafts the round, the precision draft otherwise)."""
    kept = {source: dict(lookup.sources[source]) for source in LOOKUP_SOURCES if source in lookup.sources}
    return replace(plan.with_options(**kept), **{field: getattr(lookup, field) for field in LOOKUP_FIELDS}, measured={})


def kept_compositions(scored: list) -> dict[str, tuple]:
    """The plans the pass adds, by name, from ``scored`` ((plan, estimate, rounds, parallel estimate) per
    candidate): the best as ``precision``, and the best of the other composition (the draft alone, or behind the
    lookup plan) as ``precision-alone`` / ``precision-hybrid``, so that confirmation times the two in turns. Why
    both: the two estimates can come within their own error of each other and swap order from build to build
    (measured: docs/history.md, 'Figures behind the code's constants'): the estimate cannot be trusted to pick
    between them, a paired race can (``confirm.Confirmer.race``)."""
    if not scored:
        return {}
    best = max(scored, key=lambda found: found[1].expected_speedup)
    kept = {"precision": best}
    others = [found for found in scored if bool(found[0].lookup) != bool(best[0].lookup)]
    if others:
        other = max(others, key=lambda found: found[1].expected_speedup)
        kept["precision-hybrid" if other[0].lookup else "precision-alone"] = other
    return kept


class PrecisionTune(Pass):
    name = "precision_tune"
    adds = ("precision", "precision-alone", "precision-hybrid")

    def __init__(
        self,
        context: TuningContext,
        prompts: int = 4,
        new_tokens: int = 48,
        show_progress: bool = True,
        quick: bool = False,
    ):
        """``quick`` (the ``auto`` method, inside its time budget): int8 only (the scheme accepted best on every
        model measured) and no real-loop step: the plan keeps the parallel estimate over every calibration
        continuation. A real loop short enough for the budget (two prompts of 32 tokens) overestimates by far and
        keeps the lookup plan out of confirmation's race (measured: docs/history.md, 'Figures behind the code's
        constants')."""
        self.context, self.show_progress, self.quick = context, show_progress, quick
        self.prompts, self.new_tokens = prompts, new_tokens
        self.schemes = SCHEMES.get(context.runner.name, SCHEMES["torch"])[: 1 if quick else None]
        self.real_loop = 0 if quick else REAL_LOOP_CANDIDATES
        # seconds per phase (bound, backend, draft_rounds, candidates, real_loop): the pass table's record
        self.phases: dict[str, float] = {}

    def _lap(self, phase: str, start: float) -> float:
        now = time.perf_counter()
        self.phases[phase] = round(self.phases.get(phase, 0.0) + now - start, 2)
        return now

    def least_seconds(self) -> float:
        """What the pass takes, from what calibration timed on this model and machine: per scheme, about
        ``PROFILE_PASSES`` reference passes (the bound's sample and the stand-in's scoring of every continuation)
        and, on ONNX Runtime, ``EXPORT_FACTOR`` times the runner's first export (the quantized graphs); the draft
        rounds' timing; the real loop's decodes. Why from calibration's timings: this follows the phases the
        pass table records (``phases``) on small and big models alike, where a rule from the plain step alone
        fell far short on big ones (measured: docs/history.md, 'Figures behind the code's constants')."""
        c = self.context
        plain = c.costs.plain_step()
        export = c.timings.get("runner_backend", 0.0) if c.runner.name != "torch" else 0.0
        per_scheme = PROFILE_PASSES * c.timings.get("reference_pass", 0.0) + EXPORT_FACTOR * export
        loop = self.real_loop * self.prompts * self.new_tokens * plain
        return len(self.schemes) * per_scheme + DRAFT_ROUND_STEPS * plain + loop

    def _decoder(self):
        return self.context.ir.decoder()

    def _smooth(self, ir: DecoderIR) -> None:
        """On torch: the int8 twin's SmoothQuant scales from the calibration continuations (once per build), set on
        the decoder the estimates and timings run, and shipped in the artifact for the runtime's twin
        (``runtime/backends/torch/int8_twin.py``). ONNX Runtime's ``MatMulNBits`` quantizes activations per block of 32: no
        smoothing there."""
        c, decoder = self.context, self._decoder()
        if (
            c.runner.name != "torch"
            or not isinstance(decoder, Decoder)
            or decoder.embed.weight.device.type != "cpu"
            or int8_kernel_missing()
        ):
            return
        if getattr(decoder, "int8_input_scales", None) is None:
            from safetensors.torch import save_file

            scales = int8_input_scales(decoder, [ref.tokens for ref in c.references])
            path = c.workdir / SCALES_FILE
            path.parent.mkdir(parents=True, exist_ok=True)
            save_file(scales, str(path))
            set_input_scales(decoder, scales)
            ir.extra_files[SCALES_FILE] = path

    # -- the bound: the int8 twin's agreement and its step, timed on torch --------------------------------------
    @torch.inference_mode()
    def bound(self, ir: DecoderIR) -> float:
        """The geometric round model at the int8 twin's agreement with the target (first drafted tokens, on a
        sample of the calibration continuations, plus ``RATE_SLACK``) and its step cost relative to the
        model's, both on torch (cheap: no export); behind the lookup plan when there is one."""
        c, start = self.context, time.perf_counter()
        decoder = self._decoder()
        if decoder.embed.weight.device.type != "cpu" or int8_kernel_missing():
            return 0.0  # the int8 twin runs on CPU only (a GPU build drafts no precision plan with this pass)
        c.runner.release()  # the twin and the torch decoder run here: not beside the backend's sessions
        self._smooth(ir)
        plan = precision_plan({"precision": "int8"}, c.max_draft)
        profile = c.profile(plan, c.sample(0.25))
        rate = float(np.concatenate(profile.matches).mean()) if profile.matches else 0.0
        release_twins(decoder)  # an ONNX Runtime stand-in scored the sample: not beside the torch twin that times
        return_freed_memory()
        twin = estimation_twin(decoder, "int8", "torch")
        ids = torch.tensor([[3]], device=decoder.embed.weight.device)
        full = min(_best_seconds(lambda: decoder(ids)) for _ in range(5))
        draft = min(_best_seconds(lambda: twin(ids)) for _ in range(5))
        plain = c.costs.plain_step()
        speedup = geometric_bound(rate + RATE_SLACK, draft / full, lambda t: c.costs.full(t) / plain, c.max_draft)[0]
        if c.runner.name != "torch":  # the torch twin priced the bound only: not in memory next to the sessions
            del twin
            release_int8_twin(decoder)
            return_freed_memory()
        bound = hybrid_bound(c, speedup) if "lookup" in ir.plans else speedup
        self._lap("bound", start)
        return bound

    # -- the pass ---------------------------------------------------------------------------------------------
    def _as_tree(self, found: tuple[DraftPlan, object, list | None], profile) -> tuple[DraftPlan, object, list | None]:
        """``found`` (a chain candidate) or its model-draft tree (``draft_branches``), whichever the replay over
        the calibration continuations prices higher with the backend's verify curve, a tree by ``TREE_MARGIN`` (both
        replayed, so the profile's approximations of later tokens apply to both alike); a tree's estimate is the
        chain's scaled by that ratio, so that it stays comparable with the other candidates'."""
        c = self.context
        plan, estimate, rounds = found
        if not c.trees:  # the tuning backend verifies no token trees
            return found
        chain, _ = score_lookup(c, plan, profile)
        best = found
        for branches in TREE_BRANCHES:
            tree_plan = plan.with_options(model={"branches": branches})
            tree, tree_rounds = score_lookup(c, tree_plan, profile)
            ratio = tree.expected_speedup / max(chain.expected_speedup, 1e-9)
            if ratio > TREE_MARGIN and ratio * estimate.expected_speedup > best[1].expected_speedup:
                best = (tree_plan, replace(tree, expected_speedup=ratio * estimate.expected_speedup), tree_rounds)
        return best

    def _candidates(self, ir: DecoderIR) -> list[tuple[DraftPlan, object, list | None]]:
        """(plan, estimate, replayed rounds) per scheme, alone and behind the lookup plan, by the parallel pass."""
        c = self.context
        lookup = ir.plans.get("lookup")
        found = []
        for params in self.schemes:
            plan = precision_plan(params, c.max_draft)
            profile = c.profile(plan)
            alone = best_policy(profile, plan, c.costs, c.max_draft)
            found.append(
                self._as_tree(
                    (
                        plan.with_options(
                            model={"max_draft": alone.max_draft, "threshold": alone.threshold, "adaptive": False}
                        ),
                        alone,
                        None,
                    ),
                    profile,
                )
            )
            if lookup is not None and lookup.lookup and not has_model_part(lookup):  # a tree's sources, as a chain
                best = None
                for (lo, hi), k in itertools.product(hybrid_ngram_sizes(lookup), range(2, c.max_draft + 1, 2)):
                    hybrid = behind_lookup(plan, lookup).with_options(
                        ngram={"min": lo, "max": hi, "short": min(options(lookup, "ngram").short, hi)},
                        model={"max_draft": k, "threshold": alone.threshold, "adaptive": False},
                    )
                    estimate, rounds = score_lookup(c, hybrid, profile)
                    if best is None or estimate.expected_speedup > best[1].expected_speedup:
                        best = (hybrid, estimate, rounds)
                found.append(self._as_tree(best, profile))
            if (left := self.seconds_left()) is not None and left <= 0:
                break
        return found

    def _real_rounds(self, backend, plan: DraftPlan) -> list[ReplayedRound]:
        """``plan``'s rounds as the runtime runs them on the first calibration prompts."""
        c = self.context
        if (
            plan.option("retrieval", "datastore") and c.confirm_datastore
        ):  # not the datastore holding these prompts' answers
            plan = plan.with_options(retrieval={"datastore": c.confirm_datastore})
        rounds = []
        for ref in c.references[: self.prompts]:
            prompt = ref.tokens[0, : ref.prompt_len].tolist()
            _, stats = decode_all(backend, DecodeRequest(prompt, self.new_tokens, eos_ids=c.eos), plan, c.workdir)
            # the model's drafted tokens per round: its rounds' tokens, less the lookup tokens that extended them
            rows = [
                (d, a, label, d if label.startswith("model") else 0)
                for (d, a), label in zip(stats.round_log, stats.round_sources)
            ]
            scale = stats.per_source.get("model", [0])[0] / max(sum(m for *_, m in rows), 1)
            rounds += [ReplayedRound(d, a, m * scale, len(plan.lookup or ()), 0, label) for d, a, label, m in rows]
        return rounds

    def call(self, ir: DecoderIR) -> PassResult:
        start, before, c = time.perf_counter(), dict(ir.plans), self.context
        self._smooth(ir)
        plans = {f"precision-{i}": precision_plan(params, c.max_draft) for i, params in enumerate(self.schemes)}
        try:
            backend = c.runner.backend(plans)
            backend.check_plans(read_plans(plans, backend.config.num_layers))
        except ArtifactError as exc:  # no kernel for it here (the generic torch path, standard ONNX graphs, a GPU)
            return PassResult(ir, skipped=f"no precision draft on this backend: {exc}")
        lap = self._lap("backend", start)
        timed = {}
        for plan in plans.values():
            draft, factor = measure_draft_rounds(backend, c.costs, plan, min(4, c.max_draft))
            timed[precision_of(plan.params)] = {
                "draft_step_ms": round(draft * 1e3, 3),
                "verify_after_draft": round(factor, 3),
            }
        backend = None  # the sessions are not needed while the stand-ins score on torch: not both in memory
        c.runner.release()
        lap = self._lap("draft_rounds", lap)
        candidates = sorted(self._candidates(ir), key=lambda found: -found[1].expected_speedup)
        release_twins(self._decoder())  # the stand-ins are for scoring only
        return_freed_memory()
        lap = self._lap("candidates", lap)
        if self.real_loop:  # the best candidates by the parallel estimate, scored again in the real loop
            scored, firsts = [], {}
            for found in candidates:  # the best of each composition, then the next best
                firsts.setdefault(bool(found[0].lookup), found)
            chosen = list(firsts.values())
            chosen += [found for found in candidates if all(found is not f for f in chosen)][
                : max(self.real_loop - len(chosen), 0)
            ]
            backend = c.runner.backend(plans)  # the same export's sessions, opened again
            for plan, parallel, _ in chosen:
                rounds = self._real_rounds(backend, plan)
                scored.append((plan, estimate_rounds(rounds, plan, c.costs), rounds, parallel))
            self._lap("real_loop", lap)
        else:  # quick: the parallel estimate (rounds replayed, if a hybrid)
            scored = [(plan, parallel, replayed or [], parallel) for plan, parallel, replayed in candidates]
        seconds = round(time.perf_counter() - start, 2)
        for name, (plan, estimate, rounds, parallel) in kept_compositions(scored).items():
            plan = replace(plan, name=name)
            plan.measured = c.record(
                "precision",
                estimate,
                tuning_seconds=seconds,
                estimate_from="parallel pass" if not self.real_loop else "real loop",
                parallel_estimate=round(parallel.expected_speedup, 4),
                parallel_acceptance=round(parallel.acceptance_rate, 4),
                **({"round_mix": round_mix(rounds)} if rounds else {}),
                draft_costs=timed,
            )
            plan.set_option("model", "target_acceptance", tuned_target(plan.measured))
            ir.add_plan(plan)
        return PassResult.after(ir, before, draft_costs=timed, phases=dict(self.phases))


__all__ = ["PrecisionTune", "behind_lookup", "hybrid_ngram_sizes", "kept_compositions", "precision_plan"]
