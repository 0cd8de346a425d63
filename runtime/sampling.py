"""Turning logits into a distribution and a distribution into a token, identically for the draft and the verifier,
on the host (numpy) and on a device (torch tensors): one function each, whatever the array library.

Speculative sampling is lossless with respect to the *processed* target distribution (temperature,
top-k, top-p applied), so both sides must go through this one function. The host round and the device round
(``runtime/backends/torch/device_round.py``) both do: the functions take any array of the array API
(``array_api_compat`` gives numpy and torch one namespace), rows ``[..., vocab]``.

Any positive temperature is safe: the logits are shifted by their maximum *before* they are divided by
the temperature, in float64, so no value can overflow (the largest becomes 0, the others tend to -inf).
As the temperature tends to 0 the distribution tends to a one-hot on the argmax (greedy; exact ties
share the mass), with no overflow and no nan at any tiny temperature (even a subnormal one). The server
and the CLI both sample through here, so they follow the same rule.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from array_api_compat import array_namespace, is_numpy_namespace


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


def _namespace(array):
    """The array-API namespace of ``array``; numpy's for lists and numpy scalars."""
    return array_namespace(array if hasattr(array, "shape") else np.asarray(array))


def softmax(logits, temperature: float = 1.0):
    """softmax(logits / temperature) over the last axis, for any temperature > 0, in float64, without overflow (see
    the module docstring)."""
    xp = _namespace(logits)
    z = xp.astype(xp.asarray(logits), xp.float64)
    with np.errstate(over="ignore", divide="ignore", under="ignore"):  # (numpy's warnings; torch has none)
        z = (z - xp.max(z, axis=-1, keepdims=True)) / temperature  # <= 0 everywhere: exp cannot overflow
        e = xp.exp(z)
    return e / xp.sum(e, axis=-1, keepdims=True)


def _kth_largest(probs, k: int):
    """The k-th largest value of each row, kept as a last axis of 1 (a partition on numpy, topk on torch: both
    linear in the vocabulary, where a full sort is not)."""
    if is_numpy_namespace(_namespace(probs)):
        return np.partition(probs, -k, axis=-1)[..., -k:][..., :1]
    return probs.topk(k, dim=-1).values[..., -1:]


def probabilities(logits, params: SamplingParams):
    """The distribution plain sampling draws from, row by row: softmax(logits / T), then top-k, then top-p."""
    probs = softmax(logits, params.temperature)
    xp = array_namespace(probs)
    if params.top_k and params.top_k < probs.shape[-1]:
        probs = xp.where(probs >= _kth_largest(probs, params.top_k), probs, 0.0)
    if params.top_p < 1.0:
        order = xp.argsort(probs, axis=-1, descending=True, stable=True)
        ordered = xp.take_along_axis(probs, order, axis=-1)
        cumulative = xp.cumulative_sum(ordered, axis=-1)
        keep = cumulative - ordered < params.top_p * cumulative[..., -1:]
        keep = xp.take_along_axis(keep, xp.argsort(order, axis=-1), axis=-1)  # back to vocabulary order
        probs = xp.where(keep, probs, 0.0)
    return probs / xp.sum(probs, axis=-1, keepdims=True)


def sample_at(probs, u):
    """The token at ``u`` (a uniform in [0, 1), a 0-d or one-element array) of one distribution ``probs`` ``[vocab]``
    (need not be normalised) by inverse CDF, as a one-element array of the same library (no host read on a
    device); robust to the tiny float drift in cumulative sums."""
    xp = _namespace(probs)
    cdf = xp.cumulative_sum(probs)
    index = xp.searchsorted(cdf, xp.reshape(xp.asarray(u, dtype=cdf.dtype), (1,)) * cdf[-1], side="right")
    return xp.clip(index, max=probs.shape[-1] - 1)


def sample(probs, rng: np.random.Generator) -> int:
    """A token of ``probs`` ``[vocab]`` (numpy) at one uniform draw of ``rng`` (``sample_at``)."""
    return int(sample_at(probs, np.float64(rng.random()))[0])
