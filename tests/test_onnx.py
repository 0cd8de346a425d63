"""The ONNX export and the ONNX Runtime backend.

- ORT logits (full model, layer-skip drafts, early-exit prefix/head/suffix) match the torch decoder;
- ORT speculative greedy == ORT plain greedy == torch greedy, all nine families, both plan kinds;
- ORT speculative sampling has the target distribution (chi-square, with a negative control);
- one shared weights file on disk; sessions share weights in memory (RSS, in subprocesses);
- the runtime runs an ONNX artifact with torch and transformers unimportable;
- bad artifacts fail with one-line ArtifactErrors.

Run: OMP_NUM_THREADS=1 python -m pytest -q tests/test_onnx.py
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")

from lossless import assert_same_greedy, chi_square_pvalue, exact_marginals, next_token_logits, run, sample_third_tokens  # noqa: E402
from onnx_helpers import (  # noqa: E402
    artifact_cache,
    check_greedy_lossless,
    check_logits,
    make_artifact,
    open_onnx,
    ort_backend,
    split_memory_bounds,
)
from tiny_models import FAMILIES, make_model  # noqa: E402

from speccompile.exporters.onnx_export import export_onnx, export_onnx_weights  # noqa: E402
from speccompile.runtime.artifact.manifest import DraftPlan, read_manifest  # noqa: E402
from speccompile.runtime.backends.onnx import OnnxBackend  # noqa: E402
from speccompile.runtime.backends.torch.backend import TorchBackend  # noqa: E402
from speccompile.runtime.errors import ArtifactError  # noqa: E402
from speccompile.runtime.sampling import SamplingParams  # noqa: E402

TESTS = Path(__file__).parent
PROMPTS = 6
NEW_TOKENS = 40


def plans(num_layers: int) -> dict[str, DraftPlan]:
    out = []
    for k, threshold in ((1, 0.0), (3, 0.0), (5, 0.3)):
        out.append(
            DraftPlan.of(
                name=f"skip-k{k}",
                skip_attn=[1],
                skip_mlp=[num_layers - 2],
                sources={"model": {"max_draft": k, "threshold": threshold}},
            )
        )
        out.append(
            DraftPlan.of(
                name=f"exit-k{k}",
                exit_layer=num_layers // 2,
                sources={"model": {"max_draft": k, "threshold": threshold}},
            )
        )
    out.append(
        DraftPlan.of(
            name="exit-last", exit_layer=num_layers - 1, sources={"model": {"max_draft": 6, "adaptive": False}}
        )
    )
    out.append(
        DraftPlan.of(
            name="skip-all-attn",
            skip_attn=list(range(num_layers)),
            sources={"model": {"max_draft": 4, "adaptive": False}},
        )
    )
    return {p.name: p for p in out}


@pytest.fixture(scope="session")
def onnx_artifact(tiny_decoder, tmp_path_factory):
    """family -> (decoder, artifact root, plans, OnnxBackend), built once per family."""
    return artifact_cache(tiny_decoder, tmp_path_factory.mktemp("onnx_artifacts"), plans)


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_torch(family, onnx_artifact):
    """Every graph, through the backend protocol: prefill, incremental steps with past, drafts of both
    plan kinds and early-exit verifies with reuse, all within 1e-4 of the torch backend."""
    decoder, root, plan_map, ort = onnx_artifact(family)
    check_logits(
        ort,
        TorchBackend(decoder),
        decoder,
        {n: plan_map[n] for n in ("skip-k3", "exit-k3", "exit-last", "skip-all-attn")},
        family,
    )


def test_graphs_have_dynamic_axes_and_opset(onnx_artifact):
    _, root, _, _ = onnx_artifact("llama")
    record = read_manifest(root).backends["onnx"]
    assert record["opset"] >= 18
    for key, g in record["graphs"].items():
        model = onnx.load(str(root / g["file"]), load_external_data=False)
        assert model.opset_import[0].version >= 18
        for vi in model.graph.input:
            dims = vi.type.tensor_type.shape.dim
            assert dims[0].dim_param == "batch", (key, vi.name)
            if vi.name.startswith("past_key_values."):
                assert dims[2].dim_param == "past_len"
            else:
                assert dims[1].dim_param == "seq"
    # batch 2 with a past: each row equals the same row run alone
    _, ort = onnx_artifact("llama")[0], onnx_artifact("llama")[3]
    session, config = ort.sessions["verify"], ort.config
    rng = np.random.default_rng(0)
    ids = rng.integers(3, config.vocab_size, (2, 7))
    past = {
        n: rng.standard_normal((2, config.num_kv_heads, 5, config.head_dim)).astype(np.float32)
        for n in ort.inputs["verify"]
        if n.startswith("past_key_values.")
    }
    both = session.run(["logits"], {"input_ids": ids, **past})[0]
    for row in range(2):
        alone = session.run(
            ["logits"], {"input_ids": ids[row : row + 1], **{n: v[row : row + 1] for n, v in past.items()}}
        )[0]
        np.testing.assert_allclose(both[row : row + 1], alone, atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_speculative_greedy_equals_plain(family, onnx_artifact):
    decoder, _, plan_map, ort = onnx_artifact(family)
    assert {plan.is_early_exit for plan in plan_map.values()} == {True, False}  # both kinds exercised
    check_greedy_lossless(ort, decoder, plan_map, PROMPTS, NEW_TOKENS, step=9)


def test_export_from_canonical_numpy_weights(onnx_artifact, tmp_path):
    """export_onnx_weights takes the artifact's canonical weights (tied lm_head absent) as numpy arrays."""
    decoder, root, plan_map, ort = onnx_artifact("gemma")
    weights = {k: v.numpy() for k, v in decoder.state_dict().items() if k != "lm_head.weight"}
    record = export_onnx_weights(decoder.config, weights, plan_map, tmp_path / "onnx")
    assert record["tensors"].keys() == read_manifest(root).backends["onnx"]["tensors"].keys()
    other = OnnxBackend(tmp_path, record, decoder.config, threads=1, mmap=True)  # memory-mapped weights
    for b in (ort, other):
        b.reserve(16)
    np.testing.assert_array_equal(other.forward([5, 6, 7], 0), ort.forward([5, 6, 7], 0))


