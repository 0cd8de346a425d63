"""Confirm plans with real timed draft-and-verify runs, next to plain decoding of the same prompts.

The predicted speedup comes from a cost model; this measures the real one (time of the runtime's
speculative vs plain greedy decoding of the same prompts, on the backend that will run the artifact)
and writes it next to the prediction, with the prediction's error. A plan that does not beat plain
decoding in its own confirmation never becomes the default.
"""

from __future__ import annotations

from tqdm.auto import tqdm

from speccompile.runtime.manifest import DraftPlan
from speccompile.runtime.speculative import DecodeRequest, Stats, decode_all

from .base import Pass
from .ir import DecoderIR


def timed_decode(backend, prompt, new_tokens, plan, root=None) -> tuple[list[int], Stats]:
    return decode_all(backend, DecodeRequest(prompt, new_tokens), plan, root)


class Confirmer:
    """Times plans against plain decoding on the same prompts.

    Plain and speculative runs are interleaved prompt by prompt and repeated, keeping each one's fastest
    run: interference from other work on the machine only ever adds time, so the minimum is the
    estimate of the undisturbed speed, and interleaving exposes both modes to the same conditions.
    """

    def __init__(self, backend, prompts: list[list[int]], new_tokens: int, repeats: int = 2, root=None):
        """``backend`` runs the plans (the runner's: torch or ONNX Runtime); ``root`` holds files plans
        read (a retrieval datastore)."""
        self.backend, self.root = backend, root
        self.prompts, self.new_tokens, self.repeats = prompts, new_tokens, repeats
        timed_decode(self.backend, prompts[0], 8, None)  # warm-up

    def _fastest(self, prompt, plan) -> tuple[list[int], Stats]:
        runs = [timed_decode(self.backend, prompt, self.new_tokens, plan, self.root) for _ in range(self.repeats)]
        return min(runs, key=lambda run: run[1].seconds)

    def measure(self, plan: DraftPlan) -> dict:
        plain_seconds = spec_seconds = tokens = rounds = accepted = 0
        identical = True
        mix: dict[str, int] = {}
        for prompt in self.prompts:
            plain_out, plain = self._fastest(prompt, None)
            spec_out, spec = self._fastest(prompt, plan)
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
    """Confirm every plan not yet confirmed, and record the prediction error."""

    name = "confirm_plans"

    def __init__(self, context, show_progress: bool = True):
        self.context, self.show_progress = context, show_progress

    def run(self, ir: DecoderIR) -> DecoderIR:
        confirmer = None
        c = self.context
        desc = f"confirming plans on {c.runner.name}"
        for plan in tqdm(list(ir.plans.values()), desc=desc, disable=not self.show_progress):
            if "confirmed_speedup" not in plan.measured:
                confirmer = confirmer or Confirmer(c.runner.backend(ir.plans), c.confirm_prompts, c.confirm_tokens,
                                                   root=c.workdir)
                plan.measured.update(confirmer.measure(plan))
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
        best = max(ir.plans, key=lambda name: ir.plans[name].measured.get("confirmed_speedup", 0.0))
        speedup = ir.plans[best].measured.get("confirmed_speedup", 0.0)
        ir.tuning["best_confirmed_speedup"] = speedup
        ir.default_plan = best if speedup > self.min_speedup else None
        if self.keep_only_default:
            winner = ir.plans[best]
            winner.measured["chosen_over"] = {
                name: plan.measured.get("confirmed_speedup") for name, plan in ir.plans.items() if name != winner.name
            }
            ir.plans = {winner.name: winner}
        return ir
