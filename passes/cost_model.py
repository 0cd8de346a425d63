"""Cost of a draft plan from timings on this backend and device, not from parameter counts.

Timed once per build: one attention sublayer, one MLP sublayer, the embedding and the head, each for
1..k+1 tokens at a realistic context length. All blocks share shapes, so a sublayer's cost is the mean
over the blocks. Any plan's draft step and verify step is then a sum, which makes scoring hundreds of
candidate plans free.
"""

from __future__ import annotations

import platform
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch

from speccompile.runtime.decoder import Decoder, KVCache
from speccompile.runtime.manifest import DraftPlan


@dataclass
class CostModel:
    """Seconds per call; list index t-1 holds the cost for t tokens."""

    embed: list[float]
    attn: list[float]
    mlp: list[float]
    head: list[float]
    num_layers: int
    device: str = "cpu"

    def _blocks(self, t: int, n_attn: float, n_mlp: float) -> float:
        return n_attn * self.attn[t - 1] + n_mlp * self.mlp[t - 1]

    def plain_step(self) -> float:
        L = self.num_layers
        return self.embed[0] + self._blocks(1, L, L) + self.head[0]

    def draft_step(self, plan: DraftPlan) -> float:
        L = self.num_layers
        if plan.is_early_exit:
            return self.embed[0] + self._blocks(1, plan.exit_layer, plan.exit_layer) + self.head[0]
        return self.embed[0] + self._blocks(1, L - len(plan.skip_attn), L - len(plan.skip_mlp)) + self.head[0]

    def verify(self, plan: DraftPlan, t: int) -> float:
        """Cost of verifying ``t`` tokens (the round's input token plus t-1 drafts)."""
        L = self.num_layers
        if plan.is_early_exit:
            exit_layer = plan.exit_layer
            prefix_last = self.embed[0] + self._blocks(1, exit_layer, exit_layer)
            return prefix_last + self._blocks(t, L - exit_layer, L - exit_layer) + self.head[t - 1]
        return self.embed[t - 1] + self._blocks(t, L, L) + self.head[t - 1]

    def as_dict(self) -> dict:
        return asdict(self)


def _best_seconds(fn, sync=None) -> float:
    """Seconds one call of ``fn`` takes; ``sync`` (torch.cuda.synchronize on a GPU) waits for queued work
    before and after, or asynchronous kernel launches would be timed instead of the kernels."""
    if sync is not None:
        sync()
    start = time.perf_counter()
    fn()
    if sync is not None:
        sync()
    return time.perf_counter() - start


def device_name(device: str = "cpu") -> str:
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{name} ({torch.get_num_threads()} threads)"


@torch.inference_mode()
def measure_costs(decoder: Decoder, max_tokens: int, context: int = 128, rounds: int = 9) -> CostModel:
    """Time each kind of sublayer for 1..max_tokens tokens after ``context`` cached positions.

    Timings on a shared machine are noisy upwards only (interference adds time, never removes it), so
    every measurement is repeated in ``rounds`` interleaved passes over all token counts and the minimum
    is kept. A step over more tokens can never be cheaper than one over fewer, so the costs are finally
    made non-decreasing in the token count.
    """
    config = decoder.config
    device = decoder.embed.weight.device
    sync = torch.cuda.synchronize if device.type == "cuda" else None
    cache = KVCache(config, context + max_tokens, dtype=decoder.embed.weight.dtype, device=device)
    generator = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, config.vocab_size, (1, context), generator=generator).to(device)
    decoder(prefix, 0, cache)
    L = config.num_layers
    jobs = []  # per token count: (embed, attention, mlp, head) callables
    for t in range(1, max_tokens + 1):
        ids = torch.randint(0, config.vocab_size, (1, t), generator=generator).to(device)
        h = decoder.embed_tokens(ids, context)
        rope = decoder.rope_at(context, t)
        mask = decoder.attention_mask(context, t, context + t, device)
        jobs.append((
            lambda ids=ids: decoder.embed_tokens(ids, context),
            lambda h=h, rope=rope, mask=mask: [decoder.attention_sublayer(i, h, context, cache, rope, mask)
                                                for i in range(L)],
            lambda h=h: [decoder.mlp_sublayer(i, h) for i in range(L)],
            lambda h=h: decoder.head(h),
        ))
    for job in jobs:  # warm-up
        for fn in job:
            fn()
    best = np.full((max_tokens, 4), np.inf)
    for _ in range(rounds):
        for t, job in enumerate(jobs):
            for k, fn in enumerate(job):
                best[t, k] = min(best[t, k], _best_seconds(fn, sync))
    best[:, 1:3] /= L  # attention and MLP were timed over all blocks
    best = np.maximum.accumulate(best, axis=0)
    embed, attn, mlp, head = (best[:, k].tolist() for k in range(4))
    return CostModel(embed=embed, attn=attn, mlp=mlp, head=head, num_layers=L, device=str(device))
