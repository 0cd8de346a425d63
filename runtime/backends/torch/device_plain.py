"""Plain decoding that stays on the torch backend's device: tokens picked there, read back in blocks.

The host step (``BatchDecoder._round`` with no draft) copies a step's logits to the host and picks the token
with numpy: on a GPU that is a device sync per token, and the next step cannot be launched before the host
has seen the last one, so the GPU idles while Python works. Here each step's token is picked on the device
(greedy argmax, or sampling by inverse CDF at a uniform drawn on the device) and fed to the next step as a
tensor; the host reads the tokens once per block of ``PLAIN_BLOCK`` steps (fewer when the request's budget
ends sooner). With CUDA graphs on, the step, the pick, and the bookkeeping that moves to the next position
(the step's input token and position, the block's token log) are one captured graph, so a block is
``PLAIN_BLOCK`` replays and one read.

What a block costs the user: stops are seen per block, so a sequence that ends early (EOS, a stop string)
has run up to ``PLAIN_BLOCK - 1`` steps the caller drops (their cache entries are past the sequence's end
and never read); a stream emits a block at a time.

Imported only by the torch backend (``TorchBackend.device_round`` with no drafter).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...sampling import SamplingParams, probabilities, sample_at
from ...segments import full_model
from .decoder import run_segment

# Plain steps per host read: long enough that the read's sync is a small share of the block and the GPU
# queue stays full, short enough that a stream stays close behind and an early stop wastes little.
PLAIN_BLOCK = 8


def pick_on_device(logits: Tensor, params: SamplingParams, u: Tensor | None) -> Tensor:
    """The plain step's token ``[1]`` from ``logits`` ``[vocab]``: the argmax (the host's ``pick``: the first
    of tied maxima), or the sample at uniform ``u`` (a one-element tensor) of ``probabilities`` (float64,
    the host's temperature, top-k and top-p rules)."""
    if params.greedy:
        return logits.argmax(-1).view(1)
    return sample_at(probabilities(logits.view(1, -1), params)[0], u)


def device_generator(device: torch.device, seed: int | None) -> torch.Generator:
    """The request's random generator on ``device``: seeded by its seed, or from the system without one."""
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


def params_key(params: SamplingParams) -> tuple:
    """What a captured step bakes in of the sampling parameters (a graph per distinct key)."""
    return (params.greedy, params.temperature, params.top_k, params.top_p)


class DevicePlain:
    """``plain(ctx, stats)``: the next tokens of plain decoding (up to ``PLAIN_BLOCK``, at most ``ctx.limit + 1``)
    of a sequence alone on a torch backend, with one host read (see the module docstring)."""

    def __init__(self, backend, seed: int | None, block: int = PLAIN_BLOCK):
        self.backend, self.block = backend, block
        self.full = full_model(backend.config.num_layers)
        self.device = torch.device(backend.device)
        self.generator = device_generator(self.device, seed)
        self.graphs: dict[tuple, object] = {}  # params_key -> replay, over ``self.static``'s buffers
        self.static = None  # the backend's StaticSteps the graphs were captured over (a new cache: new graphs)
        self.log = self.step_u = self.index = None

    @torch.inference_mode()
    def __call__(self, ctx, stats) -> list[int]:
        n = min(self.block, ctx.limit + 1)
        params = ctx.params
        token = torch.full((1,), int(ctx.history[-1]), dtype=torch.long, device=self.device)
        u = None if params.greedy else torch.rand(n, generator=self.generator, dtype=torch.float64, device=self.device)
        static = self.backend.static
        if static is not None and self.backend.reuses_prefix:
            return self._graphed(static, token, ctx.pos, n, params, u)
        picked = []
        for j in range(n):
            logits = self.backend.run_tensor(self.full, ctx.pos + j, token)
            token = pick_on_device(logits[-1], params, None if u is None else u[j : j + 1])
            picked.append(token)
        return torch.cat(picked).tolist()  # the block's one read

    def _graphed(self, static, token: Tensor, pos: int, n: int, params: SamplingParams, u: Tensor | None) -> list[int]:
        """``n`` replays of the captured step-and-pick, then one read of the block's token log."""
        if static is not self.static:  # a new static cache (the backend grew it): its buffers, new graphs
            self.static, self.graphs = static, {}
            self.log = torch.zeros(self.block, dtype=torch.long, device=self.device)
            self.step_u = torch.zeros(self.block, dtype=torch.float64, device=self.device)
            self.index = torch.zeros((), dtype=torch.long, device=self.device)
        static.check_room(pos, n)  # the replays advance the positions themselves: the whole block must fit
        ids, positions = static._inputs(token, 1, pos)
        self.index.zero_()
        if u is not None:
            self.step_u[:n].copy_(u)
        key = params_key(params)
        step = self.graphs.get(key)
        if step is None:
            step = self.graphs[key] = static.capture(self._step_fn(static, ids, positions, params))
            static.captures += 1
            positions.fill_(pos)  # a capture's warm-up ran the step: back to the block's start
            ids.copy_(token.view(1, 1))
            self.index.zero_()
        for _ in range(n):
            step()
        return self.log[:n].tolist()  # the block's one read

    def _step_fn(self, static, ids: Tensor, positions: Tensor, params: SamplingParams):
        decoder, cache, hidden, full = static.decoder, static.cache, static.hidden, self.full
        log, step_u, index = self.log, self.step_u, self.index

        def step() -> Tensor:
            logits = run_segment(decoder, full, ids, positions, cache, hidden, decoder.head)
            token = pick_on_device(logits[0, -1], params, step_u.index_select(0, index.view(1)))
            ids.copy_(token.view(1, 1))
            positions.add_(1)
            log.index_copy_(0, index.view(1), token)
            index.add_(1)
            return token

        return step


__all__ = ["PLAIN_BLOCK", "DevicePlain", "device_generator", "pick_on_device"]
