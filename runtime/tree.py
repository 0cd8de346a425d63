"""Token trees: several candidate continuations verified in one call (SpecInfer, Medusa, SuffixDecoding).

A chain spends a verify on one guess. A tree shares its prefixes and branches where the sources
disagree: ``parents[i]`` is the index (into the draft's tokens) of node ``i``'s parent, ``-1`` for a
child of the round's input token, and every parent comes before its children. The verifier runs the
input token and every node in one call: node ``i`` sits at cache slot ``pos + 1 + i`` but at position
``pos + depth(i)`` (rotary / learned positions) and attends to the committed past, the input token,
its ancestors and itself (``attention_rows``). Afterwards the accepted path's KV entries move to the
slots their positions name (``kv_moves``): the rest of the decode loop never sees the tree.

Acceptance, written once here for every backend:
- greedy (``greedy_path``): from the root, follow the child whose token is the verifier's argmax; exact,
  since every node's logits are the full model's for its own prefix;
- sampling (``sample_path``): the recursive rejection of SpecInfer / multi-draft speculative sampling
  for deterministic candidates (each child's q is one-hot): try the children in order, accept child
  ``c`` with probability ``p(c)`` under the current residual, else zero ``p(c)`` and renormalise; when
  every child is rejected, sample from the residual. The committed token has exactly the verifier's
  distribution p at every step (chi-square test in ``tests/test_tree.py``).

Numpy only: the ONNX Runtime backend uses it without torch.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .sampling import SamplingParams, probabilities, sample


def depths(parents: Sequence[int]) -> list[int]:
    """Depth of every node (a child of the input token has depth 1)."""
    out: list[int] = []
    for i, parent in enumerate(parents):
        if not -1 <= parent < i:
            raise ValueError(f"tree node {i} has parent {parent}: a parent must come before its child")
        out.append(1 if parent < 0 else out[parent] + 1)
    return out


def is_chain(parents: Sequence[int] | None) -> bool:
    return parents is None or all(p == i - 1 for i, p in enumerate(parents))


def attention_rows(parents: Sequence[int]) -> np.ndarray:
    """Boolean ``[n + 1, n + 1]`` over the call's rows (row 0: the input token, row ``i + 1``: node ``i``):
    True where a row may attend to a row of the same call (itself and its ancestors)."""
    n = len(parents)
    mask = np.zeros((n + 1, n + 1), dtype=bool)
    mask[:, 0] = True
    mask[0, 0] = True
    for i, parent in enumerate(parents):
        row = i + 1
        if parent >= 0:
            mask[row] = mask[parent + 1]
        mask[row, row] = True
    return mask


def children_of(parents: Sequence[int]) -> list[list[int]]:
    """``children[r]``: the nodes whose parent is call row ``r`` (row 0 the input token), in draft order."""
    children: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for i, parent in enumerate(parents):
        children[parent + 1].append(i)
    return children


def chain_parents(length: int) -> list[int]:
    """The ``parents`` of a chain of ``length`` tokens (each node the child of the one before)."""
    return list(range(-1, length - 1))


def _child(children: list[list[int]], tokens: Sequence[int], row: int, token: int) -> int | None:
    """The node below call row ``row`` that holds ``token`` (None: no such branch)."""
    return next((c for c in children[row] if tokens[c] == token), None)


def greedy_path(tokens: Sequence[int], parents: Sequence[int], logits: np.ndarray) -> tuple[list[int], int]:
    """(accepted nodes from the root down, the verifier's next token after them)."""
    children = children_of(parents)
    path: list[int] = []
    row = 0
    while True:
        target = int(np.argmax(logits[row]))
        nxt = _child(children, tokens, row, target)
        if nxt is None:
            return path, target
        path.append(nxt)
        row = nxt + 1


def sample_path(
    tokens: Sequence[int], parents: Sequence[int], logits: np.ndarray, params: SamplingParams, rng: np.random.Generator
) -> tuple[list[int], int]:
    """(accepted nodes, the token sampled after them) by recursive rejection over one-hot candidates."""
    children = children_of(parents)
    path: list[int] = []
    row = 0
    while True:
        p = probabilities(logits[row], params).astype(np.float64)
        accepted = None
        for c in children[row]:
            d = tokens[c]
            mass = p.sum()
            if mass <= 0:
                break
            if rng.random() < p[d] / mass:
                accepted = c
                break
            p[d] = 0.0
        if accepted is None:
            total = p.sum()
            final = sample(p / total, rng) if total > 0 else sample(probabilities(logits[row], params), rng)
            return path, int(final)
        path.append(accepted)
        row = accepted + 1


def follow(tokens: Sequence[int], parents: Sequence[int], continuation: Sequence[int]) -> list[int]:
    """The nodes along ``continuation`` from the root, as far as the tree holds it: the accepted path when the
    verifier's tokens are known (the tuner's replay of a greedy run; the same walk as ``greedy_path``), or
    where a source's own branch landed in a merged tree."""
    children = children_of(parents)
    path: list[int] = []
    row = 0
    for target in continuation:
        nxt = _child(children, tokens, row, target)
        if nxt is None:
            break
        path.append(nxt)
        row = nxt + 1
    return path


def kv_moves(path: Sequence[int]) -> list[tuple[int, int]]:
    """(from row, to row) of the call rows whose KV must move so that the accepted nodes sit at rows
    ``1, 2, ..`` in order; rows already in place are left out. Every target row is below its source and the
    sources rise, so the moves can run in order, in place."""
    return [(node + 1, j + 1) for j, node in enumerate(path) if node != j]


class TokenTrie:
    """Builds a tree from candidate continuations in priority order, sharing common prefixes, up to a node
    budget (a later candidate is cut where the budget runs out)."""

    def __init__(self, max_nodes: int):
        self.max_nodes = max_nodes
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.sources: list[str] = []
        self._index: dict[tuple[int, int], int] = {}  # (parent, token) -> node

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def full(self) -> bool:
        return len(self.tokens) >= self.max_nodes

    def add(self, continuation: Sequence[int], source: str) -> int:
        """Insert ``continuation`` below the root; returns the nodes it added."""
        added, parent = 0, -1
        for token in continuation:
            node = self._index.get((parent, int(token)))
            if node is None:
                if self.full:
                    break
                node = len(self.tokens)
                self.tokens.append(int(token))
                self.parents.append(parent)
                self.sources.append(source)
                self._index[(parent, int(token))] = node
                added += 1
            parent = node
        return added


__all__ = [
    "TokenTrie",
    "attention_rows",
    "chain_parents",
    "children_of",
    "depths",
    "follow",
    "greedy_path",
    "is_chain",
    "kv_moves",
    "sample_path",
]
