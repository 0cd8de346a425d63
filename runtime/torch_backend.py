"""PyTorch backend: the canonical decoder on a static KV cache, for the draft-and-verify loop.

Early-exit plans: a draft step runs blocks 0..E-1 on one token, keeps the hidden state at E for that
position, and applies the shared head. Those blocks are the full model's own, so their KV entries and
the kept hidden states are exactly what the verifier needs: ``verify`` runs blocks 0..E-1 only on the
round's last token and blocks E..L-1 on all of them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from safetensors.torch import load_file

from .decoder import Decoder, KVCache, build_decoder
from .manifest import ArchConfig, DraftPlan

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class TorchBackend:
    name = "torch"

    def __init__(self, decoder: Decoder, device: str = "cpu"):
        self.decoder = decoder
        self.config: ArchConfig = decoder.config
        self.device = device
        self.dtype = decoder.embed.weight.dtype
        self.cache: KVCache | None = None
        self.exit_hidden: torch.Tensor | None = None
        self.max_len = 0

    @classmethod
    def from_files(cls, weights_path: Path, config: ArchConfig, dtype: str = "float32", device: str = "cpu"):
        weights = load_file(str(weights_path), device="cpu")
        return cls(build_decoder(config, weights, dtype=DTYPES[dtype], device=device), device=device)

    def replica(self) -> "TorchBackend":
        """Another backend over the same weights with its own KV cache (one per concurrent sequence)."""
        return TorchBackend(self.decoder, device=self.device)

    def reserve(self, max_len: int) -> None:
        """Make sure the static cache holds ``max_len`` positions; reuse it across requests."""
        if self.cache is None or self.cache.max_len < max_len:
            self.cache = KVCache(self.config, max_len, dtype=self.dtype, device=self.device)
            self.exit_hidden = torch.zeros(1, max_len, self.config.hidden_size, dtype=self.dtype, device=self.device)
        self.max_len = max_len

    def _ids(self, tokens: Sequence[int]) -> torch.Tensor:
        return torch.tensor([list(tokens)], dtype=torch.long, device=self.device)

    def _numpy(self, logits: torch.Tensor) -> np.ndarray:
        return logits[0].float().cpu().numpy()

    @torch.inference_mode()
    def forward(self, tokens: Sequence[int], pos: int) -> np.ndarray:
        return self._numpy(self.decoder(self._ids(tokens), pos, self.cache))

    @torch.inference_mode()
    def draft(self, plan: DraftPlan, token: int, pos: int) -> np.ndarray:
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
        d, exit_layer = self.decoder, plan.exit_layer
        fresh = list(tokens[n_reuse:])
        h_new = d.run_blocks(d.embed_tokens(self._ids(fresh), pos + n_reuse), pos + n_reuse, self.cache, 0, exit_layer)
        h = torch.cat((self.exit_hidden[:, pos : pos + n_reuse], h_new), dim=1)
        return self._numpy(d.head(d.run_blocks(h, pos, self.cache, exit_layer)))
