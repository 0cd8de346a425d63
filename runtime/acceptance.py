"""The acceptance rule, written once: which drafted tokens a verify keeps, and the token after them.

Every round ends here with the verifier's logits for its input token and its drafted tokens:

- greedy: drafted tokens are kept while they equal the verifier's argmax, then the verifier's own token
  (exact up to floating-point near-ties, docs/design.md section 6);
- sampling: Leviathan/Chen speculative sampling, rejection over the draft's q (one-hot for lookup sources),
  so the output has the plain sampler's distribution;
- token trees (``runtime/tree.py``): the greedy walk down the tree, or recursive rejection over its
  one-hot candidates, which keeps the same distribution.

A chain's rule (``accept_chain``) is array code of the array API, so it runs on numpy arrays for the host round
(``accept``: each sequence of a batch, ``runtime/decoding/batch.py``) and on torch tensors for the device round
(``runtime/backends/torch/device_round.py``: a sequence alone on a GPU, no host read until the round's end).
Both rounds are drivers of it: they differ in where the arrays live and in who draws the uniforms, not in the
rule. The CPU tests hold both to the plain output.
"""

from __future__ import annotations

import numpy as np
from array_api_compat import array_namespace
from array_api_compat import device as device_of

from .sampling import SamplingParams, probabilities, sample_at
from .tree import greedy_path, sample_path


def leading_run(ok):
    """How many entries of the boolean vector ``ok`` are true before its first false (a 0-d integer array)."""
    xp = array_namespace(ok)
    return xp.sum(xp.cumulative_prod(xp.astype(ok, xp.int64)))


def accept_chain(logits, drafted, params: SamplingParams, u=None, q=None, kept=None):
    """(how many of the ``n`` ``drafted`` tokens are accepted, a 0-d integer array; the token after them, a
    one-element array) from the verifier's ``logits`` ``[n + 1, vocab]``, all arrays of one library.

    ``kept`` (booleans ``[n]``, default all): drafted tokens the draft policy keeps; a token after the first one
    it drops is never accepted (the device round drafts a fixed length and cuts afterwards). Sampling needs
    ``u``, ``n + 1`` uniforms (the acceptance tests, then the last token's draw), and ``q`` ``[n, vocab]``, the
    distributions the tokens were drafted from, None where every token came from a lookup (one-hot).
    """
    xp = array_namespace(logits)
    n = drafted.shape[0]
    if kept is None:
        kept = xp.ones(n, dtype=xp.bool, device=device_of(logits))
    if params.greedy:
        targets = xp.argmax(logits, axis=-1)
        accepted = leading_run((drafted == targets[:n]) & kept)
        return accepted, xp.take(targets, xp.reshape(accepted, (1,)))
    p = probabilities(logits, params)  # [n + 1, vocab], float64
    vocab = p.shape[-1]
    if q is None:  # a one-hot per lookup token (a comparison, not one_hot: that reads the ids back to check them)
        q = xp.astype(xp.arange(vocab, device=device_of(p))[None, :] == drafted[:, None], xp.float64)
    p_d = xp.take_along_axis(p[:n], drafted[:, None], axis=1)[:, 0]
    q_d = xp.take_along_axis(q, drafted[:, None], axis=1)[:, 0]
    accepted = leading_run((u[:n] < xp.clip(p_d / q_d, max=1.0)) & kept)
    at = xp.reshape(accepted, (1,))
    p_a = xp.take(p, at, axis=0)[0]
    q_a = xp.take(xp.concat([q, xp.zeros((1, vocab), dtype=q.dtype, device=device_of(q))]), at, axis=0)[0]
    residual = xp.clip(p_a - q_a, min=0.0)  # where a rejection resamples from; the verifier's own past the drafts
    rejected = (accepted < xp.sum(xp.astype(kept, xp.int64))) & (xp.sum(residual) > 0)
    return accepted, sample_at(xp.where(rejected, residual, p_a), u[n])


def accept(
    draft, logits: np.ndarray, params: SamplingParams, rng: np.random.Generator
) -> tuple[list[int], list[int] | None]:
    """The host round's driver: (the tokens the round commits, ending with the verifier's own; the accepted tree
    nodes, or None for a chain) from the verifier's ``logits`` ``[1 + len(draft.tokens), vocab]`` and the round's
    ``draft`` (a ``drafting.drafter.Draft``: the rule sits below drafting, so it reads the draft's fields only)."""
    if draft.is_tree:
        if params.greedy:
            path, final = greedy_path(draft.tokens, draft.parents, logits)
        else:
            path, final = sample_path(draft.tokens, draft.parents, logits, params, rng)
        return [draft.tokens[i] for i in path] + [final], path
    drafted = np.asarray(draft.tokens, dtype=np.int64)
    u = q = None
    if not params.greedy:
        u = rng.random(len(drafted) + 1)
        if any(d is not None for d in draft.q):  # a model's distributions, one-hot rows for lookup tokens
            q = np.zeros((len(drafted), logits.shape[-1]))
            for i, (token, row) in enumerate(zip(draft.tokens, draft.q)):
                if row is None:
                    q[i, token] = 1.0
                else:
                    q[i] = row
    accepted, token = accept_chain(logits, drafted, params, u=u, q=q)
    return draft.tokens[: int(accepted)] + [int(token[0])], None


def pick(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """A plain step's token: the argmax, or a sample from the request's distribution."""
    if params.greedy:
        return int(np.argmax(logits))
    return int(sample_at(probabilities(logits, params), np.float64(rng.random()))[0])


__all__ = ["accept", "accept_chain", "leading_run", "pick"]
