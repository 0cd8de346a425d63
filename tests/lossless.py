"""Helpers for the losslessness tests: run the runtime's decode loop on a decoder and check outputs
against plain greedy decoding under the near-tie rule of DESIGN.md section 6."""

from __future__ import annotations

import torch

from speccompile.runtime.manifest import DraftPlan
from speccompile.runtime.sampling import SamplingParams
from speccompile.runtime.speculative import DecodeRequest, DraftPolicy, Stats, decode
from speccompile.runtime.torch_backend import TorchBackend

NEAR_TIE = 1e-4


def run(backend: TorchBackend, prompt: list[int], new_tokens: int, plan: DraftPlan | None = None,
        params: SamplingParams = SamplingParams(), seed: int | None = None, eos=frozenset()) -> tuple[list[int], Stats]:
    stats = Stats()
    policy = DraftPolicy.from_plan(plan) if plan is not None else None
    backend.reserve(len(prompt) + new_tokens + (plan.max_draft + 1 if plan else 1))
    out: list[int] = []
    for new in decode(backend, DecodeRequest(prompt, new_tokens, params, eos, seed), plan, policy, stats):
        out.extend(new)
    return out, stats


@torch.inference_mode()
def top2_gap(decoder, tokens: list[int]) -> float:
    """Gap between the two largest full-model logits for the token after ``tokens``."""
    logits = decoder(torch.tensor([tokens]))[0, -1]
    top = torch.topk(logits.float(), 2).values
    return float(top[0] - top[1])


def assert_same_greedy(decoder, prompt: list[int], plain: list[int], spec: list[int]) -> int:
    """Equal token for token, or diverging only where the reference nearly ties; returns 1 on a tie."""
    if plain == spec:
        return 0
    i = next((k for k, (a, b) in enumerate(zip(plain, spec)) if a != b), min(len(plain), len(spec)))
    gap = top2_gap(decoder, prompt + plain[:i])
    assert gap < NEAR_TIE, (
        f"speculative output diverges from plain greedy at new token {i} where the top-2 logit gap is {gap:.2e} "
        f"(not a floating-point near-tie)\nplain {plain}\nspec  {spec}"
    )
    return 1
