"""GGUF input: a tiny GGUF written here with the gguf package (no download) loads with the original's logits,
builds and generates through the CLI, and every bad input is a one-line error."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from cli_helpers import assert_one_line_error as one_line_error
from cli_helpers import invoke

gguf = pytest.importorskip("gguf")

from speccompile.gguf_input import cache_root  # noqa: E402
from speccompile.loading import load_source  # noqa: E402

PROMPT = "def add(a, b):\n    return"


def llama_cpp_permute(weight: np.ndarray, n_head: int) -> np.ndarray:
    """The q/k row order llama.cpp's converter writes (rotary halves interleaved); transformers undoes it."""
    return (
        weight.reshape(n_head, 2, weight.shape[0] // n_head // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def write_tokenizer(writer, hf_folder: Path) -> None:
    """The tiny model's byte-level BPE as a GGUF "gpt2" tokenizer: tokens, types, merges, bos/eos."""
    spec = json.loads((hf_folder / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    special = {added["content"] for added in spec["added_tokens"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)


def write_llama_gguf(hf_folder: Path, out: Path) -> Path:
    """A float32 llama GGUF holding exactly the weights of the transformers model in ``hf_folder``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_folder)
    config, weights = model.config, {k: v.detach().numpy() for k, v in model.state_dict().items()}
    writer = gguf.GGUFWriter(out, "llama")
    writer.add_name("tiny llama")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    write_tokenizer(writer, hf_folder)
    writer.add_tensor("token_embd.weight", weights["model.embed_tokens.weight"])
    for i in range(config.num_hidden_layers):
        layer = lambda name: weights[f"model.layers.{i}.{name}.weight"]  # noqa: E731
        writer.add_tensor(f"blk.{i}.attn_norm.weight", layer("input_layernorm"))
        writer.add_tensor(
            f"blk.{i}.attn_q.weight", llama_cpp_permute(layer("self_attn.q_proj"), config.num_attention_heads)
        )
        writer.add_tensor(
            f"blk.{i}.attn_k.weight", llama_cpp_permute(layer("self_attn.k_proj"), config.num_key_value_heads)
        )
        writer.add_tensor(f"blk.{i}.attn_v.weight", layer("self_attn.v_proj"))
        writer.add_tensor(f"blk.{i}.attn_output.weight", layer("self_attn.o_proj"))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", layer("post_attention_layernorm"))
        writer.add_tensor(f"blk.{i}.ffn_gate.weight", layer("mlp.gate_proj"))
        writer.add_tensor(f"blk.{i}.ffn_up.weight", layer("mlp.up_proj"))
        writer.add_tensor(f"blk.{i}.ffn_down.weight", layer("mlp.down_proj"))
    writer.add_tensor("output_norm.weight", weights["model.norm.weight"])
    writer.add_tensor("output.weight", weights["lm_head.weight"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def write_header_only_gguf(out: Path, architecture: str) -> Path:
    """A GGUF with an architecture and a few hyperparameters but no tensors (for the refusals)."""
    writer = gguf.GGUFWriter(out, architecture)
    writer.add_block_count(2)
    writer.add_context_length(64)
    writer.add_embedding_length(16)
    writer.add_head_count(2)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def tiny_gguf(tiny_model_dir, tmp_path_factory):
    return write_llama_gguf(tiny_model_dir("llama"), tmp_path_factory.mktemp("gguf") / "tiny-llama.f32.gguf")


def assert_one_line_error(result, *needles):
    one_line_error(result, *needles, exit_code=1)


def test_gguf_loads_with_the_original_logits_and_tokenizer(tiny_model_dir, tiny_gguf, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    original_dir = tiny_model_dir("llama")
    original = AutoModelForCausalLM.from_pretrained(original_dir, attn_implementation="eager").eval()
    original_tokenizer = AutoTokenizer.from_pretrained(original_dir)
    source = load_source(str(tiny_gguf))

    sha = hashlib.sha256(tiny_gguf.read_bytes()).hexdigest()
    assert source.name == str(tiny_gguf) and source.revision == sha
    assert source.path.parent == cache_root() and cache_root().is_relative_to(tmp_path)
    assert source.path.name.startswith(sha[:16]) and (source.path / "config.json").is_file()
    assert list(source.path.glob("*.safetensors")) and not list(source.path.parent.glob("*.tmp-*"))

    ids = original_tokenizer(PROMPT).input_ids
    assert source.tokenizer(PROMPT).input_ids == ids  # no bos prepended: add_bos_token is false in the file
    assert (source.tokenizer.bos_token_id, source.tokenizer.eos_token_id) == (1, 2)
    with torch.no_grad():
        expected = original(torch.tensor([ids])).logits
        got = source.model(torch.tensor([ids])).logits
    assert torch.allclose(got, expected, atol=1e-5, rtol=0), (got - expected).abs().max()

    stamp = (source.path / "config.json").stat().st_mtime_ns
    again = load_source(str(tiny_gguf))
    assert again.path == source.path and (again.path / "config.json").stat().st_mtime_ns == stamp


def test_cli_builds_and_generates_from_a_gguf_file(tiny_model_dir, tiny_gguf, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "art"
    result = invoke(
        "build", tiny_gguf, "-o", out, "--method", "cosine", "--max-draft", "2", "--calibration-tokens", "8", "--quiet"
    )
    assert result.exit_code == 0, result.output
    source = json.loads((out / "manifest.json").read_text())["source"]
    assert (
        source["model"] == str(tiny_gguf) and source["revision"] == hashlib.sha256(tiny_gguf.read_bytes()).hexdigest()
    )
    assert (Path(source["path"]) / "config.json").is_file()

    generated = invoke("generate", out, "--prompt", PROMPT, "--max-new-tokens", "12", "--json")
    assert generated.exit_code == 0, generated.output
    tokens = json.loads(generated.stdout)["token_ids"]
    original = AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama"), attn_implementation="eager").eval()
    ids = AutoTokenizer.from_pretrained(tiny_model_dir("llama"))(PROMPT, return_tensors="pt").input_ids
    reference = original.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert tokens == reference[0, ids.shape[1] :].tolist()[: len(tokens)] and tokens


@pytest.mark.parametrize("package", ["gguf", "accelerate"])
def test_missing_package_is_a_one_line_error_naming_the_install(package, tiny_gguf, tmp_path):
    code = (
        f"import sys; sys.modules[{package!r}] = None  # what importing it does when it is not installed\n"
        "from speccompile.cli import main\n"
        f"main(['build', {str(tiny_gguf)!r}, '-o', {str(tmp_path / 'art')!r}])"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 1 and len(lines) == 1, run.stderr
    assert lines[0].startswith("error: ") and f"'{package}'" in lines[0] and "pip install gguf accelerate" in lines[0]
    assert not (tmp_path / "art").exists()


def test_bad_gguf_files_are_one_line_errors(tiny_gguf, tmp_path):
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(tiny_gguf.read_bytes()[: tiny_gguf.stat().st_size // 2])
    text = tmp_path / "x.gguf"
    text.write_text("not a model\n")
    folder = tmp_path / "folder.gguf"
    folder.mkdir()
    cases = [
        (truncated, "truncated or corrupt"),
        (text, "not a GGUF file"),
        (tmp_path / "missing.gguf", "does not exist"),
        (folder, "not a file"),
    ]
    for path, needle in cases:
        assert_one_line_error(invoke("build", path, "-o", tmp_path / "art"), needle)
    assert not (tmp_path / "art").exists()
    assert not cache_root().exists() or not list(cache_root().iterdir())


def test_architectures_are_refused_before_weights_are_read(tmp_path):
    unknown = write_header_only_gguf(tmp_path / "unknown.gguf", "bogusarch")
    assert_one_line_error(invoke("build", unknown, "-o", tmp_path / "a"), "cannot load GGUF architecture 'bogusarch'")
    # transformers reads bloom GGUF files, the converter has no bloom layout: refused from the header alone
    # (this file has no tensors, so getting as far as loading weights would fail differently).
    bloom = write_header_only_gguf(tmp_path / "bloom.gguf", "bloom")
    assert_one_line_error(invoke("build", bloom, "-o", tmp_path / "b"), "architecture 'bloom' is not supported")
