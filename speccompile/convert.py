"""Convert a transformers causal LM into the canonical decoder's config and weights.

Each supported family is described by a descriptor in ``speccompile/families`` (found by ``model_type``):
its ``Layout`` (where its tensors live and how they are fused) and its ``ArchConfig`` switches, so adding a
family is adding one descriptor, not code here. The conversion below is generic over layouts and runs
once, at build time: fused qkv / gate-up projections are split, GPT-2's Conv1D weights are transposed,
Gemma's ``(1 + w)`` norms are folded, and the rotary frequencies are taken from the model's own rotary
module (so every rope scaling transformers computes statically is reproduced exactly).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import Tensor

from speccompile.families import FAMILIES, family_for
from speccompile.families.family import Layout, UnsupportedModelError, rotary_module
from speccompile.runtime.artifact.manifest import ArchConfig

__all__ = [
    "DecoderPath",
    "Layout",
    "UnsupportedModelError",
    "arch_config",
    "canonical_weights",
    "check_supported",
    "choose_path",
    "layout_for",
    "recurrent_layer",
]


def layout_for(config) -> Layout:
    """Where the family of ``config`` keeps its tensors (``UnsupportedModelError`` for a type without one)."""
    return family_for(config.model_type).layout(config)


def check_supported(model_type: str) -> None:
    """Refuse, in one line, a model type without a family descriptor (``speccompile/families``)."""
    FAMILIES.check(model_type)


# Layers that carry recurrent state (state-space, linear-attention, convolution mixers): the state after a
# rejected draft token cannot be cut back to a length, so drafting them losslessly needs state snapshots.
_RECURRENT_MARKERS = (
    "mamba",
    "ssm",
    "rwkv",
    "recurrent",
    "lineardeltanet",
    "gateddeltanet",
    "linearattention",
    "shortconv",
    "xlstm",
    "mlstm",
    "slstm",
    "retention",
    "mixer",
)


def _words(name: str) -> str:
    """A class name with a space before each CamelCase word: markers must start and end on a word, so
    "ssm" matches ``MambaSSM`` but not ``GptOssModel``."""
    return " " + re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", " ", name).lower() + " "


def recurrent_layer(model) -> str | None:
    """The class name of a module in ``model`` that keeps recurrent state (a whole-word marker match), or
    None. Of several matches, the one with the most own parameters and direct submodules: the mixer itself
    rather than the model class or a norm named after the family."""
    best, best_size = None, -1
    for module in model.modules():
        name = type(module).__name__
        words = _words(name)
        if any(re.search(r"(?<= )" + r"\s?".join(marker) + r"(?= )", words) for marker in _RECURRENT_MARKERS):
            size = len(list(module.parameters(recurse=False))) + len(list(module.children()))
            if size > best_size:
                best, best_size = name, size
    return best


@dataclass
class DecoderPath:
    """Which decoder runs a model, and why: ``canonical`` (converted to runtime/backends/torch/decoder.py: every plan,
    every backend) or ``generic`` (its own modules through ``runtime/backends/torch/hf_decoder.py``: torch only,
    whole-block plans); ``decoder`` is the ready generic decoder."""

    path: str
    why: str
    decoder: object = None


def choose_path(model) -> DecoderPath:
    """The decoder path for ``model``; raises ``UnsupportedModelError`` with the reason when neither path
    can draft it losslessly."""
    config = model.config
    mt = config.model_type
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(f"'{mt}' is an encoder-decoder model; speccompile drafts decoder-only causal LMs")
    layer = recurrent_layer(model)
    if layer is not None:
        raise UnsupportedModelError(
            f"'{mt}' has recurrent or state-space layers ({layer}) whose state cannot be cut back after a rejected "
            "draft, so it cannot be drafted losslessly; use an attention-only model"
        )
    if mt in FAMILIES:
        try:
            arch_config(model)
            return DecoderPath(
                "canonical", f"'{mt}' has a canonical conversion (sublayer plans, ONNX and TensorRT export)"
            )
        except UnsupportedModelError as exc:
            reason = str(exc)
    else:
        reason = f"no canonical conversion for '{mt}'"
    from speccompile.runtime.backends.torch.hf_decoder import HFDecoder, LayerStackError

    try:
        decoder = HFDecoder(model)
    except LayerStackError as exc:
        raise UnsupportedModelError(
            f"'{mt}' cannot be drafted: {reason}, and the generic path cannot run it: {exc}"
        ) from None
    return DecoderPath(
        "generic", f"{reason}: the model's own modules run on torch (whole-block plans, early exit, lookup)", decoder
    )


def arch_config(model) -> ArchConfig:
    """The canonical decoder's options for a loaded transformers model (config + rotary module), as its
    family's descriptor reads them."""
    return family_for(model.config.model_type).arch_config(model)


