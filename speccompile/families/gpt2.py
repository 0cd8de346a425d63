"""GPT-2: learned positions, a fused qkv projection and Conv1D weights stored ``[in, out]``."""

from __future__ import annotations

from speccompile.runtime.artifact.manifest import ArchConfig

from .family import Family, Layout


class GPT2(Family):
    model_types = ("gpt2",)
    LAYOUT = Layout(
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
    )

    def arch_config(self, model) -> ArchConfig:
        hf = model.config
        self._refuse(hf.scale_attn_by_inverse_layer_idx, "gpt2 with scale_attn_by_inverse_layer_idx is not supported")
        hidden = hf.n_embd
        return ArchConfig(
            model_type=hf.model_type,
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
            activation=self._activation(hf.activation_function),
            positions="learned",
            attn_qkv_bias=True,
            attn_out_bias=True,
            mlp_bias=True,
            tie_word_embeddings=self._tied(hf),
            max_position_embeddings=hf.n_positions,
            attn_scale=None if hf.scale_attn_weights else 1.0,
        )
