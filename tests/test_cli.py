"""The command line end to end on tiny models, and every bad input: one line, non-zero exit, nothing written."""

import json
import shutil
import subprocess
import sys

import pytest
from cli_helpers import assert_one_line_error, invoke
from tiny_models import make_tokenizer


def leftovers(folder):
    return sorted(p.name for p in folder.iterdir() if ".tmp-" in p.name or ".old-" in p.name)


@pytest.fixture
def artifact_copy(tiny_artifact, tmp_path):
    target = tmp_path / "artifact"
    shutil.copytree(tiny_artifact, target)
    return target


def test_build_generate_inspect_bench_end_to_end(tiny_model_dir, tmp_path):
    out = tmp_path / "gpt2-exit"
    result = invoke(
        "build",
        tiny_model_dir("gpt2"),
        "-o",
        out,
        "--method",
        "early-exit",
        "--max-draft",
        "3",
        "--calibration-tokens",
        "12",
        "--quiet",
    )
    assert result.exit_code == 0, result.output
    assert "plan 'early-exit'" in result.stdout
    manifest = json.loads((out / "manifest.json").read_text())
    plan = manifest["plans"]["early-exit"]
    assert plan["kind"] == "early_exit" and plan["params"]["exit_layer"] >= 1 and "expected_speedup" in plan["measured"]
    assert "confirmed_speedup" in plan["measured"] and manifest["source"]["architecture"] == "GPT2LMHeadModel"
    assert leftovers(tmp_path) == []

    spec = json.loads(
        invoke(
            "generate", out, "--prompt", "def add(a, b):", "--max-new-tokens", "24", "--json", "--plan", "early-exit"
        ).stdout
    )
    plain = json.loads(
        invoke(
            "generate", out, "--prompt", "def add(a, b):", "--max-new-tokens", "24", "--json", "--no-speculate"
        ).stdout
    )
    for key in ("text", "token_ids", "tokens_per_s", "rounds", "mean_accepted"):
        assert key in spec and key in plain
    assert spec["token_ids"] == plain["token_ids"] and len(spec["token_ids"]) == 24
    assert plain["mean_accepted"] is None and plain["rounds"] is None
    assert spec["rounds"] >= 1 and spec["mean_accepted"] >= 1.0

    streamed = invoke("generate", out, "--prompt", "def add(a, b):", "--max-new-tokens", "24", "--plan", "early-exit")
    assert streamed.exit_code == 0 and streamed.stdout.rstrip("\n") == spec["text"]

    inspected = invoke("inspect", out)
    assert inspected.exit_code == 0 and "early exit after block" in inspected.stdout

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ["def f(x):", "class A:", "for i in"]))
    bench = invoke(
        "bench", out, "--prompts", prompts, "--max-new-tokens", "12", "--json", "--quiet", "--plan", "early-exit"
    )
    assert bench.exit_code == 0, bench.output
    report = json.loads(bench.stdout)
    for key in ("autoregressive", "speculative", "transformers", "transformers_prompt_lookup", "speedup", "identical"):
        assert key in report
    assert report["identical"] is True and report["transformers"]["tokens_per_s"] > 0
    assert report["transformers_prompt_lookup"]["tokens_per_s"] > 0
    # transformers' own early exit runs at the artifact's exit layer, or says why it could not (it fails on GPT-2)
    assert "transformers_early_exit" in report or "transformers_early_exit_skipped" in report
    assert report["speculative"]["mean_accepted"] >= 1.0
    assert set(report["speculative"]["sources"]) == {"model"} and "model" in report["speculative"]["round_mix"]


def test_output_folder_exists_without_force(tiny_model_dir, tmp_path):
    out = tmp_path / "exists"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    result = invoke("build", tiny_model_dir("llama"), "-o", out)
    assert_one_line_error(result, "already exists", "--force")
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


def test_unknown_model_id_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    result = invoke("build", "no-such-org/no-such-model-xyz", "-o", tmp_path / "out")
    assert_one_line_error(result, "no-such-org/no-such-model-xyz", "HF_HUB_OFFLINE", "local folder")
    assert list(tmp_path.iterdir()) == []


def test_missing_local_folder(tmp_path):
    result = invoke("build", "./does/not/exist", "-o", tmp_path / "out")
    assert_one_line_error(result, "does not exist")


