"""Phi-1/Phi-2: a parallel block on one LayerNorm, partial rotary, biases everywhere including the head."""

from __future__ import annotations

from speccompile.runtime.artifact.manifest import ArchConfig

from .family import SHARED_NORM, Family, Layout


class Phi(Family):
    model_types = ("phi",)
    LAYOUT = Layout(
        "model",
        "embed_tokens",
        "layers",
        "final_layernorm",
        {
            **SHARED_NORM,
            "attn.q": "self_attn.q_proj",
            "attn.k": "self_attn.k_proj",
            "attn.v": "self_attn.v_proj",
            "attn.o": "self_attn.dense",
            "mlp.up": "mlp.fc1",
            "mlp.down": "mlp.fc2",
        },
    )

    def arch_config(self, model) -> ArchConfig:
        hf = model.config
        common = self._rotary_fields(model)
        self._refuse(hf.qk_layernorm, "phi with qk_layernorm is not supported by the canonical decoder")
        return ArchConfig(
            **common,
            num_kv_heads=hf.num_key_value_heads or hf.num_attention_heads,
            head_dim=hf.hidden_size // hf.num_attention_heads,
            intermediate_size=hf.intermediate_size,
            norm="layer",
            norm_eps=hf.layer_norm_eps,
            mlp="plain",
            activation=self._activation(hf.hidden_act),
            parallel_residual=True,
            attn_qkv_bias=True,
            attn_out_bias=True,
            mlp_bias=True,
            lm_head_bias=True,
        )