@pytest.mark.parametrize("family", ["llama", "gpt_neox"])
def test_float16_export(family, tiny_decoder, tmp_path):
    """dtype="float16" (meant for CUDA) passes the checker and runs on the CPU EP: logits close to the fp32
    torch decoder, speculative greedy == plain greedy."""
    _, decoder = tiny_decoder(family)
    plan_map = {k: v for k, v in plans(decoder.config.num_layers).items() if k in ("skip-k3", "exit-k3")}
    record = export_onnx(decoder, plan_map, tmp_path / "onnx", dtype="float16")
    assert record["dtype"] == "float16"
    assert {t["dtype"] for n, t in record["tensors"].items() if n != "rope_inv_freq"} == {"float16"}
    ort = OnnxBackend(tmp_path, record, decoder.config, threads=1)
    ort.reserve(80)
    prompt = list(range(5, 35))
    with torch.inference_mode():
        ref = decoder(torch.tensor([prompt]))[0].numpy()
    assert np.abs(ort.forward(prompt, 0) - ref).max() < 2e-2
    plain, _ = run(ort, prompt, 30)
    for plan in plan_map.values():
        spec, _ = run(ort, prompt, 30, plan)
        assert spec == plain, plan.name


# -- sampling -----------------------------------------------------------------------------------------
VOCAB = 12
PROMPT = [1, 5, 7, 3]
SAMPLES = 1500
ALPHA = 1e-3


