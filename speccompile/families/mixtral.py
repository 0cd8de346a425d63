"""Mixtral: Llama's attention with a routed mixture of gated experts in place of the MLP."""

from __future__ import annotations

from speccompile.runtime.artifact.manifest import ArchConfig

from .family import LLAMA_LAYER, Family, Layout


class Mixtral(Family):
    model_types = ("mixtral",)
    LAYOUT = Layout(
        "model",
        "embed_tokens",
        "layers",
        "norm",
        {k: v for k, v in LLAMA_LAYER.items() if not k.startswith("mlp.")},
        experts="block_sparse_moe",
    )

    def arch_config(self, model) -> ArchConfig:
        hf = model.config
        return ArchConfig(
            **self._rotary_fields(model),
            num_kv_heads=hf.num_key_value_heads,
            head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
            intermediate_size=hf.intermediate_size,
            norm="rms",
            norm_eps=hf.rms_norm_eps,
            mlp="gated",
            activation=self._activation(hf.hidden_act),
            sliding_window=hf.sliding_window,
            num_experts=hf.num_local_experts,
            experts_per_token=hf.num_experts_per_tok,
        )
