"""Shared fixtures: tiny random-weight models of every family, built once per session."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# every load times its CPU product forms afresh (tests that force a choice need that) and writes nothing to the
# user's cache; tests/test_product_forms_store.py turns the store on in a folder of its own
os.environ.setdefault("SPECCOMPILE_CPU_LINEAR_STORE", "0")

import torch  # noqa: E402
from tiny_models import FAMILIES, make_model  # noqa: E402

# Tiny models are dominated by per-op overhead; one thread is faster and immune to a busy machine.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Returns a function family -> folder with a saved tiny model of that family (cached)."""
    root = tmp_path_factory.mktemp("tiny_models")
    made: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in made:
            made[family] = make_model(family, root / family)
        return made[family]

    return get


@pytest.fixture(scope="session")
def tiny_decoder(tiny_model_dir):
    """Returns a function family -> (transformers model, canonical Decoder)."""
    from transformers import AutoModelForCausalLM

    from speccompile.convert import arch_config, canonical_weights
    from speccompile.runtime.backends.torch.decoder import build_decoder

    cache = {}

    def get(family: str):
        if family not in cache:
            hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir(family), attn_implementation="eager").eval()
            config = arch_config(hf)
            cache[family] = (hf, build_decoder(config, canonical_weights(hf, config)))
        return cache[family]

    return get


@pytest.fixture(scope="session")
def tiny_artifact(tiny_model_dir, tmp_path_factory):
    """A built artifact (cosine method, small calibration) of the tiny Llama, built once."""
    from speccompile.build import BuildOptions, build

    out = tmp_path_factory.mktemp("artifacts") / "llama"
    options = BuildOptions(
        model=str(tiny_model_dir("llama")),
        out=out,
        method="cosine",
        max_draft=4,
        calibration_tokens=16,
        confirm_prompts=2,
        confirm_tokens=16,
        show_progress=False,
    )
    return build(options, log=lambda message: None)


@pytest.fixture(scope="session")
def small_vocab_llama(tmp_path_factory):
    """A tiny random Llama over a 12-token vocabulary, for sampling tests that enumerate exact
    distributions (shared by the drafter and draft-head sampling tests)."""
    from transformers import AutoModelForCausalLM

    from speccompile.convert import arch_config, canonical_weights
    from speccompile.runtime.backends.torch.decoder import build_decoder

    folder = make_model("llama", tmp_path_factory.mktemp("sv") / "llama", seed=4, vocab_size=12, initializer_range=0.15)
    hf = AutoModelForCausalLM.from_pretrained(folder).eval()
    config = arch_config(hf)
    return build_decoder(config, canonical_weights(hf, config))


__all__ = ["FAMILIES"]
