"""Segments: the one vocabulary in which draft kinds ask backends for work.

A backend never learns what a draft plan *is* (docs/design.md section 2). A draft kind
(``runtime/drafting/kinds/``) expresses its draft step and its verify as segments, and every backend runs
any segment it has the code or the exported graphs for:

- blocks ``start .. stop-1``, less the attention / MLP sublayers in ``skip_attn`` / ``skip_mlp`` (the
  residual stream passes a skipped sublayer unchanged and it writes no KV);
- the input: the tokens' embeddings when ``start == 0``, otherwise the hidden states the backend kept
  at the same positions (``keep_hidden`` of an earlier call);
- ``keep_hidden``: the hidden states after block ``stop - 1`` are kept at their positions, for a later
  segment that starts at ``stop`` (early-exit prefix reuse);
- ``head``: ``None`` (no logits), ``"final"`` (the model's final norm and lm_head, shared by every
  exit) or the artifact-relative path of a draft head file (an exit adapter and/or a reduced draft
  vocabulary, ``runtime/artifact/draft_head_file.py``; logits come back over the whole vocabulary);
- ``precision``: ``None`` (the model's own weights) or a weight-only quantization scheme of them
  (``"int4"``, ``"int8"``, optionally ``"int4/b128"`` or ``"int4/b32s"`` with a block size and ``s`` for
  symmetric): a precision self-draft (``runtime/drafting/kinds/precision.py``), which writes its KV into the same cache.

Numpy only: the ONNX Runtime and TensorRT backends use it without torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

FINAL_HEAD = "final"


@dataclass(frozen=True)
class Segment:
    start: int
    stop: int
    skip_attn: frozenset[int] = frozenset()
    skip_mlp: frozenset[int] = frozenset()
    head: str | None = FINAL_HEAD
    keep_hidden: bool = False
    precision: str | None = None

    @property
    def from_tokens(self) -> bool:
        """Whether the segment starts from token ids (block 0) rather than kept hidden states."""
        return self.start == 0

    @property
    def blocks_key(self) -> tuple:
        """What identifies the segment's blocks (not its head or whether it keeps its hidden states)."""
        return (self.start, self.stop, tuple(sorted(self.skip_attn)), tuple(sorted(self.skip_mlp)), self.precision)

    def describe(self) -> str:
        skips = ""
        if self.skip_attn or self.skip_mlp:
            skips = f" less {len(self.skip_attn)} attention + {len(self.skip_mlp)} MLP sublayers"
        head = {None: "", FINAL_HEAD: " + head"}.get(self.head, f" + draft head {self.head}")
        precision = f" with {self.precision} weights" if self.precision else ""
        return f"blocks {self.start}..{self.stop - 1}{skips}{precision}{head}"


def parse_precision(precision: str) -> tuple[str, int, bool]:
    """(scheme, block size, symmetric) of a segment's ``precision`` string (``int4``, ``int8/b128``, ``int4/b32s``)."""
    scheme, _, rest = precision.partition("/b")
    symmetric = rest.endswith("s")
    return scheme, int(rest.rstrip("s") or 32), symmetric


def full_model(num_layers: int) -> Segment:
    """The whole model: every block and the final head (plain decoding, verification)."""
    return Segment(0, num_layers)


@dataclass(frozen=True)
class Row:
    """One sequence's part of a batched call (``Backend.run_rows``): its cache ``slot``, the position ``pos``
    of its first token, and either its ``tokens`` (a segment that starts at block 0) or the ``count`` hidden
    states kept at ``pos..`` (one that starts later). Rows of one call may differ in everything: a prompt
    chunk, one plain token, a draft of k tokens. ``parents``: the tokens after the first form a token tree
    (``runtime/tree.py``): row ``r`` sits at slot ``pos + r`` and position ``pos + depth(r)``. ``last_only``: only
    the last token's logits are wanted (a prompt chunk); a backend may then run the head on that token alone and
    return one row of logits (the head of a 135M model with a 49K vocabulary is a fifth of a prompt's products)."""

    slot: int
    pos: int
    tokens: Sequence[int] | None = None
    count: int = 0
    parents: Sequence[int] | None = None
    last_only: bool = False

    @property
    def width(self) -> int:
        """How many positions the row occupies in the call."""
        return len(self.tokens) if self.tokens is not None else self.count


__all__ = ["FINAL_HEAD", "Row", "Segment", "full_model", "parse_precision"]
