"""Confirm plans with real timed draft-and-verify runs, next to plain decoding of the same prompts.

The predicted speedup comes from a cost model; this measures the real one (tokens/s of the runtime,
speculative vs plain, greedy) and writes it next to the prediction, with the prediction's error.
"""

from __future__ import annotations

from tqdm.auto import tqdm

from speccompile.runtime.manifest import DraftPlan
from speccompile.runtime.speculative import DecodeRequest, DraftPolicy, Stats, decode
from speccompile.runtime.torch_backend import TorchBackend

from .base import Pass
from .ir import DecoderIR


def timed_decode(backend, prompt, new_tokens, plan) -> tuple[list[int], Stats]:
    stats = Stats()
    policy = DraftPolicy.from_plan(plan) if plan is not None else None
    room = plan.max_draft + 1 if plan is not None else 1
    backend.reserve(len(prompt) + new_tokens + room)
    produced = []
    for new in decode(backend, DecodeRequest(prompt, new_tokens), plan, policy, stats):
        produced.extend(new)
    return produced, stats


class Confirmer:
    """Times plain decoding once, then any number of plans on the same prompts."""

    def __init__(self, decoder, prompts: list[list[int]], new_tokens: int):
        self.backend = TorchBackend(decoder)
        self.prompts, self.new_tokens = prompts, new_tokens
        timed_decode(self.backend, prompts[0], 8, None)  # warm-up
        self.plain = [timed_decode(self.backend, p, new_tokens, None) for p in prompts]
        self.plain_rate = sum(s.new_tokens for _, s in self.plain) / sum(s.seconds for _, s in self.plain)

    def measure(self, plan: DraftPlan) -> dict:
        runs = [timed_decode(self.backend, p, self.new_tokens, plan) for p in self.prompts]
        stats = [s for _, s in runs]
        rate = sum(s.new_tokens for s in stats) / sum(s.seconds for s in stats)
        rounds, accepted = sum(s.rounds for s in stats), sum(s.accepted for s in stats)
        return {
            "confirmed_speedup": round(rate / self.plain_rate, 4),
            "confirmed_mean_accepted": round((accepted + rounds) / max(rounds, 1), 4),
            "confirmed_tokens_per_s": round(rate, 2),
            "plain_tokens_per_s": round(self.plain_rate, 2),
            "confirmed_identical": all(out == ref for (out, _), (ref, _) in zip(runs, self.plain)),
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
    """Make the plan with the highest confirmed speedup the artifact's default."""

    name = "choose_default_plan"

    def run(self, ir: DecoderIR) -> DecoderIR:
        ir.default_plan = max(ir.plans, key=lambda name: ir.plans[name].measured.get("confirmed_speedup", 0.0))
        return ir
