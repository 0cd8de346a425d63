"""OPT: learned positions looked up at ``pos + 2``; only the pre-norm designs with one embedding width."""

from __future__ import annotations

from speccompile.runtime.artifact.manifest import ArchConfig

from .family import Family, Layout


class OPT(Family):
    model_types = ("opt",)
    LAYOUT = Layout(
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
    )

    def arch_config(self, model) -> ArchConfig:
        hf = model.config
        self._refuse(
            not hf.do_layer_norm_before,
            "OPT with post-layer-norm (do_layer_norm_before=False, e.g. opt-350m) is not supported",
        )
        self._refuse(
            hf.word_embed_proj_dim != hf.hidden_size, "OPT with word_embed_proj_dim != hidden_size is not supported"
        )
        self._refuse(not hf.layer_norm_elementwise_affine, "OPT without layer-norm affine weights is not supported")
        self._refuse(getattr(hf, "_remove_final_layer_norm", False), "OPT without a final layer norm is not supported")
        return ArchConfig(
            model_type=hf.model_type,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            num_layers=hf.num_hidden_layers,
            num_heads=hf.num_attention_heads,
            num_kv_heads=hf.num_attention_heads,
            head_dim=hf.hidden_size // hf.num_attention_heads,
            intermediate_size=hf.ffn_dim,
            norm="layer",
            norm_eps=1e-5,  # transformers' OPT LayerNorms use the default eps; the config has no field for it
            mlp="plain",
            activation=self._activation(hf.activation_function),
            positions="learned",
            position_offset=2,
            attn_qkv_bias=hf.enable_bias,
            attn_out_bias=hf.enable_bias,
            mlp_bias=hf.enable_bias,
            tie_word_embeddings=self._tied(hf),
            max_position_embeddings=hf.max_position_embeddings,
        )
