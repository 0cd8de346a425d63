"""Confirm plans with real timed draft-and-verify runs, next to plain decoding of the same prompts.

The predicted speedup comes from a cost model; this measures the real one (time of the runtime's
speculative vs plain greedy decoding of the same prompts) and writes it next to the prediction, with
the prediction's error.
"""

from __future__ import annotations

from tqdm.auto import tqdm

from speccompile.runtime.manifest import DraftPlan
from speccompile.runtime.speculative import DecodeRequest, Stats, decode_all
from speccompile.runtime.torch_backend import TorchBackend

from .base import Pass
from .ir import DecoderIR


def timed_decode(backend, prompt, new_tokens, plan) -> tuple[list[int], Stats]:
    return decode_all(backend, DecodeRequest(prompt, new_tokens), plan)


class Confirmer:
    """Times plans against plain decoding on the same prompts.

    Plain and speculative runs are interleaved prompt by prompt and repeated, keeping each one's fastest
    run: interference from other work on the machine only ever adds time, so the minimum is the
    estimate of the undisturbed speed, and interleaving exposes both modes to the same conditions.
    """

    def __init__(self, decoder, prompts: list[list[int]], new_tokens: int, repeats: int = 2):
        self.backend = TorchBackend(decoder)
        self.prompts, self.new_tokens, self.repeats = prompts, new_tokens, repeats
        timed_decode(self.backend, prompts[0], 8, None)  # warm-up

    def _fastest(self, prompt, plan) -> tuple[list[int], Stats]:
        runs = [timed_decode(self.backend, prompt, self.new_tokens, plan) for _ in range(self.repeats)]
        return min(runs, key=lambda run: run[1].seconds)

    def measure(self, plan: DraftPlan) -> dict:
        plain_seconds = spec_seconds = tokens = rounds = accepted = 0
        identical = True
        for prompt in self.prompts:
            plain_out, plain = self._fastest(prompt, None)
            spec_out, spec = self._fastest(prompt, plan)
            identical &= plain_out == spec_out
            plain_seconds += plain.seconds
            spec_seconds += spec.seconds
            tokens += spec.new_tokens
            rounds += spec.rounds
            accepted += spec.accepted
        return {
            "confirmed_speedup": round(plain_seconds / spec_seconds, 4),
            "confirmed_mean_accepted": round((accepted + rounds) / max(rounds, 1), 4),
            "confirmed_tokens_per_s": round(tokens / spec_seconds, 2),
            "plain_tokens_per_s": round(tokens / plain_seconds, 2),
            "confirmed_identical": identical,
        }


class ConfirmPlans(Pass):
    """Confirm every plan not yet confirmed, and record the prediction error."""

    name = "confirm_plans"

    def __init__(self, prompts: list[list[int]], new_tokens: int, show_progress: bool = True):
        self.prompts, self.new_tokens, self.show_progress = prompts, new_tokens, show_progress

    def run(self, ir: DecoderIR) -> DecoderIR:
        confirmer = None
        for plan in tqdm(list(ir.plans.values()), desc="confirming plans", disable=not self.show_progress):
            if "confirmed_speedup" not in plan.measured:
                confirmer = confirmer or Confirmer(ir.decoder(), self.prompts, self.new_tokens)
                plan.measured.update(confirmer.measure(plan))
            predicted = plan.measured.get("expected_speedup")
            if predicted:
                error = (predicted - plan.measured["confirmed_speedup"]) / plan.measured["confirmed_speedup"]
                plan.measured["prediction_error"] = round(error, 4)
        return ir


class ChooseDefaultPlan(Pass):
    """Make the plan with the highest confirmed speedup the artifact's default; with
    ``keep_only_default`` drop the others (``--method auto`` keeps only the winner)."""

    name = "choose_default_plan"

    def __init__(self, keep_only_default: bool = False):
        self.keep_only_default = keep_only_default

    def run(self, ir: DecoderIR) -> DecoderIR:
        ir.default_plan = max(ir.plans, key=lambda name: ir.plans[name].measured.get("confirmed_speedup", 0.0))
        if self.keep_only_default:
            winner = ir.plans[ir.default_plan]
            winner.measured["chosen_over"] = {
                name: plan.measured.get("confirmed_speedup") for name, plan in ir.plans.items() if name != winner.name
            }
            ir.plans = {winner.name: winner}
        return ir
