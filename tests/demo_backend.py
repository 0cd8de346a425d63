"""A demonstration backend, written outside speccompile: the seam a newcomer's backend plugs into.

One module and one registry line (``BACKENDS["demo"] = "demo_backend:DemoDescriptor"``): a numpy
implementation of the canonical decoder for plain Llama-shaped models (RMSNorm, rotary, grouped-query
attention, gated SiLU MLP), running whole-model segments only, so it serves plain decoding and the plans
that verify with the full model (lookup sources). Its descriptor says how it opens, what it checks before,
and what writes its files; the build writes, ``load`` opens and ``generate`` decodes through it without any
other file knowing its name (``tests/test_backend_seam.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
from safetensors.numpy import load_file, save_file

from speccompile.runtime.artifact.manifest import ArchConfig, Manifest
from speccompile.runtime.backends.base import Backend
from speccompile.runtime.backends.descriptor import BackendDescriptor
from speccompile.runtime.backends.weights_check import check_geometry, safetensors_shapes
from speccompile.runtime.errors import ArtifactError
from speccompile.runtime.segments import Segment

WEIGHTS = "demo/weights.safetensors"


def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


class DemoBackend(Backend):
    name = "demo"

    def __init__(self, config: ArchConfig, weights: dict[str, np.ndarray]):
        self.config, self.w = config, weights
        self.k: np.ndarray | None = None
        self.v: np.ndarray | None = None

    def reserve(self, max_len: int, slots: int = 1) -> None:
        if max_len > self.max_len:
            c = self.config
            shape = (c.num_layers, c.num_kv_heads, max_len, c.head_dim)
            k, v = np.zeros(shape, np.float32), np.zeros(shape, np.float32)
            if self.k is not None:
                k[:, :, : self.max_len], v[:, :, : self.max_len] = self.k, self.v
            self.k, self.v, self.max_len, self.slots = k, v, max_len, 1

    def replica(self) -> "DemoBackend":
        return DemoBackend(self.config, self.w)

    def unsupported(self, segment: Segment) -> str | None:
        whole = segment.start == 0 and segment.stop == self.config.num_layers
        plain = not segment.skip_attn and not segment.skip_mlp and segment.precision is None
        return None if whole and plain and segment.head is not None else "the demo backend runs the whole model only"

    def load_draft_head(self, head_file: str, root: Path | None) -> None:
        raise ArtifactError("the demo backend has no draft heads")

    def run(self, segment: Segment, pos: int, tokens: Sequence[int] | None = None, count: int = 0) -> np.ndarray:
        c, w = self.config, self.w
        t = len(tokens)
        positions = np.arange(pos, pos + t, dtype=np.float32)
        freqs = np.outer(positions, w["rope_inv_freq"])
        emb = np.concatenate([freqs, freqs], axis=-1)
        cos, sin = np.cos(emb) * c.rope_attention_scaling, np.sin(emb) * c.rope_attention_scaling
        half = c.rotary_dim // 2

        def rotate(x):  # [heads, T, head_dim], half-split rotary on the first rotary_dim dims
            r = x[..., : c.rotary_dim]
            turned = np.concatenate([-r[..., half:], r[..., :half]], axis=-1)
            return np.concatenate([r * cos + turned * sin, x[..., c.rotary_dim :]], axis=-1)

        x = w["embed.weight"][np.asarray(tokens)]
        group = c.num_heads // c.num_kv_heads
        causal = np.triu(np.full((t, pos + t), -np.inf, np.float32), k=pos + 1)
        for i in range(c.num_layers):
            p = f"layers.{i}."
            h = _rms(x, w[p + "attn_norm.weight"], c.norm_eps)
            q = (h @ w[p + "attn.q.weight"].T).reshape(t, c.num_heads, c.head_dim).transpose(1, 0, 2)
            k = (h @ w[p + "attn.k.weight"].T).reshape(t, c.num_kv_heads, c.head_dim).transpose(1, 0, 2)
            v = (h @ w[p + "attn.v.weight"].T).reshape(t, c.num_kv_heads, c.head_dim).transpose(1, 0, 2)
            self.k[i, :, pos : pos + t], self.v[i, :, pos : pos + t] = rotate(k), v
            keys = np.repeat(self.k[i, :, : pos + t], group, axis=0)
            values = np.repeat(self.v[i, :, : pos + t], group, axis=0)
            scores = rotate(q) @ keys.transpose(0, 2, 1) * c.scale + causal
            scores = np.exp(scores - scores.max(-1, keepdims=True))
            attended = (scores / scores.sum(-1, keepdims=True)) @ values
            x = x + attended.transpose(1, 0, 2).reshape(t, -1) @ w[p + "attn.o.weight"].T
            h = _rms(x, w[p + "mlp_norm.weight"], c.norm_eps)
            gate = h @ w[p + "mlp.gate.weight"].T
            x = x + (gate / (1 + np.exp(-gate)) * (h @ w[p + "mlp.up.weight"].T)) @ w[p + "mlp.down.weight"].T
        head = w["embed.weight"] if c.tie_word_embeddings else w["lm_head.weight"]
        return (_rms(x, w["norm.weight"], c.norm_eps) @ head.T).astype(np.float32)


class DemoDescriptor(BackendDescriptor):
    name = "demo"
    writer = "demo_backend:write_files"

    def open(self, root: Path, manifest: Manifest, plans: dict, device: str) -> DemoBackend:
        return DemoBackend(manifest.config, load_file(str(root / manifest.backends["demo"]["weights"])))

    def check_before_open(self, root: Path, manifest: Manifest) -> None:
        relative = manifest.backends["demo"]["weights"]
        check_geometry(manifest.config, safetensors_shapes(root / relative, relative), relative)


def write_files(root: Path, ir, records: dict, onnx_memory: dict | None = None) -> dict:
    """The demo backend's one file: the canonical weights, float32, as numpy safetensors."""
    (root / "demo").mkdir(exist_ok=True)
    save_file({k: v.detach().float().numpy() for k, v in ir.weights.items()}, str(root / WEIGHTS))
    return {"weights": WEIGHTS}