def test_speculative_sampling_matches_target_distribution(tmp_path):
    from transformers import AutoModelForCausalLM

    from speccompile.convert import arch_config, canonical_weights
    from speccompile.runtime.backends.torch.decoder import build_decoder

    folder = make_model("llama", tmp_path / "small_vocab", seed=4, vocab_size=VOCAB, initializer_range=0.15)
    hf = AutoModelForCausalLM.from_pretrained(folder).eval()
    config = arch_config(hf)
    decoder = build_decoder(config, canonical_weights(hf, config))
    plan = DraftPlan.of(
        name="skip", skip_attn=[1, 2], skip_mlp=[1, 2], sources={"model": {"max_draft": 2, "adaptive": False}}
    )
    root = make_artifact(decoder, {"skip": plan}, tmp_path / "artifact")
    ort = ort_backend(root)
    params = SamplingParams(temperature=1.0)

    target3, draft3 = (
        exact_marginals(next_token_logits(decoder), params, PROMPT, VOCAB)[1],
        exact_marginals(next_token_logits(decoder, plan), params, PROMPT, VOCAB)[1],
    )
    assert 0.5 * np.abs(target3 - draft3).sum() > 0.1, "draft too close to the target for the control to mean anything"
    spec3, accepted = sample_third_tokens(ort, PROMPT, plan, params, SAMPLES)
    assert 0 < accepted < 2 * SAMPLES, "both the accept and the reject path must be exercised"
    plain3 = [run(ort, PROMPT, 3, None, params, seed=seed)[0][2] for seed in range(SAMPLES // 2)]
    assert chi_square_pvalue(spec3, target3) > ALPHA
    assert chi_square_pvalue(plain3, target3) > ALPHA
    assert chi_square_pvalue(spec3, draft3) < ALPHA  # negative control: the test can tell the draft apart


# -- one weights file -------------------------------------------------------------------------------
def test_one_shared_weights_file(onnx_artifact):
    decoder, root, _, _ = onnx_artifact("gemma")  # tied embeddings: lm_head must not be stored twice
    record = read_manifest(root).backends["onnx"]
    onnx_dir = root / "onnx"
    files = sorted(onnx_dir.iterdir())
    data_files = [p for p in files if p.suffix != ".onnx"]
    assert [p.name for p in data_files] == ["weights.bin"]
    assert record["weights"] == "onnx/weights.bin"
    # tensors by where their data starts (a tied head is counted once; q/k/v packed by the torch backend
    # into one matrix are row slices of it, each counted)
    unique = {t.data_ptr(): t.numel() * t.element_size() for t in decoder.state_dict().values()}
    weight_bytes = sum(unique.values())
    bin_size = (onnx_dir / "weights.bin").stat().st_size
    assert bin_size <= 1.02 * weight_bytes + 64 * len(unique), (bin_size, weight_bytes)
    graph_bytes = sum(p.stat().st_size for p in files if p.suffix == ".onnx")
    assert graph_bytes < 0.25 * bin_size, "graphs carry weights inline"
    assert len(record["graphs"]) >= 5
    for g in record["graphs"].values():
        path = root / g["file"]
        onnx.checker.check_model(str(path))
        model = onnx.load(str(path), load_external_data=False)
        assert model.graph.initializer, g["file"]
        for init in model.graph.initializer:
            assert init.data_location == onnx.TensorProto.EXTERNAL and not init.raw_data
            location = {e.key: e.value for e in init.external_data}["location"]
            assert location == "weights.bin"


# -- memory -----------------------------------------------------------------------------------------
sys.path.insert(0, str(TESTS.parent / "benchmarks"))
from onnx_memory import measure  # noqa: E402


@pytest.mark.parametrize("family", ["llama", "gpt_neox", "opt", "mistral"])
def test_early_exit_only_artifact_decodes_through_prefix_and_suffix(family, tiny_decoder, tmp_path):
    """With only early-exit plans there is no verify session: plain decoding runs prefix(E) + suffix(E).
    It must equal the torch backend, and speculative output must equal plain output."""
    _, decoder = tiny_decoder(family)
    plan_map = {
        f"exit-k{k}": DraftPlan.of(name=f"exit-k{k}", exit_layer=2, sources={"model": {"max_draft": k}})
        for k in (1, 3, 6)
    }
    backend = ort_backend(make_artifact(decoder, plan_map, tmp_path / family))
    assert "verify" not in backend.sessions and backend.full_split is not None
    reference = TorchBackend(decoder)
    gen = torch.Generator().manual_seed(11)
    for length in (4, 19, 33):
        prompt = torch.randint(3, decoder.config.vocab_size, (length,), generator=gen).tolist()
        plain, _ = run(backend, prompt, 36)
        assert_same_greedy(decoder, prompt, run(reference, prompt, 36)[0], plain)
        for plan in plan_map.values():
            assert_same_greedy(decoder, prompt, plain, run(backend, prompt, 36, plan)[0])


@pytest.fixture(scope="module")
def big_decoder(tmp_path_factory):
    """A random llama whose weights (124 MiB) dominate the process's memory."""
    from transformers import AutoModelForCausalLM

    from speccompile.convert import arch_config, canonical_weights
    from speccompile.runtime.backends.torch.decoder import build_decoder

    folder = make_model(
        "llama",
        tmp_path_factory.mktemp("big") / "llama",
        vocab_size=8192,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=2,
    )
    hf = AutoModelForCausalLM.from_pretrained(folder).eval()
    config = arch_config(hf)
    return build_decoder(config, canonical_weights(hf, config))


def _rss_over_baseline(root: Path, roles: str, prepack: bool) -> tuple[int, int]:
    result = measure(root, roles, prepack, threads=1)
    return result["bytes"], len(result["sessions"])


def test_early_exit_artifact_memory_with_prepacking(big_decoder, tmp_path):
    """Default mode (ORT pre-packing on): plain decoding holds the weights once, packed (a session reads the
    tensors only it uses from weights.bin and frees them once packed; given as ``OrtValue``s they stayed beside
    their packed copy, 2x); an early-exit artifact decodes through prefix + suffix + head, each weight packed
    once (``split_memory_bounds``)."""
    root = make_artifact(big_decoder, {"exit": DraftPlan.of(name="exit", exit_layer=4)}, tmp_path / "artifact")
    plain, sessions = _rss_over_baseline(root, "verify", prepack=True)
    speculative, spec_sessions = _rss_over_baseline(root, "all", prepack=True)
    assert sessions == 1 and spec_sessions == 3, "prefix, suffix and head only: no separate verify session"
    split_memory_bounds(root, plain, speculative)


def test_sessions_share_weights_in_memory(big_decoder, tmp_path):
    """Low-memory mode (pre-packing off): five sessions (verify, a layer-skip draft, prefix, suffix,
    head) on one copy of the weights."""
    plan_map = {
        "skip": DraftPlan.of(name="skip", skip_attn=[2, 5], skip_mlp=[3]),
        "exit": DraftPlan.of(name="exit", exit_layer=4),
    }
    root = make_artifact(big_decoder, plan_map, tmp_path / "artifact")
    weights = (root / "onnx" / "weights.bin").stat().st_size
    alone, sessions = _rss_over_baseline(root, "verify", prepack=False)
    shared, all_sessions = _rss_over_baseline(root, "all", prepack=False)
    assert all_sessions == 5 and sessions == 1
    print(
        f"\nweights {weights / 2**20:.1f} MiB; RSS over baseline: verify alone {alone / 2**20:.1f} MiB, "
        f"verify + skip + prefix + suffix + head {shared / 2**20:.1f} MiB ({shared / alone:.3f}x)"
    )
    assert alone >= 0.9 * weights, "the weights do not dominate the measurement"
    assert shared <= 1.1 * alone, f"5 sessions use {shared / alone:.2f}x the RSS of the verify session alone"


# -- torch-free runtime -----------------------------------------------------------------------------
def test_runtime_runs_onnx_artifact_without_torch(onnx_artifact):
    decoder, root, plan_map, _ = onnx_artifact("gpt2")
    prompt = [5, 17, 33, 8, 90]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    results = {}
    for plan_name in ("exit-k3", "skip-k3"):
        out = subprocess.run(
            [sys.executable, str(TESTS / "torch_blocker.py"), str(root), json.dumps(prompt), "20", plan_name],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
        )
        assert out.returncode == 0, out.stderr[-3000:]
        results[plan_name] = json.loads(out.stdout.strip().splitlines()[-1])
    expected, _ = run(TorchBackend(decoder), prompt, 20)
    for plan_name, got in results.items():
        assert got["torch_blocked"] and not got["torch_loaded"]
        assert got["plain"] == expected and got["spec"] == expected, plan_name
        assert got["spec_accepted"] > 0


# -- bad inputs -------------------------------------------------------------------------------------
@pytest.fixture
def broken(onnx_artifact, tmp_path):
    _, root, _, _ = onnx_artifact("llama")
    copy = tmp_path / "copy"
    shutil.copytree(root, copy)
    return copy


def _load(root: Path, mutate=None) -> OnnxBackend:
    manifest = read_manifest(root, verify_files=False)
    if mutate:
        mutate(manifest.backends["onnx"])
    return open_onnx(root, manifest, threads=1)


def _one_line(exc) -> str:
    message = str(exc.value)
    assert "\n" not in message and ("rebuild" in message or "re-export" in message)
    return message


def test_truncated_graph(broken):
    path = broken / "onnx" / "verify.onnx"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ArtifactError) as exc:
        _load(broken)
    assert "onnx/verify.onnx" in _one_line(exc)


def test_garbage_graph(broken):
    (broken / "onnx" / "head.onnx").write_bytes(b"\x00not an onnx model" * 10)
    with pytest.raises(ArtifactError) as exc:
        _load(broken)
    assert "onnx/head.onnx" in _one_line(exc)


def test_truncated_weights(broken):
    path = broken / "onnx" / "weights.bin"
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 1000)
    with pytest.raises(ArtifactError) as exc:
        _load(broken)
    assert "truncated" in _one_line(exc) and "weights.bin" in str(exc.value)


