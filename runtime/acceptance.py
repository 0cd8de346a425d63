"""The acceptance rule, written once: which drafted tokens a verify keeps, and the token after them.

Every round (one sequence alone, or each row of a batch: ``runtime/decoding/batch.py``) ends here with the
verifier's logits for its input token and its drafted tokens:

- greedy: drafted tokens are kept while they equal the verifier's argmax, then the verifier's own token
  (exact up to floating-point near-ties, docs/design.md section 6);
- sampling: Leviathan/Chen speculative sampling, rejection over the draft's q (one-hot for lookup sources),
  so the output has the plain sampler's distribution;
- token trees (``runtime/tree.py``): the greedy walk down the tree, or recursive rejection over its
  one-hot candidates, which keeps the same distribution.

The device round (``runtime/backends/torch/device_round.py``) runs the same rule on device tensors for a
sequence alone on a GPU; the CPU tests hold both to the plain output.
"""

from __future__ import annotations

import numpy as np

from ..drafting.base import Draft
from ..sampling import SamplingParams, probabilities, sample
from ..tree import greedy_path, sample_path


def accept(
    draft: Draft, logits: np.ndarray, params: SamplingParams, rng: np.random.Generator
) -> tuple[list[int], list[int] | None]:
    """(the tokens the round commits, ending with the verifier's own; the accepted tree nodes, or None for a
    chain) from the verifier's ``logits`` ``[1 + len(draft.tokens), vocab]``."""
    if draft.is_tree:
        walk = greedy_path if params.greedy else None
        if walk is not None:
            path, final = walk(draft.tokens, draft.parents, logits)
        else:
            path, final = sample_path(draft.tokens, draft.parents, logits, params, rng)
        return [draft.tokens[i] for i in path] + [final], path
    drafted = draft.tokens
    if params.greedy:
        targets = np.argmax(logits, axis=-1)
        n = 0
        while n < len(drafted) and drafted[n] == targets[n]:
            n += 1
        return drafted[:n] + [int(targets[n])], None
    committed: list[int] = []
    for i, d in enumerate(drafted):
        p = probabilities(logits[i], params)
        q = draft.q[i]
        q_d = 1.0 if q is None else q[d]  # a lookup source's q is one-hot on its token
        if rng.random() < min(1.0, p[d] / q_d):
            committed.append(d)
            continue
        if q is None:
            residual = p.copy()
            residual[d] = 0.0
        else:
            residual = np.maximum(p - q, 0.0)
        committed.append(sample(residual / residual.sum(), rng) if residual.sum() > 0 else sample(p, rng))
        return committed, None
    committed.append(sample(probabilities(logits[len(drafted)], params), rng))
    return committed, None


def pick(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """A plain step's token: the argmax, or a sample from the request's distribution."""
    return int(np.argmax(logits)) if params.greedy else sample(probabilities(logits, params), rng)


__all__ = ["accept", "pick"]
