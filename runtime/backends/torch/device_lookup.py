"""Prompt lookup as tensor operations on the device: ``NgramIndex.continuation`` over a token buffer.

Why on the device: in the device round (``device_round.py``) the committed tokens live in a device buffer
and the host reads the device once per round. A host lookup would need those tokens on the host before
the round it drafts (a read, or the previous round's read and an upload), and on a launch-bound GPU the
host's dict probes and the upload cost about as much as a step. Here the lookup is a handful of kernels
with fixed shapes, so it is captured inside the round's CUDA graph: the round ends by looking up the next
round's draft, and the count it finds travels in the round's one read.

The proposals are exactly the host index's (``runtime/drafting/ngram.py``, ``NgramIndex.continuation``,
which the tests compare): sizes ``max_n`` down to ``min_n``, the longest size that matches wins; within a
size, the latest earlier occurrence of the buffer's last ``n`` tokens that something followed; its
continuation up to ``limit`` tokens (one token when the match is at most ``short`` long), cut at the end
of the valid tokens. Cost: every size compares each of the buffer's ``C`` windows with the suffix, ``C x n``
comparisons in parallel per size: no host work and no data-dependent shape, flat in host time, linear
in device work (the buffer holds the cache's positions, a few thousand).

Imported only by the torch backend.
"""

from __future__ import annotations

import torch
from torch import Tensor


def ngram_continuation(
    tokens: Tensor, length: Tensor, min_n: int, max_n: int, limit: int, short: int = 0
) -> tuple[Tensor, Tensor]:
    """(``limit`` tokens ``[limit]``, of which the first ``count`` (a 0-d long tensor) are the continuation) for
    the first ``length`` tokens of ``tokens`` ``[C]`` (long, on any device; ``length`` a 0-d long tensor
    there). Tokens past ``count`` are whatever followed in the buffer: a caller masks them."""
    capacity, device = tokens.shape[0], tokens.device
    start = torch.full((), -1, dtype=torch.long, device=device)
    count = torch.zeros((), dtype=torch.long, device=device)
    for n in range(min_n, min(max_n, capacity - 1) + 1):  # shorter first: a longer match overrides it
        suffix = tokens.index_select(0, (length - n + torch.arange(n, device=device)).clamp(min=0))
        windows = tokens.unfold(0, n, 1)[: capacity - n]  # window s covers s..s+n-1; continued at s + n
        follows = torch.arange(n, capacity, device=device)
        valid = (windows == suffix).all(-1) & (follows < length) & (length >= n)
        latest = torch.where(valid, follows, -1).amax()
        found = latest >= 0
        take = 1 if n <= short else limit
        start = torch.where(found, latest, start)
        count = torch.where(found, (length - latest).clamp(max=take), count)
    at = (start.clamp(min=0) + torch.arange(limit, device=device)).clamp(max=capacity - 1)
    return tokens.index_select(0, at), count


__all__ = ["ngram_continuation"]
