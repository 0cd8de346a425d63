"""Convert a transformers causal LM into the canonical decoder's config and weights.

Each supported family is described by a ``Layout`` (where its tensors live and how they are fused), so
adding a family is adding data, not code. Everything family-specific is resolved here, once, at build
time: fused qkv / gate-up projections are split, GPT-2's Conv1D weights are transposed, Gemma's
``(1 + w)`` norms are folded, and the rotary frequencies are taken from the model's own rotary module
(so every rope scaling transformers computes statically is reproduced exactly).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
from torch import Tensor

from speccompile.runtime.artifact.manifest import ArchConfig
from speccompile.runtime.errors import SpeccompileError

_LLAMA_LAYER = {
    "attn_norm": "input_layernorm",
    "attn.q": "self_attn.q_proj",
    "attn.k": "self_attn.k_proj",
    "attn.v": "self_attn.v_proj",
    "attn.o": "self_attn.o_proj",
    "attn.q_norm": "self_attn.q_norm",
    "attn.k_norm": "self_attn.k_norm",
    "mlp_norm": "post_attention_layernorm",
    "mlp.gate": "mlp.gate_proj",
    "mlp.up": "mlp.up_proj",
    "mlp.down": "mlp.down_proj",
}


@dataclass(frozen=True)
class Layout:
    """Where a family keeps its tensors. ``layer`` maps canonical sublayer names to HF names."""

    base: str
    embed: str
    layers: str
    final_norm: str
    layer: dict[str, str]
    lm_head: str = "lm_head"
    pos_embed: str | None = None
    fused_qkv: str | None = None  # "concat" [q; k; v] | "per_head" [heads, 3, hd] | "grouped" [kv, q/kv + 2, hd] rows
    fused_gate_up: bool = False  # Phi-3: gate_up_proj = [gate; up]
    conv1d: bool = False  # GPT-2: weights stored [in, out]
    norm_plus_one: bool = False  # Gemma: RMSNorm scales by (1 + w)
    interleaved_rotary: bool = False  # Cohere: rotary pairs (2j, 2j+1); q/k rows are permuted to halves
    experts: str | None = None  # Mixtral: the MoE block under each layer (router "gate", experts w1/w3/w2)
    notes: dict[str, str] = field(default_factory=dict)


LAYOUTS: dict[str, Layout] = {
    "llama": Layout("model", "embed_tokens", "layers", "norm", _LLAMA_LAYER),
    "mistral": Layout("model", "embed_tokens", "layers", "norm", _LLAMA_LAYER),
    "qwen2": Layout("model", "embed_tokens", "layers", "norm", _LLAMA_LAYER),
    "qwen3": Layout("model", "embed_tokens", "layers", "norm", _LLAMA_LAYER),
    "gemma": Layout("model", "embed_tokens", "layers", "norm", _LLAMA_LAYER, norm_plus_one=True),
    "phi3": Layout(
        "model",
        "embed_tokens",
        "layers",
        "norm",
        {**_LLAMA_LAYER, "attn.qkv": "self_attn.qkv_proj", "mlp.gate_up": "mlp.gate_up_proj"},
        fused_qkv="concat",
        fused_gate_up=True,
    ),
    "gpt2": Layout(
        "transformer",
        "wte",
        "h",
        "ln_f",
        {
            "attn_norm": "ln_1",
            "attn.qkv": "attn.c_attn",
            "attn.o": "attn.c_proj",
            "mlp_norm": "ln_2",
            "mlp.up": "mlp.c_fc",
            "mlp.down": "mlp.c_proj",
        },
        pos_embed="wpe",
        fused_qkv="concat",
        conv1d=True,
    ),
    "gpt_neox": Layout(
        "gpt_neox",
        "embed_in",
        "layers",
        "final_layer_norm",
        {
            "attn_norm": "input_layernorm",
            "attn.qkv": "attention.query_key_value",
            "attn.o": "attention.dense",
            "mlp_norm": "post_attention_layernorm",
            "mlp.up": "mlp.dense_h_to_4h",
            "mlp.down": "mlp.dense_4h_to_h",
        },
        lm_head="embed_out",
        fused_qkv="per_head",
    ),
    "opt": Layout(
        "model.decoder",
        "embed_tokens",
        "layers",
        "final_layer_norm",
        {
            "attn_norm": "self_attn_layer_norm",
            "attn.q": "self_attn.q_proj",
            "attn.k": "self_attn.k_proj",
            "attn.v": "self_attn.v_proj",
            "attn.o": "self_attn.out_proj",
            "mlp_norm": "final_layer_norm",
            "mlp.up": "fc1",
            "mlp.down": "fc2",
        },
        pos_embed="embed_positions",
    ),
}
_OLMO2_LAYER = {
    **{k: v for k, v in _LLAMA_LAYER.items() if k not in ("attn_norm", "mlp_norm")},
    "attn_post_norm": "post_attention_layernorm",
    "mlp_post_norm": "post_feedforward_layernorm",
}
_SHARED_NORM = {"attn_norm": "input_layernorm", "mlp_norm": "input_layernorm"}  # one norm feeds both branches
LAYOUTS.update(
    {
        "smollm3": Layout("model", "embed_tokens", "layers", "norm", _LLAMA_LAYER),
        "olmo2": Layout("model", "embed_tokens", "layers", "norm", _OLMO2_LAYER),
        "phi": Layout(
            "model",
            "embed_tokens",
            "layers",
            "final_layernorm",
            {
                **_SHARED_NORM,
                "attn.q": "self_attn.q_proj",
                "attn.k": "self_attn.k_proj",
                "attn.v": "self_attn.v_proj",
                "attn.o": "self_attn.dense",
                "mlp.up": "mlp.fc1",
                "mlp.down": "mlp.fc2",
            },
        ),
        "cohere": Layout(
            "model",
            "embed_tokens",
            "layers",
            "norm",
            {**{k: v for k, v in _LLAMA_LAYER.items() if not k.endswith("norm")}, **_SHARED_NORM},
            interleaved_rotary=True,
        ),
    }
)
LAYOUTS["gemma3_text"] = Layout(  # a sandwich: pre- and post-norms around both sublayers
    "model",
    "embed_tokens",
    "layers",
    "norm",
    {
        **_LLAMA_LAYER,
        "attn_post_norm": "post_attention_layernorm",
        "mlp_norm": "pre_feedforward_layernorm",
        "mlp_post_norm": "post_feedforward_layernorm",
    },
    norm_plus_one=True,
)
LAYOUTS["mixtral"] = Layout(
    "model",
    "embed_tokens",
    "layers",
    "norm",
    {k: v for k, v in _LLAMA_LAYER.items() if not k.startswith("mlp.")},
    experts="block_sparse_moe",
)
_FALCON_LAYER = {
    "attn.qkv": "self_attention.query_key_value",
    "attn.o": "self_attention.dense",
    "mlp.up": "mlp.dense_h_to_4h",
    "mlp.down": "mlp.dense_4h_to_h",
}


def layout_for(config) -> Layout:
    """The family's layout; Falcon's depends on its config (three block designs, three qkv layouts)."""
    if config.model_type != "falcon":
        return LAYOUTS[config.model_type]
    if config.new_decoder_architecture:
        norms = (
            {"attn_norm": "ln_attn", "mlp_norm": "ln_mlp"}
            if (config.num_ln_in_parallel_attn or 2) == 2
            else _SHARED_NORM
        )
        qkv = "grouped"
    elif config.parallel_attn:
        norms, qkv = _SHARED_NORM, "concat" if config.multi_query else "per_head"
    else:
        norms = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"}
        qkv = "concat" if config.multi_query else "per_head"
    return Layout("transformer", "word_embeddings", "h", "ln_f", {**_FALCON_LAYER, **norms}, fused_qkv=qkv)


SUPPORTED_MODEL_TYPES = (*LAYOUTS, "falcon")  # falcon's layout comes from layout_for

_ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "gelu": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "relu": "relu",
}
_STATIC_ROPE_TYPES = {"default", "linear", "llama3", "yarn"}


class UnsupportedModelError(SpeccompileError):
    pass


def check_supported(model_type: str) -> None:
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"architecture '{model_type}' is not supported; supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )


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
    if mt in SUPPORTED_MODEL_TYPES:
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


def _refuse(condition: bool, message: str) -> None:
    if condition:
        raise UnsupportedModelError(message)


def _activation(name: str) -> str:
    if name not in _ACTIVATIONS:
        raise UnsupportedModelError(
            f"activation '{name}' is not supported; supported: {', '.join(sorted(_ACTIVATIONS))}"
        )
    return _ACTIVATIONS[name]


def _rotary_module(model, suffix: str = "rotary_emb") -> torch.nn.Module | None:
    for name, module in model.named_modules():
        if name.endswith(suffix) and hasattr(module, "inv_freq"):
            return module
    return None


def arch_config(model) -> ArchConfig:
    """The canonical decoder's options for a loaded transformers model (config + rotary module)."""
    hf = model.config
    mt = hf.model_type
    check_supported(mt)
    tie = bool(getattr(hf, "tie_word_embeddings", False))
    if mt == "gpt2":
        _refuse(hf.scale_attn_by_inverse_layer_idx, "gpt2 with scale_attn_by_inverse_layer_idx is not supported")
        hidden = hf.n_embd
        return ArchConfig(
            model_type=mt,
            vocab_size=hf.vocab_size,
            hidden_size=hidden,
            num_layers=hf.n_layer,
            num_heads=hf.n_head,
            num_kv_heads=hf.n_head,
            head_dim=hidden // hf.n_head,
            intermediate_size=hf.n_inner or 4 * hidden,
            norm="layer",
            norm_eps=hf.layer_norm_epsilon,
            mlp="plain",
            activation=_activation(hf.activation_function),
            positions="learned",
            attn_qkv_bias=True,
            attn_out_bias=True,
            mlp_bias=True,
            tie_word_embeddings=tie,
            max_position_embeddings=hf.n_positions,
            attn_scale=None if hf.scale_attn_weights else 1.0,
        )
    if mt == "opt":
        _refuse(
            not hf.do_layer_norm_before,
            "OPT with post-layer-norm (do_layer_norm_before=False, e.g. opt-350m) is not supported",
        )
        _refuse(
            hf.word_embed_proj_dim != hf.hidden_size, "OPT with word_embed_proj_dim != hidden_size is not supported"
        )
        _refuse(not hf.layer_norm_elementwise_affine, "OPT without layer-norm affine weights is not supported")
        _refuse(getattr(hf, "_remove_final_layer_norm", False), "OPT without a final layer norm is not supported")
        return ArchConfig(
            model_type=mt,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            num_layers=hf.num_hidden_layers,
            num_heads=hf.num_attention_heads,
            num_kv_heads=hf.num_attention_heads,
            head_dim=hf.hidden_size // hf.num_attention_heads,
            intermediate_size=hf.ffn_dim,
            norm="layer",
            norm_eps=1e-5,
            mlp="plain",
            activation=_activation(hf.activation_function),
            positions="learned",
            position_offset=2,
            attn_qkv_bias=hf.enable_bias,
            attn_out_bias=hf.enable_bias,
            mlp_bias=hf.enable_bias,
            tie_word_embeddings=tie,
            max_position_embeddings=hf.max_position_embeddings,
        )

    rotary = _rotary_module(model)
    _refuse(rotary is None, f"{mt} model has no rotary embedding module; cannot convert")
    rope_type = getattr(rotary, "rope_type", "default")
    _refuse(
        rope_type not in _STATIC_ROPE_TYPES,
        f"rope scaling '{rope_type}' changes with sequence length and is not supported; supported: {', '.join(sorted(_STATIC_ROPE_TYPES))}",
    )
    rotary_dim = 2 * rotary.inv_freq.shape[0]
    common = dict(
        model_type=mt,
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        num_layers=hf.num_hidden_layers,
        num_heads=hf.num_attention_heads,
        rotary_dim=rotary_dim,
        rope_attention_scaling=float(getattr(rotary, "attention_scaling", 1.0)),
        tie_word_embeddings=tie,
        max_position_embeddings=hf.max_position_embeddings,
    )
    if mt == "gpt_neox":
        return ArchConfig(
            **common,
            num_kv_heads=hf.num_attention_heads,
            head_dim=hf.hidden_size // hf.num_attention_heads,
            intermediate_size=hf.intermediate_size,
            norm="layer",
            norm_eps=hf.layer_norm_eps,
            mlp="plain",
            activation=_activation(hf.hidden_act),
            parallel_residual=hf.use_parallel_residual,
            attn_qkv_bias=hf.attention_bias,
            attn_out_bias=hf.attention_bias,
            mlp_bias=True,
        )

    if mt == "falcon":
        _refuse(hf.alibi, "falcon with alibi positions is not supported by the canonical decoder")
        _refuse(
            hf.new_decoder_architecture and not hf.parallel_attn,
            "falcon with the new decoder architecture and parallel_attn=False is not supported",
        )
        heads = hf.num_attention_heads
        kv = hf.num_kv_heads if hf.new_decoder_architecture else (1 if hf.multi_query else heads)
        return ArchConfig(
            **common,
            num_kv_heads=kv,
            head_dim=hf.hidden_size // heads,
            intermediate_size=hf.ffn_hidden_size,
            norm="layer",
            norm_eps=hf.layer_norm_epsilon,
            mlp="plain",
            activation=_activation(hf.activation),
            parallel_residual=bool(hf.new_decoder_architecture or hf.parallel_attn),
            attn_qkv_bias=hf.bias,
            attn_out_bias=hf.bias,
            mlp_bias=hf.bias,
        )
    if mt == "phi":
        _refuse(hf.qk_layernorm, "phi with qk_layernorm is not supported by the canonical decoder")
        return ArchConfig(
            **common,
            num_kv_heads=hf.num_key_value_heads or hf.num_attention_heads,
            head_dim=hf.hidden_size // hf.num_attention_heads,
            intermediate_size=hf.intermediate_size,
            norm="layer",
            norm_eps=hf.layer_norm_eps,
            mlp="plain",
            activation=_activation(hf.hidden_act),
            parallel_residual=True,
            attn_qkv_bias=True,
            attn_out_bias=True,
            mlp_bias=True,
            lm_head_bias=True,
        )
    if mt == "cohere":
        # Per-head q/k LayerNorm weights ([heads, head_dim]) have no canonical form yet.
        _refuse(hf.use_qk_norm, "cohere with use_qk_norm is not supported by the canonical decoder")
        return ArchConfig(
            **common,
            num_kv_heads=hf.num_key_value_heads or hf.num_attention_heads,
            head_dim=hf.hidden_size // hf.num_attention_heads,
            intermediate_size=hf.intermediate_size,
            norm="layer",
            norm_eps=hf.layer_norm_eps,
            mlp="gated",
            activation=_activation(hf.hidden_act),
            parallel_residual=True,
            attn_qkv_bias=hf.attention_bias,
            attn_out_bias=hf.attention_bias,
            logit_scale=float(hf.logit_scale),
        )

    if mt == "gemma3_text":
        _refuse(
            hf.attn_logit_softcapping is not None,
            "gemma3 with attn_logit_softcapping is not supported by the canonical decoder",
        )
        _refuse(
            bool(getattr(hf, "use_bidirectional_attention", False)),
            "gemma3 with bidirectional attention is not a causal LM",
        )
        return ArchConfig(
            **common,
            num_kv_heads=hf.num_key_value_heads,
            head_dim=hf.head_dim,
            intermediate_size=hf.intermediate_size,
            norm="rms",
            norm_eps=hf.rms_norm_eps,
            mlp="gated",
            activation=_activation(hf.hidden_activation),
            qk_norm=True,
            pre_norm=True,
            post_norm=True,
            embed_scale=float(hf.hidden_size**0.5),
            attn_qkv_bias=hf.attention_bias,
            attn_out_bias=hf.attention_bias,
            sliding_window=hf.sliding_window,
            window_layers=[i for i, kind in enumerate(hf.layer_types) if kind == "sliding_attention"],
            local_rope=True,
            attn_scale=float(hf.query_pre_attn_scalar) ** -0.5,
            final_softcap=hf.final_logit_softcapping,
        )

    if mt == "mixtral":
        return ArchConfig(
            **common,
            num_kv_heads=hf.num_key_value_heads,
            head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
            intermediate_size=hf.intermediate_size,
            norm="rms",
            norm_eps=hf.rms_norm_eps,
            mlp="gated",
            activation=_activation(hf.hidden_act),
            sliding_window=hf.sliding_window,
            num_experts=hf.num_local_experts,
            experts_per_token=hf.num_experts_per_tok,
        )

    # Llama-like families: llama, mistral, qwen2, qwen3, gemma, phi3, smollm3, olmo2.
    if mt in ("qwen2", "qwen3", "smollm3"):
        _refuse(bool(getattr(hf, "use_sliding_window", False)), f"{mt} with use_sliding_window=True is not supported")
        window = None
    else:
        window = getattr(hf, "sliding_window", None)
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    attention_bias = bool(getattr(hf, "attention_bias", False))
    act = getattr(hf, "hidden_activation", None) or hf.hidden_act if mt == "gemma" else hf.hidden_act
    return ArchConfig(
        **common,
        num_kv_heads=getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads,
        head_dim=head_dim,
        intermediate_size=hf.intermediate_size,
        norm="rms",
        norm_eps=hf.rms_norm_eps,
        mlp="gated",
        activation=_activation(act),
        qk_norm=mt in ("qwen3", "olmo2"),
        qk_norm_over="proj" if mt == "olmo2" else "head",
        pre_norm=mt != "olmo2",
        post_norm=mt == "olmo2",
        nope_layers=[i for i, use in enumerate(getattr(hf, "no_rope_layers", None) or []) if not use],
        embed_scale=float(hf.hidden_size**0.5) if mt == "gemma" else None,
        attn_qkv_bias=attention_bias or mt == "qwen2",
        attn_out_bias=attention_bias,
        mlp_bias=bool(getattr(hf, "mlp_bias", False)),
        sliding_window=window,
    )


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
        out["rope_inv_freq"] = _rotary_module(model).inv_freq.detach().float()
    if config.local_rope:
        out["rope_local_inv_freq"] = _rotary_module(model, "rotary_emb_local").inv_freq.detach().float()
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
