"""A model family written outside speccompile, for ``tests/test_family_descriptors.py``: what adding a family costs.

``demo_llama`` is a Llama-shaped transformers model under a model type speccompile has never heard of (the
test registers it with transformers). This file plus one ``FAMILIES`` entry is all of it: the conversion, the
build and the runtime learn nothing about it. (``Family`` supplies the rotary fields, ``_refuse`` and
``_activation``; ``speccompile/convert.py`` reads the layout.)
"""

from speccompile.families.family import LLAMA_LAYER, Family, Layout
from speccompile.runtime.artifact.manifest import ArchConfig


class DemoLlama(Family):
    model_types = ("demo_llama",)
    LAYOUT = Layout("model", "embed_tokens", "layers", "norm", LLAMA_LAYER)

    def arch_config(self, model) -> ArchConfig:
        hf = model.config
        common = self._rotary_fields(model)
        self._refuse(bool(getattr(hf, "mlp_bias", False)), "demo_llama with mlp_bias is not supported")
        return ArchConfig(
            **common,
            num_kv_heads=hf.num_key_value_heads,
            head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
            intermediate_size=hf.intermediate_size,
            norm="rms",
            norm_eps=hf.rms_norm_eps,
            mlp="gated",
            activation=self._activation(hf.hidden_act),
            attn_qkv_bias=hf.attention_bias,
            attn_out_bias=hf.attention_bias,
            sliding_window=None,
        )
