"""Tiny random-weight transformers models of every supported family, built from configs.

Each is a real ``*ForCausalLM`` saved with ``save_pretrained`` (safetensors) next to a real byte-level
BPE tokenizer trained here on a few lines of text, so the whole pipeline (load -> convert -> passes ->
artifact -> runtime) runs on it exactly as on a hub model.
"""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 320
TOKENIZER_TEXT = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog.",
    "for i in range(10):\n    print(i * i)\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "import os\nimport sys\n\nif __name__ == '__main__':\n    main()\n",
] * 20

_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    initializer_range=0.08,
    tie_word_embeddings=False,
)

CONFIGS: dict[str, dict] = {
    "llama": dict(_COMMON),
    "mistral": dict(_COMMON, sliding_window=24),  # window shorter than the test sequences: exercised
    "qwen2": dict(_COMMON),
    "qwen3": dict(_COMMON, head_dim=24),  # head_dim decoupled from hidden/heads, q/k norm
    "gemma": dict(_COMMON, head_dim=16, tie_word_embeddings=True),
    "phi3": dict(_COMMON),
    "gpt2": dict(
        vocab_size=VOCAB,
        n_embd=64,
        n_layer=4,
        n_head=4,
        n_positions=256,
        bos_token_id=1,
        eos_token_id=2,
        initializer_range=0.08,
    ),
    "gpt_neox": dict(_COMMON, rotary_pct=0.5, partial_rotary_factor=0.5, use_parallel_residual=True),
    "opt": dict(
        vocab_size=VOCAB,
        hidden_size=64,
        ffn_dim=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        max_position_embeddings=256,
        word_embed_proj_dim=64,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        init_std=0.08,
    ),
}
CONFIGS.update(
    {  # added with the generic path's issue: same decoder, new ArchConfig switches
        "olmo2": dict(_COMMON),  # norms after the sublayers, q/k norm over the whole projection
        "smollm3": dict(_COMMON, no_rope_layers=[1, 0, 1, 1]),  # block 1 has no rotary (NoPE)
        "phi": dict(_COMMON, partial_rotary_factor=0.5),  # parallel block on one LayerNorm, lm_head bias
        "cohere": dict(
            _COMMON, logit_scale=0.5
        ),  # parallel block, interleaved rotary, logit scale, bias-free LayerNorm
        "falcon": dict(
            _COMMON,
            num_kv_heads=1,
            multi_query=True,
            new_decoder_architecture=False,
            parallel_attn=True,
            tie_word_embeddings=True,
        ),  # falcon-7b's design: multi-query, parallel attention
        # sandwich norms, (1 + w) q/k norms, windowed blocks with their own rotary base, logit softcap
        "gemma3_text": dict(
            _COMMON,
            head_dim=16,
            sliding_window=12,
            final_logit_softcapping=30.0,
            query_pre_attn_scalar=20,
            layer_types=["sliding_attention", "full_attention"] * 2,
            rope_local_base_freq=100.0,
        ),
        "mixtral": dict(_COMMON, num_local_experts=4, num_experts_per_tok=2, sliding_window=None),  # routed experts
    }
)
FAMILIES = tuple(CONFIGS)

# Families without a canonical conversion: they build on the generic torch path (runtime/backends/torch/hf_decoder.py).
GENERIC_CONFIGS: dict[str, dict] = {
    "olmo": dict(_COMMON, clip_qkv=8.0),  # non-parametric LayerNorm, clipped q/k/v
    "stablelm": dict(_COMMON, partial_rotary_factor=0.25),
    "granite": dict(_COMMON, embedding_multiplier=2.0, residual_multiplier=0.5, logits_scaling=4.0),
    "starcoder2": dict(_COMMON, sliding_window=None),
    "gemma2": dict(_COMMON, head_dim=16, sliding_window=12, attn_logit_softcapping=50.0),
    "bloom": dict(
        vocab_size=VOCAB,
        hidden_size=64,
        n_layer=4,
        n_head=4,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        initializer_range=0.08,
    ),  # ALiBi; sizes its mask from the cache: dynamic cache
}
GENERIC_FAMILIES = tuple(GENERIC_CONFIGS)


def make_tokenizer(folder: Path):
    """A byte-level BPE tokenizer (transformers format) with VOCAB entries; ids 0/1/2 are pad/bos/eos."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TOKENIZER_TEXT, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.save_pretrained(folder)
    return fast


def make_model(family: str, folder: Path, seed: int = 0, **overrides) -> Path:
    """Build, randomly initialise and save a tiny model of ``family`` (plus tokenizer) into ``folder``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.for_model(family, **{**{**CONFIGS, **GENERIC_CONFIGS}[family], **overrides})
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    make_tokenizer(folder)
    return folder
