"""What both autotuners share: calibration references, the cost model, and plan scoring.

Built once per build (or tune) so that cosine ranking, exit-layer choice and (later) Bayesian search
score plans with the same acceptance estimator and the same measured costs, and are comparable.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from tqdm.auto import tqdm

from speccompile.runtime.manifest import DraftPlan

from .acceptance import Reference, RoundEstimate, best_policy, greedy_continuations, profile_plan, reference_pass
from .cost_model import CostModel, device_name, measure_costs
from .ir import DecoderIR


@dataclass
class TuningContext:
    ir: DecoderIR
    references: list[Reference]
    cosine: np.ndarray  # [2, L]: mean cos(h_in, h_out) of attention (row 0) and MLP (row 1) sublayers
    cost: CostModel
    max_draft: int
    device: str
    confirm_prompts: list[list[int]] = field(default_factory=list)
    confirm_tokens: int = 48
    cosine_scores: dict[int, float] = field(default_factory=dict)  # skip count -> expected speedup

    @classmethod
    def prepare(cls, ir: DecoderIR, prompts: list[list[int]], new_tokens: int, max_draft: int,
                show_progress: bool = True, confirm_prompts: int = 4, confirm_tokens: int = 48) -> "TuningContext":
        """Greedy-decode the calibration prompts with the full model, store its K/V, time the sublayers."""
        decoder = ir.decoder()
        with tqdm(total=len(prompts), desc="calibration: target continuations", disable=not show_progress) as bar:
            continuations = greedy_continuations(decoder, prompts, new_tokens, bar)
        cosine = np.zeros((2, ir.config.num_layers))
        references = []
        for prompt, continuation in tqdm(list(zip(prompts, continuations)), desc="calibration: reference pass",
                                         disable=not show_progress):
            references.append(reference_pass(decoder, prompt + continuation, len(prompt), cosine))
        cosine /= max(len(references), 1)
        cost = measure_costs(decoder, max_draft + 1)
        return cls(ir=ir, references=references, cosine=cosine, cost=cost, max_draft=max_draft,
                   device=device_name(cost.device), confirm_prompts=prompts[:confirm_prompts],
                   confirm_tokens=confirm_tokens)

    def score(self, plan: DraftPlan) -> RoundEstimate:
        """Best draft-length policy for ``plan`` and its expected speedup over plain decoding."""
        return best_policy(profile_plan(self.ir.decoder(), plan, self.references), plan, self.cost, self.max_draft)

    def record(self, method: str, estimate: RoundEstimate, **extra) -> dict:
        """The 'measured' block of a plan in the manifest."""
        return {
            "method": method,
            "acceptance_rate": round(estimate.acceptance_rate, 4),
            "mean_accepted": round(estimate.tokens_per_round, 4),
            "expected_speedup": round(estimate.expected_speedup, 4),
            "device": self.device,
            "calibration_sequences": len(self.references),
            **extra,
        }
