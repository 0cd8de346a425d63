"""Families added to the canonical decoder with the generic-path issue (OLMo 2, SmolLM3, Phi-2, Cohere,
Falcon, Gemma 3, Mixtral): speculative sampling keeps the target distribution on both backends, Falcon's three block
designs convert exactly, and their standard ONNX graphs pass the checker. (Logits parity and greedy
equality run for them in test_parity, test_lossless_greedy, test_onnx and test_onnx_fused, which cover
every family in tiny_models.CONFIGS.)"""

import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from lossless import chi_square_pvalue, exact_marginals, next_token_logits, sample_third_tokens  # noqa: E402
from tiny_models import CONFIGS, make_model  # noqa: E402

from speccompile.convert import arch_config, canonical_weights, choose_path  # noqa: E402
from speccompile.exporters.onnx_export import export_onnx_weights  # noqa: E402
from speccompile.runtime.artifact.manifest import DraftPlan  # noqa: E402
from speccompile.runtime.backends.onnx import OnnxBackend  # noqa: E402
from speccompile.runtime.backends.torch.backend import TorchBackend  # noqa: E402
from speccompile.runtime.backends.torch.decoder import build_decoder  # noqa: E402
from speccompile.runtime.sampling import SamplingParams  # noqa: E402

NEW_FAMILIES = ("olmo2", "smollm3", "phi", "cohere", "falcon", "gemma3_text", "mixtral")
VOCAB = 12
PROMPT = [1, 5, 7, 3]
SAMPLES = 1000
ALPHA = 1e-3


def _canonical(model):
    path = choose_path(model)
    assert path.path == "canonical", path.why
    config = arch_config(model)
    return config, canonical_weights(model, config)


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_speculative_sampling_keeps_the_target_distribution_on_both_backends(family, tmp_path):
    from transformers import AutoModelForCausalLM

    folder = make_model(family, tmp_path / family, seed=4, vocab_size=VOCAB, initializer_range=0.15)
    config, weights = _canonical(AutoModelForCausalLM.from_pretrained(folder).eval())
    decoder = build_decoder(config, weights)
    plan = DraftPlan.of(
        name="skip", skip_attn=[1, 2], skip_mlp=[1, 2], sources={"model": {"max_draft": 2, "adaptive": False}}
    )
    record = export_onnx_weights(config, weights, {"skip": plan}, tmp_path / "art" / "onnx", variant="fused")
    params = SamplingParams(temperature=1.0)
    _, target3 = exact_marginals(next_token_logits(decoder), params, PROMPT, VOCAB)
    _, draft3 = exact_marginals(next_token_logits(decoder, plan), params, PROMPT, VOCAB)
    assert 0.5 * np.abs(target3 - draft3).sum() > 0.05, "draft too close to the target for the control to mean anything"
    for backend in (TorchBackend(decoder), OnnxBackend(tmp_path / "art", record, config)):
        spec3, accepted = sample_third_tokens(backend, PROMPT, plan, params, SAMPLES)
        assert 0 < accepted < 2 * SAMPLES, "both the accept and the reject path must be exercised"
        assert chi_square_pvalue(spec3, target3) > ALPHA, type(backend).__name__
        assert chi_square_pvalue(spec3, draft3) < ALPHA, type(backend).__name__  # negative control


@pytest.mark.parametrize(
    "design",
    [
        dict(new_decoder_architecture=True, num_kv_heads=2),  # falcon-40b/180b: grouped qkv, two norms
        dict(new_decoder_architecture=True, num_kv_heads=2, num_ln_in_parallel_attn=1),  # one norm for both branches
        dict(
            new_decoder_architecture=False, multi_query=False, parallel_attn=False, bias=True, num_kv_heads=4
        ),  # sequential
    ],
    ids=["grouped", "grouped-one-norm", "sequential"],
)
def test_falcon_block_designs_convert_exactly(design):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("falcon", **{**CONFIGS["falcon"], **design})).eval()
    config, weights = _canonical(model)
    decoder = build_decoder(config, weights)
    ids = torch.randint(3, 300, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        assert float((decoder(ids) - model(ids).logits).abs().max()) < 1e-4


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_standard_graphs_pass_the_checker(family, tmp_path):
    from transformers import AutoModelForCausalLM

    config, weights = _canonical(AutoModelForCausalLM.from_pretrained(make_model(family, tmp_path / family)).eval())
    plans = {
        "exit": DraftPlan.of(name="exit", exit_layer=2),
        "skip": DraftPlan.of(name="skip", skip_attn=[1], skip_mlp=[2]),
    }
    record = export_onnx_weights(config, weights, plans, tmp_path / "art" / "onnx", variant="standard")
    for graph in record["graphs"].values():
        onnx.checker.check_model(str(tmp_path / "art" / graph["file"]), full_check=True)