def test_unsupported_architecture(tmp_path):
    """Models that cannot be drafted losslessly are refused with the reason: an encoder-decoder (from its
    config, before the weights are read) and a state-space model (its recurrent state cannot be cut back)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, T5Config

    t5 = tmp_path / "t5"
    t5.mkdir()
    T5Config(vocab_size=320, d_model=32, num_layers=1, num_heads=2, d_ff=64).save_pretrained(t5)
    make_tokenizer(t5)
    assert_one_line_error(invoke("build", t5, "-o", tmp_path / "out"), "'t5' is an encoder-decoder model")

    mamba = tmp_path / "mamba"
    config = AutoConfig.for_model("mamba", vocab_size=320, hidden_size=32, num_hidden_layers=2, state_size=4)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(mamba)
    make_tokenizer(mamba)
    assert_one_line_error(
        invoke("build", mamba, "-o", tmp_path / "out"),
        "'mamba' has recurrent or state-space layers",
        "cannot be drafted losslessly",
    )
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_remote_code_model_needs_the_flag(tmp_path):
    """A model whose code lives in its folder (auto_map) is refused without --trust-remote-code, before
    any of its code runs."""
    import json

    folder = tmp_path / "custom"
    folder.mkdir()
    (folder / "config.json").write_text(
        json.dumps(
            {
                "model_type": "speccompile_custom",
                "architectures": ["CustomForCausalLM"],
                "auto_map": {
                    "AutoConfig": "configuration_custom.CustomConfig",
                    "AutoModelForCausalLM": "modeling_custom.CustomForCausalLM",
                },
            }
        )
    )
    (folder / "configuration_custom.py").write_text("raise SystemExit('remote code ran')\n")
    make_tokenizer(folder)
    assert_one_line_error(invoke("build", folder, "-o", tmp_path / "out"), "--trust-remote-code")
    assert not (tmp_path / "out").exists()


def test_artifact_missing_file(artifact_copy):
    (artifact_copy / "tokenizer" / "tokenizer.json").unlink()
    assert_one_line_error(invoke("generate", artifact_copy, "--prompt", "hi"), "tokenizer/tokenizer.json", "missing")


def test_artifact_hash_mismatch(artifact_copy):
    weights = artifact_copy / "weights" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # same size, different content
    weights.write_bytes(bytes(data))
    assert_one_line_error(invoke("generate", artifact_copy, "--prompt", "hi"), "sha256")


def test_artifact_unknown_schema(artifact_copy):
    path = artifact_copy / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["schema_version"] = 99
    path.write_text(json.dumps(manifest))
    assert_one_line_error(invoke("inspect", artifact_copy), "schema version 99")


def test_not_an_artifact(tmp_path):
    assert_one_line_error(invoke("generate", tmp_path, "--prompt", "hi"), "manifest.json")


def test_empty_prompt(tiny_artifact):
    assert_one_line_error(invoke("generate", tiny_artifact, "--prompt", ""), "empty")
    assert_one_line_error(invoke("generate", tiny_artifact, "--prompt", "   \n"), "empty")


def test_prompt_longer_than_context(tiny_artifact):
    long_prompt = "def add(a, b):\n    return a + b\n" * 80
    assert_one_line_error(invoke("generate", tiny_artifact, "--prompt", long_prompt), "context is 256")


def test_generation_stops_at_context(tiny_artifact):
    from speccompile.runtime import load

    model = load(tiny_artifact)
    prompt = model.tokenizer.encode("def add(a, b):\n    return a + b\n" * 40)[:250]
    result = model.generate(prompt, max_new_tokens=50)
    # Positions 0..255 are fed to the model; the token predicted at position 255 is output, never fed.
    assert result.stats.stop_reason == "context" and len(prompt) + len(result.token_ids) == 256 + 1
    assert result.token_ids == model.generate(prompt, max_new_tokens=50, speculate=False).token_ids


def test_runtime_imports_neither_torch_nor_transformers():
    code = (
        "import sys, speccompile.runtime; "
        "bad = [m for m in ('torch', 'transformers') if m in sys.modules]; assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_auto_method_keeps_the_fastest_plan_or_plain(tiny_model_dir, tmp_path):
    """auto runs lookup, then each model-draft pass whose bound can beat the best plan so far (the others are
    recorded as skipped, with why), keeps the fastest confirmed plan, and makes it the default only if it beat
    plain decoding in its own confirmation."""
    out = tmp_path / "auto"
    result = invoke(
        "build", tiny_model_dir("qwen2"), "-o", out, "--max-draft", "3", "--calibration-tokens", "12", "--quiet"
    )
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["tuning"]["method"] == "auto"
    rows = {row["pass"]: row for row in manifest["tuning"]["passes"]}
    assert {"lookup_autotune", "exit_autotune", "cosine_autotune", "confirm_plans"} <= set(rows)
    for name in ("exit_autotune", "cosine_autotune"):  # each model-draft pass ran or says why not
        assert rows[name].get("added") or rows[name].get("skipped"), rows[name]
    ((name, plan),) = manifest["plans"].items()
    others = plan["measured"].get("chosen_over", {})
    assert "lookup" in {name, *others}
    confirmed = [speedup for speedup in others.values() if speedup is not None]
    assert all(plan["measured"]["confirmed_speedup"] >= speedup for speedup in confirmed)
    pays = plan["measured"]["confirmed_speedup"] > 1.0
    assert manifest["default_plan"] == (name if pays else None)
    generated = invoke("generate", out, "--prompt", "def add(a, b):", "--max-new-tokens", "8")
    assert (
        generated.exit_code == 0 and ("[plain decoding: no draft plan beat plain decoding" in generated.stderr) != pays
    )
