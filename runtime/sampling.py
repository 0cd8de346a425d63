"""Turning logits into a distribution, in numpy, identically for the draft and the verifier.

Speculative sampling is lossless with respect to the *processed* target distribution (temperature,
top-k, top-p applied), so both sides must go through this one function.

Any positive temperature is safe: the logits are shifted by their maximum *before* they are divided by
the temperature, in float64, so no value can overflow (the largest becomes 0, the others tend to -inf).
As the temperature tends to 0 the distribution tends to a one-hot on the argmax (greedy; exact ties
share the mass), with no overflow and no nan at any tiny temperature (even a subnormal one). The server
and the CLI both sample through here, so they follow the same rule.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


def softmax(logits: np.ndarray, temperature: float = 1.0) -> np.ndarray:
    """softmax(logits / temperature) for any temperature > 0, without overflow (see the module docstring)."""
    z = np.asarray(logits, dtype=np.float64)
    with np.errstate(over="ignore", divide="ignore", under="ignore"):
        z = (z - z.max(axis=-1, keepdims=True)) / temperature  # <= 0 everywhere: exp cannot overflow
        e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def probabilities(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The distribution plain sampling draws from: softmax(logits / T), then top-k, then top-p."""
    probs = softmax(logits, params.temperature)
    if params.top_k and params.top_k < probs.shape[-1]:
        kth = np.partition(probs, -params.top_k)[-params.top_k]
        probs = np.where(probs >= kth, probs, 0.0)
    if params.top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        cumulative = np.cumsum(probs[order])
        keep = cumulative - probs[order] < params.top_p * cumulative[-1]
        mask = np.zeros_like(probs, dtype=bool)
        mask[order[keep]] = True
        probs = np.where(mask, probs, 0.0)
    return probs / probs.sum()


def sample(probs: np.ndarray, rng: np.random.Generator) -> int:
    """Inverse-CDF sampling; robust to the tiny float drift in cumulative sums."""
    cdf = np.cumsum(probs)
    return int(min(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"), len(probs) - 1))
