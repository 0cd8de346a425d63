"""GPT-NeoX (Pythia): qkv fused per head, partial rotary, optionally a parallel residual."""

from __future__ import annotations

from speccompile.runtime.artifact.manifest import ArchConfig

from .family import Family, Layout


class GPTNeoX(Family):
    model_types = ("gpt_neox",)
    LAYOUT = Layout(
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
    )

    def arch_config(self, model) -> ArchConfig:
        hf = model.config
        return ArchConfig(
            **self._rotary_fields(model),
            num_kv_heads=hf.num_attention_heads,
            head_dim=hf.hidden_size // hf.num_attention_heads,
            intermediate_size=hf.intermediate_size,
            norm="layer",
            norm_eps=hf.layer_norm_eps,
            mlp="plain",
            activation=self._activation(hf.hidden_act),
            parallel_residual=hf.use_parallel_residual,
            attn_qkv_bias=hf.attention_bias,
            attn_out_bias=hf.attention_bias,
            mlp_bias=True,
        )
