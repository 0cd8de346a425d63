"""Gemma 3 (text): sandwich norms around both sublayers, ``(1 + w)`` norms including q/k, windowed blocks
with their own rotary table, and a final logit softcap."""

from __future__ import annotations

from speccompile.runtime.artifact.manifest import ArchConfig

from .family import LLAMA_LAYER, Family, Layout


class Gemma3(Family):
    model_types = ("gemma3_text",)
    LAYOUT = Layout(
        "model",
        "embed_tokens",
        "layers",
        "norm",
        {
            **LLAMA_LAYER,
            "attn_post_norm": "post_attention_layernorm",
            "mlp_norm": "pre_feedforward_layernorm",
            "mlp_post_norm": "post_feedforward_layernorm",
        },
        norm_plus_one=True,
    )

    def arch_config(self, model) -> ArchConfig:
        hf = model.config
        common = self._rotary_fields(model)
        self._refuse(
            hf.attn_logit_softcapping is not None,
            "gemma3 with attn_logit_softcapping is not supported by the canonical decoder",
        )
        self._refuse(
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
            activation=self._activation(hf.hidden_activation),
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