def test_missing_weights(broken):
    (broken / "onnx" / "weights.bin").unlink()
    with pytest.raises(ArtifactError) as exc:
        _load(broken)
    assert "missing" in _one_line(exc) and "weights.bin" in str(exc.value)


def test_manifest_inputs_not_matching_graph(broken):
    def rename(record):
        record["graphs"]["verify"]["inputs"][0]["name"] = "tokens"

    with pytest.raises(ArtifactError) as exc:
        _load(broken, rename)
    assert "does not match the manifest" in _one_line(exc)


def test_graph_swapped_for_another(broken):
    shutil.copy(broken / "onnx" / "head.onnx", broken / "onnx" / "verify.onnx")
    with pytest.raises(ArtifactError) as exc:
        _load(broken)
    assert "onnx/verify.onnx" in _one_line(exc)


def test_sha256_check_catches_edits_first(broken):
    path = broken / "onnx" / "weights.bin"
    data = bytearray(path.read_bytes())
    data[100] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="sha256"):
        read_manifest(broken)


def test_plan_changed_after_export(broken):
    manifest = read_manifest(broken, verify_files=False)
    manifest.plans["skip-k3"] = manifest.plans["skip-k3"].with_params(skip_attn=[0, 2])
    with pytest.raises(ArtifactError) as exc:
        open_onnx(broken, manifest, threads=1)
    assert "skip-k3" in _one_line(exc) and "re-export" in str(exc.value)
    manifest = read_manifest(broken, verify_files=False)
    manifest.plans["new"] = DraftPlan.of(name="new", exit_layer=1)
    with pytest.raises(ArtifactError, match="'new' .*the export has no graph for"):
        open_onnx(broken, manifest, threads=1)
