"""Confirm plans with real timed draft-and-verify runs, next to plain decoding of the same prompts.

The predicted speedup comes from a cost model; this measures the real one (time of the runtime's
speculative vs plain greedy decoding of the same prompts, on the backend that will run the artifact)
and writes it next to the prediction, with the prediction's error. A plan that does not beat plain
decoding in its own confirmation never becomes the default.
"""

from __future__ import annotations

import dataclasses

from tqdm.auto import tqdm

from speccompile.runtime.manifest import DraftPlan
from speccompile.runtime.speculative import DecodeRequest, Stats, decode_all

from .base import Pass
from .ir import DecoderIR


def timed_decode(backend, prompt, new_tokens, plan, root=None, eos: frozenset[int] = frozenset()) -> tuple[list[int], Stats]:
    return decode_all(backend, DecodeRequest(prompt, new_tokens, eos_ids=eos), plan, root)


class Confirmer:
    """Times plans against plain decoding on the same prompts.

    Plain and speculative runs are interleaved prompt by prompt and repeated, keeping each one's fastest
    run: interference from other work on the machine only ever adds time, so the minimum is the
    estimate of the undisturbed speed, and interleaving exposes both modes to the same conditions. The
    plain run of each prompt is repeated for every plan measured, and its fastest run so far is the
    reference, so later plans need one plain run per prompt instead of ``repeats``.
    """

    def __init__(self, backend, prompts: list[list[int]], new_tokens: int, repeats: int = 2, root=None,
                 eos: frozenset[int] = frozenset()):
        """``backend`` runs the plans (the runner's: torch or ONNX Runtime); ``root`` holds files plans
        read (a retrieval datastore); runs stop at an ``eos`` token, as generation does."""
        self.backend, self.root, self.eos = backend, root, frozenset(eos)
        self.prompts, self.new_tokens, self.repeats = prompts, new_tokens, repeats
        self._plain: dict[int, tuple[list[int], Stats]] = {}  # prompt index -> fastest plain run so far
        timed_decode(self.backend, prompts[0], 8, None)  # warm-up

    def _fastest(self, prompt, plan, repeats: int) -> tuple[list[int], Stats]:
        runs = [timed_decode(self.backend, prompt, self.new_tokens, plan, self.root, self.eos) for _ in range(repeats)]
        return min(runs, key=lambda run: run[1].seconds)

    def _fastest_plain(self, i: int) -> tuple[list[int], Stats]:
        run = self._fastest(self.prompts[i], None, 1 if i in self._plain else self.repeats)
        if i not in self._plain or run[1].seconds < self._plain[i][1].seconds:
            self._plain[i] = run
        return self._plain[i]

    def measure(self, plan: DraftPlan) -> dict:
        plain_seconds = spec_seconds = tokens = rounds = accepted = 0
        identical = True
        mix: dict[str, int] = {}
        for i, prompt in enumerate(self.prompts):
            plain_out, plain = self._fastest_plain(i)
            spec_out, spec = self._fastest(prompt, plan, self.repeats)
            identical &= plain_out == spec_out
            plain_seconds += plain.seconds
            spec_seconds += spec.seconds
            tokens += spec.new_tokens
            rounds += spec.rounds
            accepted += spec.accepted
            for label, count in spec.source_mix.items():
                mix[label] = mix.get(label, 0) + count
        return {
            "confirmed_round_mix": {label: round(count / max(rounds, 1), 4) for label, count in sorted(mix.items())},
            "confirmed_speedup": round(plain_seconds / spec_seconds, 4),
            "confirmed_mean_accepted": round((accepted + rounds) / max(rounds, 1), 4),
            "confirmed_tokens_per_s": round(tokens / spec_seconds, 2),
            "plain_tokens_per_s": round(tokens / plain_seconds, 2),
            "confirmed_identical": identical,
        }


class ConfirmPlans(Pass):
    """Confirm plans not yet confirmed by timed runs, and record the prediction error.

    With ``top`` set, only the ``top`` plans with the highest expected speedup are timed (the others keep
    their prediction and ``confirmed_speedup`` None): on a 135M model each confirmation costs tens of
    seconds, and a plan predicted well below the best is not worth them."""

    name = "confirm_plans"

    def __init__(self, context, show_progress: bool = True, top: int | None = None):
        self.context, self.show_progress, self.top = context, show_progress, top

    def run(self, ir: DecoderIR) -> DecoderIR:
        confirmer = None
        c = self.context
        ranked = sorted(ir.plans.values(), key=lambda p: -(p.measured.get("expected_speedup") or 0.0))
        chosen = ranked[: self.top] if self.top else ranked
        for plan in ranked[len(chosen):]:
            plan.measured.setdefault("confirmed_speedup", None)
        desc = f"confirming plans on {c.runner.name}"
        for plan in tqdm(chosen, desc=desc, disable=not self.show_progress):
            if plan.measured.get("confirmed_speedup") is None:
                confirmer = confirmer or Confirmer(c.runner.backend(ir.plans), c.confirm_prompts, c.confirm_tokens,
                                                   root=c.workdir, eos=c.eos)
                timed = plan
                if plan.datastore and c.confirm_datastore:  # never confirm on a datastore holding the prompts' answers
                    timed = dataclasses.replace(plan, datastore=c.confirm_datastore)
                plan.measured.update(confirmer.measure(timed))
            predicted = plan.measured.get("expected_speedup")
            if predicted:
                error = (predicted - plan.measured["confirmed_speedup"]) / plan.measured["confirmed_speedup"]
                plan.measured["prediction_error"] = round(error, 4)
        return ir


class ChooseDefaultPlan(Pass):
    """Make the plan with the highest confirmed speedup the artifact's default, but only if it beat
    plain decoding in its own confirmation: otherwise the artifact has no default plan and decodes
    plainly (``generate`` says so). With ``keep_only_default`` drop the other plans (``--method auto``
    keeps only the winner, recording the others' figures)."""

    name = "choose_default_plan"

    def __init__(self, keep_only_default: bool = False, min_speedup: float = 1.0):
        self.keep_only_default, self.min_speedup = keep_only_default, min_speedup

    def run(self, ir: DecoderIR) -> DecoderIR:
        best = max(ir.plans, key=lambda name: ir.plans[name].measured.get("confirmed_speedup") or 0.0)
        speedup = ir.plans[best].measured.get("confirmed_speedup") or 0.0
        ir.tuning["best_confirmed_speedup"] = speedup
        ir.default_plan = best if speedup > self.min_speedup else None
        if self.keep_only_default:
            winner = ir.plans[best]
            winner.measured["chosen_over"] = {
                name: plan.measured.get("confirmed_speedup") for name, plan in ir.plans.items() if name != winner.name
            }
            ir.plans = {winner.name: winner}
        return ir
