"""Cohere (Command-R): a parallel block on one bias-free LayerNorm, interleaved rotary, scaled logits."""

from __future__ import annotations

from speccompile.runtime.artifact.manifest import ArchConfig

from .family import LLAMA_LAYER, SHARED_NORM, Family, Layout


class Cohere(Family):
    model_types = ("cohere",)
    LAYOUT = Layout(
        "model",
        "embed_tokens",
        "layers",
        "norm",
        {**{k: v for k, v in LLAMA_LAYER.items() if not k.endswith("norm")}, **SHARED_NORM},
        interleaved_rotary=True,
    )

    def arch_config(self, model) -> ArchConfig:
        hf = model.config
        common = self._rotary_fields(model)
        # Per-head q/k LayerNorm weights ([heads, head_dim]) have no canonical form yet.
        self._refuse(hf.use_qk_norm, "cohere with use_qk_norm is not supported by the canonical decoder")
        return ArchConfig(
            **common,
            num_kv_heads=hf.num_key_value_heads or hf.num_attention_heads,
            head_dim=hf.hidden_size // hf.num_attention_heads,
            intermediate_size=hf.intermediate_size,
            norm="layer",
            norm_eps=hf.layer_norm_eps,
            mlp="gated",
            activation=self._activation(hf.hidden_act),
            parallel_residual=True,
            attn_qkv_bias=hf.attention_bias,
            attn_out_bias=hf.attention_bias,
            logit_scale=float(hf.logit_scale),
        )
