"""Helpers for the losslessness tests: run the runtime's decode loop on a decoder and check outputs
against plain greedy decoding under the near-tie rule of docs/design.md section 6."""

from __future__ import annotations

import numpy as np
import torch

from speccompile.runtime.artifact.manifest import DraftPlan
from speccompile.runtime.backends.torch.backend import TorchBackend
from speccompile.runtime.decoding.speculative import DecodeRequest, Stats, decode_all
from speccompile.runtime.sampling import SamplingParams, probabilities

NEAR_TIE = 1e-4


def run(
    backend: TorchBackend,
    prompt: list[int],
    new_tokens: int,
    plan: DraftPlan | None = None,
    params: SamplingParams = SamplingParams(),
    seed: int | None = None,
    eos=frozenset(),
    root=None,
) -> tuple[list[int], Stats]:
    """Decode to the end with the runtime's own loop; ``root`` holds files a plan's drafter reads."""
    return decode_all(backend, DecodeRequest(prompt, new_tokens, params, eos, seed), plan, root)


def sample_third_tokens(
    backend, prompt: list[int], plan: DraftPlan, params: SamplingParams, samples: int
) -> tuple[list[int], int]:
    """The 3rd sampled token of ``samples`` seeded speculative runs, and how many drafts were accepted in
    all (a chi-square test needs both the accept and the reject path: 0 < accepted < 2 * samples)."""
    thirds, accepted = [], 0
    for seed in range(samples):
        tokens, stats = run(backend, prompt, 3, plan, params, seed=seed)
        thirds.append(tokens[2])
        accepted += stats.accepted
    return thirds, accepted


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


def next_token_logits(decoder, plan: DraftPlan | None = None):
    """``step_logits`` for ``exact_marginals``: the full model's next-token logits, or a layer-skip draft's."""

    @torch.inference_mode()
    def step(sequences: list[list[int]]) -> np.ndarray:
        h = decoder.embed_tokens(torch.tensor(sequences), 0)
        h = decoder.run_blocks(
            h, 0, None, skip_attn=set(plan.skip_attn) if plan else set(), skip_mlp=set(plan.skip_mlp) if plan else set()
        )
        return decoder.head(h)[:, -1].float().numpy()

    return step


@torch.inference_mode()
def exact_marginals(
    step_logits, params: SamplingParams, prompt: list[int], vocab: int
) -> tuple[np.ndarray, np.ndarray]:
    """Exact distributions of the 2nd and 3rd sampled tokens after ``prompt``, enumerating the 1st and
    2nd; ``step_logits(sequences)`` returns the next-token logits ``[len(sequences), vocab]``."""
    p1 = probabilities(step_logits([prompt])[0], params)
    p2 = np.stack([probabilities(row, params) for row in step_logits([prompt + [a] for a in range(vocab)])])
    seqs3 = [prompt + [a, b] for a in range(vocab) for b in range(vocab)]
    p3 = np.stack([probabilities(row, params) for row in step_logits(seqs3)]).reshape(vocab, vocab, vocab)
    joint12 = p1[:, None] * p2
    return joint12.sum(0), (joint12[:, :, None] * p3).sum((0, 1))


def chi_square_pvalue(samples: list[int], expected: np.ndarray) -> float:
    """Goodness of fit of ``samples`` to the distribution ``expected``, cells of expected count < 5 pooled."""
    from scipy.stats import chisquare

    observed = np.bincount(samples, minlength=len(expected)).astype(float)
    exp = expected * len(samples)
    big = exp >= 5
    obs_cells = np.append(observed[big], observed[~big].sum())
    exp_cells = np.append(exp[big], exp[~big].sum())
    if exp_cells[-1] == 0:
        obs_cells, exp_cells = obs_cells[:-1], exp_cells[:-1]
    return float(chisquare(obs_cells, exp_cells * obs_cells.sum() / exp_cells.sum()).pvalue)


def backend_top2_gap(backend, tokens: list[int]) -> float:
    """The backend's own top-2 logit gap for the token after ``tokens`` (one prefill call)."""
    backend.reserve(len(tokens) + 1)
    top = np.sort(np.asarray(backend.forward(tokens, 0))[-1])[-2:]
    return float(top[1] - top[0])


def assert_speculative_is_plain(
    backend, gap_probe, prompts: list[list[int]], plan_map: dict, new_tokens: int, root=None
) -> None:
    """Greedy speculative == plain on every prompt and plan; a divergence only where ``gap_probe``'s own top-2
    gap is a near-tie (docs/design.md section 6), at most one in all; and the drafts were accepted at all."""
    near_ties = accepted = 0
    for prompt in prompts:
        plain, _ = run(backend, prompt, new_tokens)
        for plan in plan_map.values():
            spec, stats = run(backend, prompt, new_tokens, plan, root=root)
            accepted += stats.accepted
            if spec != plain:
                i = next((k for k, (a, b) in enumerate(zip(plain, spec)) if a != b), min(len(plain), len(spec)))
                gap = backend_top2_gap(gap_probe, prompt + plain[:i])
                assert gap < NEAR_TIE, (
                    f"{plan.name} diverges from plain at token {i}, top-2 gap {gap:.2e}: not rounding"
                )
                near_ties += 1
    assert near_ties <= 1 and accepted > 0, (near_ties, accepted)
