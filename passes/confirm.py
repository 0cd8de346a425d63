"""Confirm plans with real timed draft-and-verify runs, next to plain decoding of the same prompts.

The predicted speedup comes from a cost model; this pass measures the real one (tokens/s of the
runtime, speculative vs plain, greedy) and writes both into the plan's record.
"""

from __future__ import annotations

from tqdm.auto import tqdm

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


class ConfirmPlans(Pass):
    name = "confirm_plans"

    def __init__(self, prompts: list[list[int]], new_tokens: int, show_progress: bool = True):
        self.prompts, self.new_tokens, self.show_progress = prompts, new_tokens, show_progress

    def run(self, ir: DecoderIR) -> DecoderIR:
        backend = TorchBackend(ir.decoder())
        timed_decode(backend, self.prompts[0], 8, None)  # warm-up
        plain_time = plain_tokens = 0.0
        for prompt in self.prompts:
            _, stats = timed_decode(backend, prompt, self.new_tokens, None)
            plain_time, plain_tokens = plain_time + stats.seconds, plain_tokens + stats.new_tokens
        for plan in tqdm(list(ir.plans.values()), desc="confirming plans", disable=not self.show_progress):
            spec_time = spec_tokens = rounds = accepted = 0
            for prompt in self.prompts:
                _, stats = timed_decode(backend, prompt, self.new_tokens, plan)
                spec_time += stats.seconds
                spec_tokens += stats.new_tokens
                rounds += stats.rounds
                accepted += stats.accepted
            plan.measured["confirmed_speedup"] = round((spec_tokens / spec_time) / (plain_tokens / plain_time), 4)
            plan.measured["confirmed_mean_accepted"] = round((accepted + rounds) / max(rounds, 1), 4)
            plan.measured["confirmed_tokens_per_s"] = round(spec_tokens / spec_time, 2)
            plan.measured["plain_tokens_per_s"] = round(plain_tokens / plain_time, 2)
        return ir
