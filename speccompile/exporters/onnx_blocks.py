"""The block schedule, written once for every ONNX variant, and the graph kinds built from it.

``build_blocks`` lays out blocks ``start .. stop-1`` (less skipped sublayers) the way
``Decoder.run_blocks`` runs them: the residual stream is carried as ``h + delta`` (``delta`` the pending
branch), so that a variant with fused residual-add norms (``FusedGraph.add_norm``) and one without
(``GraphBuilder.add_norm``: an Add, then the norm) share the schedule: pre-norms, post-norms (OLMo 2,
Gemma 3), parallel residual (GPT-NeoX, Phi, Cohere, Falcon). The variant chooses every op.

Graph kinds, by input and output: token ids or a hidden state in; ``logits`` (the shared head),
``hidden`` (the stream after the last block, for a later graph) or ``last_hidden`` (the same, handed to the
head graph) out. The head graph is the zero-block case. ``draft_head_graph`` is the other kind: a hidden
state through a plan's exit adapter and the final norm to logits over its draft vocabulary.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from speccompile.runtime.artifact.draft_head_file import DraftHead

from .onnx_graph import GraphBuilder

LOGITS, HIDDEN, LAST_HIDDEN = "logits", "hidden", "last_hidden"


def build_blocks(
    g: GraphBuilder,
    start: int,
    stop: int,
    skip_attn=frozenset(),
    skip_mlp=frozenset(),
    from_tokens: bool = True,
    output: str = LOGITS,
) -> GraphBuilder:
    """Fill ``g`` (a fresh graph of any variant) with blocks ``start..stop-1`` and its output."""
    c = g.c
    attn_layers = [i for i in range(start, stop) if i not in skip_attn]
    source = g.tokens_input() if from_tokens else g.hidden_input()
    g.declare_positions(attn_layers, learned_from_tokens=from_tokens and c.positions == "learned")
    h = g.embed(source) if from_tokens else source
    delta = None if from_tokens else g.residual_start(h)
    for i in range(start, stop):
        run_attn, run_mlp = i not in skip_attn, i not in skip_mlp
        pre = lambda name: f"layers.{i}.{name}" if c.pre_norm else None  # noqa: E731

        def post(branch: str, name: str) -> str:
            return g.norm(branch, f"layers.{i}.{name}") if c.post_norm else branch

        if c.parallel_residual:  # both branches read the block's input
            if not (run_attn or run_mlp):
                continue
            x, h = g.add_norm(h, delta, pre("attn_norm" if run_attn else "mlp_norm"))
            branches = []
            if run_attn:
                branches.append(post(g.attention(i, x), "attn_post_norm"))
            if run_mlp:
                mlp_in = x if not run_attn else (g.norm(h, pre("mlp_norm")) if c.pre_norm else h)
                branches.append(post(g.mlp(i, mlp_in), "mlp_post_norm"))
            h, delta = g.add_branches(h, branches)
            continue
        if run_attn:
            x, h = g.add_norm(h, delta, pre("attn_norm"))
            delta = post(g.attention(i, x), "attn_post_norm")
        if run_mlp:
            x, h = g.add_norm(h, delta, pre("mlp_norm"))
            delta = post(g.mlp(i, x), "mlp_post_norm")
    d = c.hidden_size
    if output == LOGITS:
        g.add_output(g.head(h, delta), LOGITS, g.onnx_dtype, ["batch", "seq", c.vocab_size])
    else:
        g.add_output(g.op("Add", h, delta) if delta is not None else h, output, g.onnx_dtype, ["batch", "seq", d])
    return g


def draft_head_graph(g: GraphBuilder, head: DraftHead, prefix: str) -> GraphBuilder:
    """``hidden`` -> (exit adapter: a gated MLP added to the stream) -> final norm -> logits over the draft
    vocabulary. The head's tensors are added to ``g.weights`` under ``prefix`` (one ``weights.bin``): the
    adapter's, and for a reduced vocabulary the ``N`` lm_head rows it scores (a gathered copy: gathering
    rows per call would cost more than the reduced matmul saves); a full-vocabulary head reuses the model's
    lm_head. Like the drafts' shared head in the runtime, no logit scale or softcap: only the argmax and
    the draft's own distribution matter."""
    c, d = g.c, g.c.hidden_size
    for name, array in head.adapter.items():
        g.weights[f"{prefix}.{name}"] = np.ascontiguousarray(array, dtype=g.dtype)
    rows, count = ("embed" if c.tie_word_embeddings else "lm_head"), c.vocab_size
    if head.vocab is not None:
        g.weights[f"{prefix}.lm_head.weight"] = np.ascontiguousarray(g.weights[f"{rows}.weight"][head.vocab])
        rows, count = f"{prefix}.lm_head", len(head.vocab)
    h = g.hidden_input()
    if head.has_adapter:
        width = head.adapter["adapter.gate.weight"].shape[0]
        h = g.op("Add", h, g.gated_mlp(f"{prefix}.adapter", g.norm(h, f"{prefix}.adapter.norm"), width, d))
    g.add_output(g.linear(g.norm(h, "norm"), rows, count), LOGITS, g.onnx_dtype, ["batch", "seq", count])
    return g


def load_draft_head(plan, config, draft_heads: dict[str, Path] | None) -> DraftHead:
    """The draft head file of ``plan``, from where the build has it now (``draft_heads``)."""
    from speccompile.runtime.errors import SpeccompileError

    source = (draft_heads or {}).get(plan.draft_head_file)
    if source is None:
        raise SpeccompileError(
            f"plan {plan.name!r} has a draft head ({plan.draft_head_file}) but the ONNX export was not "
            "given the file; rebuild the artifact"
        )
    return DraftHead.load(Path(source), config.hidden_size, config.vocab_size)


__all__ = ["HIDDEN", "LAST_HIDDEN", "LOGITS", "build_blocks", "draft_head_graph", "load_draft_head"]
