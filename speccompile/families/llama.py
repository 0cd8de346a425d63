"""Llama and the families that differ from it only in switches: Mistral, Qwen2, Qwen3, Gemma, Phi-3, SmolLM3
and OLMo 2. Each variant is a subclass that sets the switches it changes, so the one ``arch_config`` below
stays the single place that reads a Llama-shaped config."""

from __future__ import annotations

from speccompile.runtime.artifact.manifest import ArchConfig

from .family import LLAMA_LAYER, Family, Layout


class Llama(Family):
    """Llama and Mistral (Mistral's ``sliding_window`` is read as the canonical window)."""

    model_types = ("llama", "mistral")
    LAYOUT = Layout("model", "embed_tokens", "layers", "norm", LLAMA_LAYER)
    window_behind_switch = False  # the window applies only with use_sliding_window, which is refused
    qkv_bias = False  # q/k/v carry a bias whatever attention_bias says
    qk_norm = False
    qk_norm_over = "head"
    norms_after = False  # the norms follow the sublayers instead of preceding them
    scale_embeddings = False  # embeddings multiplied by sqrt(hidden_size)

    def activation_name(self, hf) -> str:
        return hf.hidden_act

    def window(self, hf) -> int | None:
        if self.window_behind_switch:
            # These configs keep a sliding_window value that transformers uses only with the switch on.
            self._refuse(
                bool(getattr(hf, "use_sliding_window", False)),
                f"{hf.model_type} with use_sliding_window=True is not supported",
            )
            return None
        return getattr(hf, "sliding_window", None)

    def arch_config(self, model) -> ArchConfig:
        hf = model.config
        common = self._rotary_fields(model)
        window = self.window(hf)
        attention_bias = bool(getattr(hf, "attention_bias", False))
        return ArchConfig(
            **common,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads,
            head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
            intermediate_size=hf.intermediate_size,
            norm="rms",
            norm_eps=hf.rms_norm_eps,
            mlp="gated",
            activation=self._activation(self.activation_name(hf)),
            qk_norm=self.qk_norm,
            qk_norm_over=self.qk_norm_over,
            pre_norm=not self.norms_after,
            post_norm=self.norms_after,
            nope_layers=[i for i, use in enumerate(getattr(hf, "no_rope_layers", None) or []) if not use],
            embed_scale=float(hf.hidden_size**0.5) if self.scale_embeddings else None,
            attn_qkv_bias=attention_bias or self.qkv_bias,
            attn_out_bias=attention_bias,
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            sliding_window=window,
        )


class Qwen2(Llama):
    """Biased q/k/v projections (Qwen2's config has no attention_bias switch)."""

    model_types = ("qwen2",)
    window_behind_switch = True
    qkv_bias = True


class Qwen3(Llama):
    """RMSNorm over each head of q and k before rotary."""

    model_types = ("qwen3",)
    window_behind_switch = True
    qk_norm = True


class SmolLM3(Llama):
    """Some blocks without rotary (``no_rope_layers``, read for every Llama-like config)."""

    model_types = ("smollm3",)
    window_behind_switch = True


class Gemma(Llama):
    """``(1 + w)`` RMSNorms, embeddings scaled by sqrt(hidden_size), its own activation field."""

    model_types = ("gemma",)
    LAYOUT = Layout("model", "embed_tokens", "layers", "norm", LLAMA_LAYER, norm_plus_one=True)
    scale_embeddings = True

    def activation_name(self, hf) -> str:
        return getattr(hf, "hidden_activation", None) or hf.hidden_act


class Phi3(Llama):
    """Fused qkv and gate-up projections, split by rows at conversion."""

    model_types = ("phi3",)
    LAYOUT = Layout(
        "model",
        "embed_tokens",
        "layers",
        "norm",
        {**LLAMA_LAYER, "attn.qkv": "self_attn.qkv_proj", "mlp.gate_up": "mlp.gate_up_proj"},
        fused_qkv="concat",
        fused_gate_up=True,
    )


class Olmo2(Llama):
    """Norms after the sublayers (none before) and q/k RMSNorm over the whole projection."""

    model_types = ("olmo2",)
    LAYOUT = Layout(
        "model",
        "embed_tokens",
        "layers",
        "norm",
        {
            **{k: v for k, v in LLAMA_LAYER.items() if k not in ("attn_norm", "mlp_norm")},
            "attn_post_norm": "post_attention_layernorm",
            "mlp_post_norm": "post_feedforward_layernorm",
        },
    )
    qk_norm = True
    qk_norm_over = "proj"
    norms_after = True