def _split_qkv(weight: Tensor, config: ArchConfig, how: str) -> tuple[Tensor, Tensor, Tensor]:
    """Split a fused qkv weight ``[rows, in]`` (or bias ``[rows]``) into q, k, v."""
    q_rows = config.num_heads * config.head_dim
    kv_rows = config.num_kv_heads * config.head_dim
    if how == "concat":
        return weight[:q_rows], weight[q_rows : q_rows + kv_rows], weight[q_rows + kv_rows :]
    if how == "grouped":  # Falcon's new architecture: per kv group, its query heads then one key and one value
        per_group = config.num_heads // config.num_kv_heads
        grouped = weight.reshape(config.num_kv_heads, per_group + 2, config.head_dim, *weight.shape[1:])
        return (
            grouped[:, :per_group].reshape(q_rows, *weight.shape[1:]),
            grouped[:, per_group].reshape(kv_rows, *weight.shape[1:]),
            grouped[:, per_group + 1].reshape(kv_rows, *weight.shape[1:]),
        )
    # GPT-NeoX: rows are laid out per head as [q_h, k_h, v_h].
    per_head = weight.reshape(config.num_heads, 3, config.head_dim, *weight.shape[1:])
    return tuple(per_head[:, j].reshape(q_rows, *weight.shape[1:]) for j in range(3))


def canonical_weights(model, config: ArchConfig) -> dict[str, Tensor]:
    """The model's weights under canonical names (see runtime/backends/torch/decoder.py), float32, contiguous:
    the model's own tensors where they need no change (float32 already, and a split of a fused projection
    along its rows is a view), so a build holds the weights once."""
    layout = layout_for(model.config)
    state = {k: v.detach().float() for k, v in model.state_dict().items()}
    base = layout.base + "."

    def take(name: str) -> Tensor:
        # GPT-2's Conv1D stores [in, out]; the canonical decoder uses nn.Linear's [out, in].
        return state[name].t() if layout.conv1d and state[name].dim() == 2 else state[name]

    out: dict[str, Tensor] = {"embed.weight": state[base + layout.embed + ".weight"]}
    if layout.pos_embed:
        out["pos_embed.weight"] = state[base + layout.pos_embed + ".weight"]

    def put_norm(canonical: str, hf_name: str) -> None:
        weight = state[hf_name + ".weight"]
        out[canonical + ".weight"] = weight + 1.0 if layout.norm_plus_one else weight
        if config.norm == "layer":  # a LayerNorm without bias (Cohere) gets zeros
            out[canonical + ".bias"] = state.get(hf_name + ".bias", torch.zeros_like(weight))

    for i in range(config.num_layers):
        prefix = f"{base}{layout.layers}.{i}."
        for canonical, hf_name in layout.layer.items():
            full = prefix + hf_name
            if canonical.endswith("norm"):
                if full + ".weight" in state:
                    put_norm(f"layers.{i}.{canonical}", full)
                continue
            for kind in ("weight", "bias"):
                if f"{full}.{kind}" not in state:
                    continue
                tensor = take(f"{full}.{kind}")
                if canonical == "attn.qkv":
                    for name, part in zip("qkv", _split_qkv(tensor, config, layout.fused_qkv)):
                        out[f"layers.{i}.attn.{name}.{kind}"] = part
                elif canonical == "mlp.gate_up":
                    gate, up = tensor.chunk(2, dim=0)
                    out[f"layers.{i}.mlp.gate.{kind}"], out[f"layers.{i}.mlp.up.{kind}"] = gate, up
                else:
                    out[f"layers.{i}.{canonical}.{kind}"] = tensor
        if layout.experts:  # Mixtral: router + experts (w1 = gate, w3 = up, w2 = down)
            moe = f"{prefix}{layout.experts}"
            out[f"layers.{i}.mlp.router.weight"] = state[f"{moe}.gate.weight"]
            for e in range(config.num_experts):
                for canonical, hf_name in (("gate", "w1"), ("up", "w3"), ("down", "w2")):
                    out[f"layers.{i}.mlp.experts.{e}.{canonical}.weight"] = state[f"{moe}.experts.{e}.{hf_name}.weight"]
    put_norm("norm", base + layout.final_norm)
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = state[layout.lm_head + ".weight"]
    if config.lm_head_bias:
        out["lm_head.bias"] = state[layout.lm_head + ".bias"]
    if layout.interleaved_rotary:
        _halve_rotary_pairs(out, config)
    if config.positions == "rotary":
        out["rope_inv_freq"] = rotary_module(model).inv_freq.detach().float()
    if config.local_rope:
        out["rope_local_inv_freq"] = rotary_module(model, "rotary_emb_local").inv_freq.detach().float()
    return {k: v.contiguous() for k, v in out.items()}


def _halve_rotary_pairs(weights: dict[str, Tensor], config: ArchConfig) -> None:
    """Interleaved rotary (pairs ``(2j, 2j+1)``, Cohere) -> the canonical half-split rotary (pairs
    ``(j, j + rot/2)``): permute each head's rotary rows of q and k (weights and biases) the same way.
    Attention scores are dot products of q and k over the head, so one permutation applied to both leaves
    them, and the output, unchanged; v is untouched."""
    rot, hd = config.rotary_dim, config.head_dim
    order = torch.cat((torch.arange(0, rot, 2), torch.arange(1, rot, 2), torch.arange(rot, hd)))
    for i in range(config.num_layers):
        for name, heads in (("q", config.num_heads), ("k", config.num_kv_heads)):
            for kind in ("weight", "bias"):
                key = f"layers.{i}.attn.{name}.{kind}"
                if key in weights:
                    t = weights[key]
                    weights[key] = t.reshape(heads, hd, *t.shape[1:])[:, order].reshape(t.shape)
