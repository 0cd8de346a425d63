"""PyTorch backend: the canonical decoder on a static KV cache, for the draft-and-verify loop.

Early-exit plans: a draft step runs blocks 0..E-1 on one token, keeps the hidden state at E for that
position, and applies the shared head. Those blocks are the full model's own, so their KV entries and
the kept hidden states are exactly what the verifier needs: ``verify`` runs blocks 0..E-1 only on the
round's last token and blocks E..L-1 on all of them.

CUDA graphs (opt-in: ``cuda_graphs=True``, or ``SPECCOMPILE_CUDA_GRAPHS=1`` for artifacts opened with
``load``): on a CUDA device the decode step, the draft step and the verify of up to ``GRAPH_TOKENS``
tokens are captured once and replayed (``runtime/torch_graphs.py``); prompts run eagerly. On CPU the
flag is ignored and every call runs eagerly, unchanged.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch
from safetensors.torch import load_file

from .decoder import Decoder, KVCache, build_decoder
from .manifest import ArchConfig, DraftPlan

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
GRAPH_TOKENS = 32  # longest step replayed from a CUDA graph (verify rounds); longer ones (prompts) run eagerly
GRAPH_CACHE_STEP = 256  # with graphs on, caches grow in these steps: a new cache means recapturing every graph


def cuda_graphs_requested() -> bool:
    """``SPECCOMPILE_CUDA_GRAPHS=1`` turns CUDA graphs on for backends opened from an artifact."""
    return os.environ.get("SPECCOMPILE_CUDA_GRAPHS", "0").strip().lower() in ("1", "true", "yes", "on")


class TorchBackend:
    name = "torch"

    def __init__(self, decoder: Decoder, device: str | None = None, cuda_graphs: bool = False,
                 capture: Callable | None = None):
        """``cuda_graphs`` replays fixed-shape steps from CUDA graphs when ``device`` is CUDA (ignored on
        CPU). ``capture`` replaces the graph capture (``torch_graphs.eager_capture`` runs the same static
        steps without graphs, on any device: how the bookkeeping is tested on CPU)."""
        self.decoder = decoder
        self.config: ArchConfig = decoder.config
        self.device = device or str(decoder.embed.weight.device)  # default: wherever the weights are
        self.dtype = decoder.embed.weight.dtype
        self.cache: KVCache | None = None
        self.exit_hidden: torch.Tensor | None = None
        self.max_len = 0
        self.cuda_graphs, self._capture = cuda_graphs, capture
        self.static = None  # torch_graphs.StaticSteps over the current cache, when graphs are on

    @property
    def graphed(self) -> bool:
        return self._capture is not None or (self.cuda_graphs and torch.device(self.device).type == "cuda")

    @classmethod
    def from_files(cls, weights_path: Path, config: ArchConfig, dtype: str = "float32", device: str = "cpu",
                   cuda_graphs: bool | None = None):
        weights = load_file(str(weights_path), device="cpu")
        graphs = cuda_graphs_requested() if cuda_graphs is None else cuda_graphs
        return cls(build_decoder(config, weights, dtype=DTYPES[dtype], device=device), device=device, cuda_graphs=graphs)

    def replica(self) -> "TorchBackend":
        """Another backend over the same weights with its own KV cache (one per concurrent sequence)."""
        return TorchBackend(self.decoder, device=self.device, cuda_graphs=self.cuda_graphs, capture=self._capture)

    def reserve(self, max_len: int) -> None:
        """Make sure the static cache holds ``max_len`` positions; reuse it across requests. With graphs
        on, the cache grows in steps of ``GRAPH_CACHE_STEP`` (a new cache invalidates every graph)."""
        if self.cache is None or self.cache.max_len < max_len:
            size = max_len
            if self.graphed:
                rounded = -(-max_len // GRAPH_CACHE_STEP) * GRAPH_CACHE_STEP
                size = max(max_len, min(rounded, self.config.max_position_embeddings))
            self.cache = KVCache(self.config, size, dtype=self.dtype, device=self.device)
            self.exit_hidden = torch.zeros(1, size, self.config.hidden_size, dtype=self.dtype, device=self.device)
            self.static = self._static_steps() if self.graphed else None
        self.max_len = max_len

    def _static_steps(self):
        from .torch_graphs import StaticSteps, cuda_capture_with

        capture = self._capture or cuda_capture_with(torch.cuda.graph_pool_handle())
        return StaticSteps(self.decoder, self.cache, self.exit_hidden, capture, max_tokens=GRAPH_TOKENS)

    def _ids(self, tokens: Sequence[int]) -> torch.Tensor:
        return torch.tensor([list(tokens)], dtype=torch.long, device=self.device)

    def _numpy(self, logits: torch.Tensor) -> np.ndarray:
        return logits[0].float().cpu().numpy()

    @torch.inference_mode()
    def forward(self, tokens: Sequence[int], pos: int) -> np.ndarray:
        if self.static is not None and self.static.fits(len(tokens)):
            return self._numpy(self.static.forward(tokens, pos))
        return self._numpy(self.decoder(self._ids(tokens), pos, self.cache))

    @torch.inference_mode()
    def draft(self, plan: DraftPlan, token: int, pos: int) -> np.ndarray:
        if self.static is not None:
            return self._numpy(self.static.draft(plan, token, pos))[-1]
        d = self.decoder
        h = d.embed_tokens(self._ids([token]), pos)
        if plan.is_early_exit:
            h = d.run_blocks(h, pos, self.cache, 0, plan.exit_layer)
            self.exit_hidden[:, pos : pos + 1] = h
        else:
            h = d.run_blocks(h, pos, self.cache, skip_attn=set(plan.skip_attn), skip_mlp=set(plan.skip_mlp))
        return self._numpy(d.head(h))[-1]

    @torch.inference_mode()
    def verify(self, plan: DraftPlan, tokens: Sequence[int], pos: int, n_reuse: int) -> np.ndarray:
        if not plan.is_early_exit:
            return self.forward(tokens, pos)
        if self.static is not None and self.static.fits(len(tokens)) and n_reuse < len(tokens):
            return self._numpy(self.static.verify_exit(plan, tokens, pos, n_reuse))
        d, exit_layer = self.decoder, plan.exit_layer
        fresh = list(tokens[n_reuse:])
        h_new = d.run_blocks(d.embed_tokens(self._ids(fresh), pos + n_reuse), pos + n_reuse, self.cache, 0, exit_layer)
        h = torch.cat((self.exit_hidden[:, pos : pos + n_reuse], h_new), dim=1)
        return self._numpy(d.head(d.run_blocks(h, pos, self.cache, exit_layer)))
