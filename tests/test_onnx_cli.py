"""The ONNX backend through the user's entry points: build --backend, generate without torch, tune, bench."""

import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

from speccompile.cli import main

BLOCKED_GENERATE = """
import sys

class BlockTorch:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "transformers"):
            raise ImportError(f"{name} is blocked in this process")

sys.meta_path.insert(0, BlockTorch())
from speccompile.cli import main
main(sys.argv[1:])
"""
SMALL = ["--calibration-tokens", "12", "--max-draft", "3", "--quiet"]


def invoke(*args):
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    return result


@pytest.fixture(scope="module")
def both_backends(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("onnx_cli") / "gpt2"
    invoke("build", tiny_model_dir("gpt2"), "-o", out, "--backend", "torch,onnx", "--method", "early-exit", *SMALL)
    return out


def test_generate_without_torch_matches_torch_backend(both_backends):
    manifest = json.loads((both_backends / "manifest.json").read_text())
    assert set(manifest["backends"]) == {"torch", "onnx"}
    assert manifest["plans"], "the early-exit build wrote no plan"
    plan = manifest["default_plan"] or next(iter(manifest["plans"]))  # a tiny model's timing may not pick a default
    args = ["generate", str(both_backends), "--prompt", "def add(a, b):", "--max-new-tokens", "24", "--json"]
    blocked = subprocess.run(
        [sys.executable, "-c", BLOCKED_GENERATE, *args, "--backend", "onnx", "--plan", plan],
        capture_output=True,
        text=True,
        env={"OMP_NUM_THREADS": "1", "PATH": ""},
    )
    assert blocked.returncode == 0, blocked.stderr
    onnx_spec = json.loads(blocked.stdout)
    torch_plain = json.loads(invoke(*args, "--backend", "torch", "--no-speculate").stdout)
    assert onnx_spec["token_ids"] == torch_plain["token_ids"] and onnx_spec["rounds"] >= 1


def test_onnx_only_artifact_tunes_and_generates(tiny_model_dir, tmp_path):
    out = tmp_path / "llama-onnx"
    invoke("build", tiny_model_dir("llama"), "-o", out, "--backend", "onnx", "--method", "cosine", *SMALL)
    assert not (out / "weights").exists() and (out / "onnx" / "weights.bin").is_file()
    invoke("tune", out, "--method", "early-exit", *SMALL)  # reads the ONNX weights, re-exports the graphs
    manifest = json.loads((out / "manifest.json").read_text())
    assert {"layer-skip", "early-exit"} <= set(manifest["plans"]) and list(manifest["backends"]) == ["onnx"]
    for plan in ("layer-skip", "early-exit"):
        spec = json.loads(
            invoke("generate", out, "--prompt", "class A:", "--max-new-tokens", "16", "--json", "--plan", plan).stdout
        )
        plain = json.loads(
            invoke("generate", out, "--prompt", "class A:", "--max-new-tokens", "16", "--json", "--no-speculate").stdout
        )
        assert spec["token_ids"] == plain["token_ids"]


def test_bench_onnx_has_ort_and_optimum_baselines(tiny_model_dir, tmp_path):
    out = tmp_path / "llama-both"
    invoke("build", tiny_model_dir("llama"), "-o", out, "--backend", "torch,onnx", *SMALL)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def f(x):\n\nclass A:\n\nimport os")
    report = json.loads(
        invoke(
            "bench", out, "--backend", "onnx", "--prompts", prompts, "--max-new-tokens", "10", "--json", "--quiet"
        ).stdout
    )
    assert report["backend"] == "onnx" and report["prompts"] == 3
    for key in ("autoregressive", "speculative", "transformers", "optimum"):
        assert report[key]["tokens_per_s"] > 0, key
    assert report["identical"] is True
    assert report["identical_detail"]["optimum_vs_autoregressive"] == "3/3"
    assert report["divergences"] == [] and report["near_tie_divergences"] == report["real_divergences"] == 0


def test_bench_tells_near_ties_from_real_divergences(both_backends):
    """bench classifies a speculative output that leaves plain output by the backend's own top-2 logit gap at the
    first differing token: a wrong token where the model is decided is reported as real, with its gap."""
    from types import SimpleNamespace

    from speccompile.bench import NEAR_TIE, _divergences, format_report
    from speccompile.runtime import load

    model = load(both_backends, backend="onnx")
    prompt = model.encode_prompt("def add(a, b):")
    plain = model.generate(prompt, max_new_tokens=12, speculate=False).token_ids
    logits = model.backend.forward(prompt + plain[:5], 0)[-1]
    top = sorted(logits)[-2:]
    wrong = plain[:5] + [int(sorted(range(len(logits)), key=lambda t: logits[t])[-2])] + plain[6:]
    found = _divergences(
        model.backend,
        [prompt, prompt],
        [SimpleNamespace(token_ids=plain)] * 2,
        [SimpleNamespace(token_ids=plain), SimpleNamespace(token_ids=wrong)],
    )
    assert [(d["prompt"], d["token"]) for d in found] == [(1, 5)]
    assert abs(found[0]["top2_gap"] - (top[1] - top[0])) < 1e-5 and top[1] - top[0] > NEAR_TIE
    assert not found[0]["near_tie"]
    report = {
        "plan": None,
        "prompts": 2,
        "prompt_source": "test",
        "max_new_tokens": 12,
        "backend": "onnx",
        "autoregressive": {"tokens_per_s": 1.0},
        "speculative": {"tokens_per_s": 1.0, "mean_accepted": 1.0, "acceptance_rate": 0.0, "rounds": 1},
        "speedup": {},
        "identical": False,
        "identical_detail": {"speculative_vs_autoregressive": "1/2"},
        "divergences": found,
    }
    text = format_report(report)
    assert "0 near-tie divergence(s)" in text and "1 real" in text and "prompt 1 token 5" in text
