"""Falcon: three block designs in one model type, each with its own norms and qkv layout, so its layout
is read from the config rather than fixed."""

from __future__ import annotations

from speccompile.runtime.artifact.manifest import ArchConfig

from .family import SHARED_NORM, Family, Layout

_LAYER = {
    "attn.qkv": "self_attention.query_key_value",
    "attn.o": "self_attention.dense",
    "mlp.up": "mlp.dense_h_to_4h",
    "mlp.down": "mlp.dense_4h_to_h",
}


class Falcon(Family):
    model_types = ("falcon",)

    def layout(self, hf_config) -> Layout:
        """The new decoder architecture (falcon-40b/180b): qkv grouped per kv head, one or two norms;
        the parallel block (falcon-7b) on one norm; the sequential block on two. The older two fuse qkv
        per head, or as [q; k; v] with multi-query attention."""
        config = hf_config
        if config.new_decoder_architecture:
            norms = (
                {"attn_norm": "ln_attn", "mlp_norm": "ln_mlp"}
                if (config.num_ln_in_parallel_attn or 2) == 2
                else SHARED_NORM
            )
            qkv = "grouped"
        elif config.parallel_attn:
            norms, qkv = SHARED_NORM, "concat" if config.multi_query else "per_head"
        else:
            norms = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"}
            qkv = "concat" if config.multi_query else "per_head"
        return Layout("transformer", "word_embeddings", "h", "ln_f", {**_LAYER, **norms}, fused_qkv=qkv)

    def arch_config(self, model) -> ArchConfig:
        hf = model.config
        common = self._rotary_fields(model)
        self._refuse(hf.alibi, "falcon with alibi positions is not supported by the canonical decoder")
        self._refuse(
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
            activation=self._activation(hf.activation),
            parallel_residual=bool(hf.new_decoder_architecture or hf.parallel_attn),
            attn_qkv_bias=hf.bias,
            attn_out_bias=hf.bias,
            mlp_bias=hf.bias,
        )
