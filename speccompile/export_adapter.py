"""ONNX graphs for draft heads (exit adapters, reduced vocabularies), next to the model's graphs.

A plan with a draft head (``runtime/adapter.py``) drafts in two calls: its draft subgraph up to the
hidden state (``prefix.<E>`` for an early exit, as before; ``skip_hidden.<plan>`` for a layer-skip plan,
the skip graph without its head), then ``draft_head.<name>``: ``hidden [batch, seq, d]`` -> optional
adapter (gated MLP added to the residual stream) -> the model's final norm -> ``logits [batch, seq, N]``
over the draft vocabulary. The graph is built with the exporter's own ``_Graph`` blocks (the same ops
as the model's MLPs and head), always as a ``standard`` graph: it has no KV, so the fused variant's
in-place cache has nothing to do there.

Weights go into the *same* ``weights.bin`` as the model's, under ``draft_heads.<name>.*``: the adapter's
four (five with a LayerNorm bias) tensors and, for a reduced vocabulary, the ``N`` lm_head rows it
scores (``draft_heads.<name>.lm_head.weight``, a gathered copy: gathering rows per call would cost more
than the reduced matmul saves). A full-vocabulary head reuses the model's lm_head tensor. The draft
vocabulary's ids stay in the plan's draft head file, which the runtime reads to map logits back to
token ids.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import numpy as np

from speccompile.export_onnx import _Graph, _safe
from speccompile.runtime.adapter import DraftHead
from speccompile.runtime.errors import SpeccompileError
from speccompile.runtime.manifest import ArchConfig, DraftPlan


def draft_head_graph(key: str, config: ArchConfig, dtype: np.dtype, weights: dict[str, np.ndarray], head: DraftHead,
                     prefix: str) -> _Graph:
    """``hidden`` -> (adapter) -> final norm -> draft logits; adds the head's tensors to ``weights``."""
    c, d = config, config.hidden_size
    for name, array in head.adapter.items():
        weights[f"{prefix}.{name}"] = np.ascontiguousarray(array, dtype=dtype)
    head_rows = "embed" if c.tie_word_embeddings else "lm_head"
    rows = c.vocab_size
    if head.vocab is not None:
        weights[f"{prefix}.lm_head.weight"] = np.ascontiguousarray(weights[f"{head_rows}.weight"][head.vocab])
        head_rows, rows = f"{prefix}.lm_head", len(head.vocab)
    g = _Graph(key, config, dtype, weights)
    g.variant = "standard"  # no KV: never run through the fused variant's in-place cache
    h = g.add_input("hidden", g.onnx_dtype, ["batch", "seq", d])
    g.bt_shape = g.op("Shape", h, end=2)
    if head.has_adapter:
        width = head.adapter["adapter.gate.weight"].shape[0]
        x = g.norm(h, f"{prefix}.adapter.norm")
        inner = g.op("Mul", g.act(g.linear(x, f"{prefix}.adapter.gate", width)), g.linear(x, f"{prefix}.adapter.up", width))
        h = g.op("Add", h, g.linear(inner, f"{prefix}.adapter.down", d))
    g.add_output(g.linear(g.norm(h, "norm"), head_rows, rows), "logits", g.onnx_dtype, ["batch", "seq", rows])
    return g


def add_draft_head_graphs(graphs: dict[str, Any], record: dict[str, Any], plan: DraftPlan, config: ArchConfig,
                          dtype: np.dtype, weights: dict[str, np.ndarray], draft_heads: dict[str, Path] | None,
                          build: Callable) -> None:
    """Add the graphs ``plan``'s draft head needs to ``graphs`` and name them in its plan ``record``.
    ``draft_heads`` maps artifact-relative draft head files to where they are now; ``build`` is the
    exporter's graph builder for the model's variant (layer-skip plans need their skip graph's hidden state)."""
    source = (draft_heads or {}).get(plan.draft_head_file)
    if source is None:
        raise SpeccompileError(f"plan {plan.name!r} has a draft head ({plan.draft_head_file}) but the ONNX export was not "
                               "given the file; rebuild the artifact")
    head = DraftHead.load(Path(source), config.hidden_size, config.vocab_size)
    if not plan.is_early_exit:
        key = f"skip_hidden.{_safe(plan.name)}"
        graphs[key] = build("prefix", key, config, dtype, weights, 0, config.num_layers, frozenset(plan.skip_attn),
                            frozenset(plan.skip_mlp))
        record["draft"] = key
    name = _safe(Path(plan.draft_head_file).stem)
    key = f"draft_head.{name}"
    if key not in graphs:
        graphs[key] = draft_head_graph(key, config, dtype, weights, head, f"draft_heads.{name}")
    record["draft_head"] = key


__all__ = ["add_draft_head_graphs", "draft_head_graph"]
