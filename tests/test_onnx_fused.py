"""The fused ONNX graphs (ONNX Runtime contrib ops, KV cache updated in place) and weight-only
quantized graphs.

- fused logits match the torch decoder within 1e-4 on all nine families, through every graph kind
  (verify, layer-skip draft, early-exit prefix / head / suffix), with rollback;
- speculative greedy == plain greedy on the fused graphs, all nine families, both plan kinds;
- the KV cache is written in place (the backend's buffers hold the entries after a call), a replica
  has its own cache, and running the same graphs with the past copied in gives the same logits;
- int8 / int4 artifacts: a k-token verify computes exactly the 1-token steps it replaces, and speculative
  greedy == the quantized model's own plain greedy, divergences only at near-ties of the quantized model
  (the fp32 near-tie rule, see the comment on the padding; at a real model's shapes: tests/test_real_shapes.py).

Run: OMP_NUM_THREADS=1 python -m pytest -q tests/test_onnx_fused.py
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")

from lossless import assert_speculative_is_plain, run  # noqa: E402
from onnx_helpers import (  # noqa: E402
    artifact_cache,
    check_greedy_lossless,
    check_logits,
    make_artifact,
    ort_backend,
    split_memory_bounds,
)
from tiny_models import FAMILIES  # noqa: E402

from speccompile.exporters.onnx_export import fused_supports  # noqa: E402
from speccompile.runtime.artifact.manifest import DraftPlan, read_manifest  # noqa: E402
from speccompile.runtime.backends.onnx import OnnxBackend  # noqa: E402
from speccompile.runtime.backends.torch.backend import TorchBackend  # noqa: E402

# With int8 activations (MatMulNBits accuracy_level 4) any difference between a k-token verify and the
# 1-token steps it replaces, however small, can move an activation across an int8 rounding boundary and
# the logits by a quantization step; so the fused graphs give attention the same kernels for one row as
# for several (exporters/onnx_fused.FusedGraph.padding) and the test requires the two paths to agree exactly. A
# divergence would then need an exact tie; the fp32 rule (lossless.NEAR_TIE, 1e-4) is kept for it.


def _verify_vs_steps(backend: OnnxBackend, prompt: list[int], k: int = 4) -> float:
    """Largest |logit| difference between one k-token call and k 1-token steps over the same positions."""
    backend.reserve(len(prompt) + k)
    backend.forward(prompt[:-k], 0)
    together = backend.forward(prompt[-k:], len(prompt) - k)
    apart = np.stack([backend.forward([t], len(prompt) - k + j)[-1] for j, t in enumerate(prompt[-k:])])
    return float(np.abs(together - apart).max())


def plans(num_layers: int) -> dict[str, DraftPlan]:
    out = [
        DraftPlan.of(
            name="skip-k3",
            skip_attn=[1],
            skip_mlp=[num_layers - 2],
            sources={"model": {"max_draft": 3, "threshold": 0.0}},
        ),
        DraftPlan.of(name="exit-k3", exit_layer=num_layers // 2, sources={"model": {"max_draft": 3, "threshold": 0.0}}),
        DraftPlan.of(
            name="exit-last", exit_layer=num_layers - 1, sources={"model": {"max_draft": 6, "adaptive": False}}
        ),
        DraftPlan.of(
            name="skip-all-attn",
            skip_attn=list(range(num_layers)),
            sources={"model": {"max_draft": 4, "adaptive": False}},
        ),
    ]
    return {p.name: p for p in out}


@pytest.fixture(scope="session")
def fused_artifact(tiny_decoder, tiny_model_dir, tmp_path_factory):
    """family -> (decoder, artifact root, plans, OnnxBackend) with fused graphs, built once per family."""
    return artifact_cache(
        tiny_decoder,
        tmp_path_factory.mktemp("fused_artifacts"),
        plans,
        tokenizer_of=lambda family: tiny_model_dir(family) / "tokenizer.json",
        variant="fused",
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_fused_logits_match_torch(family, fused_artifact):
    decoder, root, plan_map, ort = fused_artifact(family)
    record = read_manifest(root).backends["onnx"]
    # Blocks the fused builder does not cover (OLMo 2's post-norms) get the standard graphs instead.
    variant = "fused" if fused_supports(decoder.config) else "standard"
    assert record["variant"] == variant and {g["variant"] for g in record["graphs"].values()} == {variant}
    assert ort.fused == (set(ort.sessions) if variant == "fused" else set())
    check_logits(ort, TorchBackend(decoder), decoder, plan_map, family)


@pytest.mark.parametrize("family", FAMILIES)
def test_fused_speculative_greedy_equals_plain(family, fused_artifact):
    decoder, _, plan_map, ort = fused_artifact(family)
    check_greedy_lossless(ort, decoder, plan_map, prompts=3, new_tokens=32, step=13)


def test_fused_graphs_use_contrib_ops_and_standard_graphs_pass_the_checker(fused_artifact, tiny_decoder, tmp_path):
    _, root, plan_map, _ = fused_artifact("llama")
    record = read_manifest(root).backends["onnx"]
    for key, g in record["graphs"].items():
        model = onnx.load(str(root / g["file"]), load_external_data=False)
        ops = {n.op_type for n in model.graph.node}
        initializers = {i.name for i in model.graph.initializer}
        for n in model.graph.node:  # no past/present concatenation; weights only concatenated (folded at load)
            assert n.op_type != "Concat" or set(n.input) <= initializers or key == "head", (key, n.input)
        assert "FusedMatMul" in ops and "MatMul" not in ops and "Gemm" not in ops, key
        if key not in ("head", "skip.skip-all-attn"):
            assert {"GroupQueryAttention", "SkipSimplifiedLayerNormalization"} <= ops, (key, ops)
        shapes = {
            vi.name: [d.dim_param or d.dim_value for d in vi.type.tensor_type.shape.dim] for vi in model.graph.input
        }
        for name, dims in shapes.items():
            if name.startswith("past_key_values."):
                assert dims[2] == "max_len"
    _, decoder = tiny_decoder("llama")
    standard = make_artifact(decoder, plan_map, tmp_path / "standard", root / "tokenizer" / "tokenizer.json")
    for g in read_manifest(standard).backends["onnx"]["graphs"].values():
        assert g["variant"] == "standard"
        onnx.checker.check_model(str(standard / g["file"]), full_check=True)


def test_kv_cache_written_in_place_and_replicas_have_their_own(fused_artifact):
    decoder, root, plan_map, _ = fused_artifact("qwen2")
    ort = ort_backend(root)  # fresh buffers
    tokens = list(range(5, 25))
    ort.reserve(32)
    buffers = [id(k) for k in ort.k]
    logits = ort.forward(tokens, 0)
    assert [id(k) for k in ort.k] == buffers
    ref = TorchBackend(decoder)
    ref.reserve(32)
    ref.forward(tokens, 0)
    for layer in range(decoder.config.num_layers):  # the graph wrote the KV entries into our buffers
        np.testing.assert_allclose(ort.k[layer][:, :, :20], ref.cache.k[layer][:, :, :20].numpy(), atol=1e-5)
        assert not ort.k[layer][
            :, :, 20:
        ].any()  # fp32 graphs run no padding row (exporters/onnx_fused.FusedGraph.padding)
    copying = ort_backend(root, kv_in_place=False)  # same graphs, past copied in and present copied back
    copying.reserve(32)
    np.testing.assert_allclose(copying.forward(tokens, 0), logits, atol=1e-6)
    np.testing.assert_allclose(copying.forward([7, 8], 20), ort.forward([7, 8], 20), atol=1e-6)
    # a replica decodes another prompt in between without disturbing this one
    plan = plan_map["exit-k3"]
    alone, _ = run(ort, tokens, 16, plan)
    other = ort.replica()
    assert other.sessions is ort.sessions and other.k == []
    run(other, [9, 9, 9], 16, plan)
    assert run(ort, tokens, 16, plan)[0] == alone
    assert run(other, tokens, 16, plan)[0] == alone


@pytest.mark.parametrize("scheme,family", [("int4", "llama"), ("int8", "gpt_neox"), ("int4", "phi3")])
def test_quantized_speculative_equals_quantized_plain(scheme, family, tiny_decoder, tiny_model_dir, tmp_path):
    _, decoder = tiny_decoder(family)
    plan_map = plans(decoder.config.num_layers)
    root = make_artifact(
        decoder,
        plan_map,
        tmp_path / scheme,
        tiny_model_dir(family) / "tokenizer.json",
        variant="fused",
        quantize=scheme,
        block_size=16,
    )
    record = read_manifest(root).backends["onnx"]
    assert record["quantization"]["scheme"] == scheme and record["quantization"]["block_size"] == 16
    assert any(n.endswith(f".{scheme}") for n in record["tensors"])
    assert not any(n.endswith("mlp.up.weight") for n in record["tensors"]), "float weights left in the quantized file"
    ort = ort_backend(root)
    ref = TorchBackend(decoder)
    gen = torch.Generator().manual_seed(5)
    prompt = torch.randint(3, decoder.config.vocab_size, (12,), generator=gen).tolist()
    ref.reserve(64)
    ort.reserve(64)
    quant, full = ort.forward(prompt, 0), ref.forward(prompt, 0)
    err = float(np.abs(quant - full).max())
    assert 1e-6 < err < 0.5 * float(np.abs(full).max()), (
        f"quantized logits {err:.2e} from float: not quantized, or broken"
    )
    rounding = _verify_vs_steps(ort.replica(), prompt)
    assert rounding == 0.0, f"verify and step are {rounding:.2e} apart: int8 activations make that a quantization step"
    prompts = [torch.randint(3, decoder.config.vocab_size, (4 + 11 * p,), generator=gen).tolist() for p in range(3)]
    assert_speculative_is_plain(ort, ort.replica(), prompts, plan_map, 32)  # the quantized model's own near-ties


def test_build_quantize_cli(tiny_model_dir, tmp_path):
    """build --quantize int8 writes a fused, quantized ONNX artifact that generates; without an onnx backend it
    is refused with a one-line error."""
    import json

    from click.testing import CliRunner

    from speccompile.cli import main

    out = tmp_path / "q8"
    runner = CliRunner()
    args = [
        "build",
        str(tiny_model_dir("llama")),
        "-o",
        str(out),
        "--method",
        "early-exit",
        "--backend",
        "torch,onnx",
        "--quantize",
        "int8",
        "--calibration-tokens",
        "8",
        "--max-draft",
        "2",
        "--quiet",
    ]
    result = runner.invoke(main, args)
    assert result.exit_code == 0, result.output
    record = read_manifest(out).backends["onnx"]
    assert record["variant"] == "fused" and record["quantization"]["scheme"] == "int8"
    gen = runner.invoke(
        main,
        ["generate", str(out), "--backend", "onnx", "--prompt", "def add(a, b):", "--max-new-tokens", "8", "--json"],
    )
    assert gen.exit_code == 0, gen.output
    assert len(json.loads(gen.output)["token_ids"]) == 8
    refused = runner.invoke(main, args[:6] + ["--backend", "torch", "--quantize", "int4"])
    assert refused.exit_code == 1 and "--backend onnx" in refused.output


def test_build_packed_rows_cli(tiny_model_dir, tmp_path):
    """build --packed-rows writes fused graphs that take several sequences' rows of any width in one call (and
    say so in the manifest); a build without it keeps the older graphs."""
    from click.testing import CliRunner

    from speccompile.cli import main

    common = ["--method", "lookup", "--backend", "onnx", "--calibration-tokens", "8", "--quiet"]
    for flag, packed in (["--packed-rows"], True), ([], False):
        out = tmp_path / f"packed{int(packed)}"
        result = CliRunner().invoke(main, ["build", str(tiny_model_dir("llama")), "-o", str(out), *common, *flag])
        assert result.exit_code == 0, result.output
        record = read_manifest(out).backends["onnx"]
        assert bool(record.get("packed_rows")) is packed
        inputs = {i["name"] for graph in record["graphs"].values() for i in graph["inputs"]}
        assert ("query_seqlens" in inputs) is packed


def test_fused_early_exit_memory_with_prepacking(tmp_path):
    """With pre-packing on (the default), plain decoding holds the fused graphs' weights once, packed, and
    speculative decoding (prefix, suffix and head sessions) each weight packed once (``split_memory_bounds``)."""
    import sys

    from tiny_models import make_model
    from transformers import AutoModelForCausalLM

    from speccompile.convert import arch_config, canonical_weights
    from speccompile.runtime.backends.torch.decoder import build_decoder

    sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
    from onnx_memory import measure

    folder = make_model(
        "llama",
        tmp_path / "llama",
        vocab_size=16384,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    hf = AutoModelForCausalLM.from_pretrained(folder).eval()
    config = arch_config(hf)
    decoder = build_decoder(config, canonical_weights(hf, config))
    plan_map = {"exit": DraftPlan.of(name="exit", exit_layer=4, sources={"model": {"max_draft": 3}})}
    root = make_artifact(decoder, plan_map, tmp_path / "artifact", folder / "tokenizer.json", variant="fused")
    plain, spec = measure(root, "verify", prepack=True, threads=1), measure(root, "all", prepack=True, threads=1)
    assert spec["sessions"] == ["head", "prefix.4", "suffix.4"]
    split_memory_bounds(root, plain["bytes"], spec["bytes"])
