"""What every family descriptor shares: the ``Layout`` record, the ``Family`` base class and its helpers.

A descriptor answers two questions about a transformers model, once, at build time: where its tensors live
(``layout``) and which canonical-decoder switches reproduce it (``arch_config``). Everything else (splitting
fused projections, folding norms, permuting rotary rows) is generic code in ``speccompile/convert.py`` that
reads the layout, so a family never carries conversion code of its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from speccompile.runtime.artifact.manifest import ArchConfig
from speccompile.runtime.errors import SpeccompileError


class UnsupportedModelError(SpeccompileError):
    pass


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


# The sublayer names of transformers' Llama, which most families reuse whole or in part.
LLAMA_LAYER = {
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
SHARED_NORM = {"attn_norm": "input_layernorm", "mlp_norm": "input_layernorm"}  # one norm feeds both branches

ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "gelu": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "relu": "relu",
}
# Rope scalings transformers computes once: the rotary module's inv_freq then holds them exactly.
STATIC_ROPE_TYPES = {"default", "linear", "llama3", "yarn"}


def rotary_module(model, suffix: str = "rotary_emb"):
    """The model's rotary embedding module (the first named ``*suffix`` with an ``inv_freq``), or None."""
    for name, module in model.named_modules():
        if name.endswith(suffix) and hasattr(module, "inv_freq"):
            return module
    return None


class Family:
    """One family of transformers causal LMs: the model types it handles, its layout and its switches.

    A subclass sets ``model_types`` and either ``LAYOUT`` (a family with one layout) or overrides ``layout``
    (one that depends on the config), and implements ``arch_config``. It refuses what the canonical decoder
    cannot reproduce with ``_refuse``: such a model then runs on the generic path (``convert.choose_path``).
    """

    model_types: tuple[str, ...] = ()
    LAYOUT: Layout | None = None

    def layout(self, hf_config) -> Layout:
        return self.LAYOUT

    def arch_config(self, model) -> ArchConfig:
        raise NotImplementedError

    @staticmethod
    def _refuse(condition: bool, message: str) -> None:
        if condition:
            raise UnsupportedModelError(message)

    @staticmethod
    def _activation(name: str) -> str:
        """The canonical name of a transformers activation; the decoder implements these and no others."""
        if name not in ACTIVATIONS:
            raise UnsupportedModelError(
                f"activation '{name}' is not supported; supported: {', '.join(sorted(ACTIVATIONS))}"
            )
        return ACTIVATIONS[name]

    @staticmethod
    def _tied(hf) -> bool:
        return bool(getattr(hf, "tie_word_embeddings", False))

    def _rotary_fields(self, model) -> dict:
        """The ``ArchConfig`` fields every rotary family fills the same way. The rotary width and scaling come
        from the model's own rotary module, not its config, so every static rope scaling transformers
        computes is reproduced exactly; scalings that change with the sequence length are refused."""
        hf = model.config
        mt = hf.model_type
        rotary = rotary_module(model)
        self._refuse(rotary is None, f"{mt} model has no rotary embedding module; cannot convert")
        rope_type = getattr(rotary, "rope_type", "default")
        self._refuse(
            rope_type not in STATIC_ROPE_TYPES,
            f"rope scaling '{rope_type}' changes with sequence length and is not supported; "
            f"supported: {', '.join(sorted(STATIC_ROPE_TYPES))}",
        )
        return dict(
            model_type=mt,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            num_layers=hf.num_hidden_layers,
            num_heads=hf.num_attention_heads,
            rotary_dim=2 * rotary.inv_freq.shape[0],
            rope_attention_scaling=float(getattr(rotary, "attention_scaling", 1.0)),
            tie_word_embeddings=self._tied(hf),
            max_position_embeddings=hf.max_position_embeddings,
        )
