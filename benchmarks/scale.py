"""Builds at the sizes users start with: random-weight models of real shapes, built with the defaults and benched.

    python benchmarks/scale.py                                   # Qwen3-0.6B's shape, ONNX Runtime then torch
    python benchmarks/scale.py --shape llama-3.2-1b --backends onnx
    python benchmarks/scale.py --shape qwen3-0.6b --max-new-tokens 32 --prompts 3

No hub: each shape's config is written here (the published model's sizes: layers, hidden and MLP width, heads,
vocabulary, rotary settings, tied embeddings), its weights are random (transformers' own initialisation, seed 0)
and its tokenizer is a byte-level BPE trained on the benchmark's own text, so the model folder is made offline,
once, under ``--out-dir``. Random weights cannot judge acceptance (what drafts pay on a trained model), only
what the sizes do: build time, memory, artifact size, plain and speculative speed, and lossless output.

For each backend, ``speccompile build MODEL --backend B`` runs with its defaults (``--method auto``, its time
budget) in a child process, whose wall time and peak resident memory (``getrusage``'s ``ru_maxrss``, what
``/usr/bin/time -v`` prints) are measured from here; then ``speccompile bench ART --no-transformers`` decodes the
first ``--prompts`` benchmark prompts plainly and speculatively. One row per backend:

    | shape | backend | build | peak memory | x fp32 weights | artifact | plan | plain tok/s | spec tok/s | identical |

Measure under the machine's exclusive lock when others share it (``flock -x /tmp/timing.lock python ...``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
PROMPTS = HERE / "data" / "smollm2_prompts.jsonl"
CALIBRATION = HERE / "data" / "smollm2_calibration.jsonl"

SHAPES: dict[str, dict] = {
    # Qwen/Qwen3-0.6B's config.json: 28 blocks, 1024 hidden, 16 query / 8 KV heads of 128, 3072 MLP, 151936 vocab
    "qwen3-0.6b": dict(
        model_type="qwen3",
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    ),
    # meta-llama/Llama-3.2-1B's config.json: 16 blocks, 2048 hidden, 32 query / 8 KV heads of 64, 8192 MLP, 128256
    # vocab, llama3 rope scaling
    "llama-3.2-1b": dict(
        model_type="llama",
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ),
}
TOKENIZER_VOCAB = 8192


def texts() -> list[str]:
    return [json.loads(line).get("prompt") or json.loads(line).get("text") for line in open(PROMPTS)] + [
        json.loads(line).get("prompt") or json.loads(line).get("text") for line in open(CALIBRATION)
    ]


def make_model(shape: str, folder: Path) -> None:
    """The random-weight model of ``shape`` and a BPE tokenizer, saved with save_pretrained (in this process:
    run it as a child, so that its memory is not the build's)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    values = dict(SHAPES[shape])
    config = AutoConfig.for_model(values.pop("model_type"), bos_token_id=1, eos_token_id=2, pad_token_id=0, **values)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts() * 4, trainer)
    tmp = folder.with_name(folder.name + ".tmp")
    model.save_pretrained(tmp, safe_serialization=True)
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>").save_pretrained(
        tmp
    )
    tmp.rename(folder)


def run_measured(command: list[str]) -> tuple[subprocess.CompletedProcess, float, int]:
    """Run ``command``; return it, its wall seconds and its peak resident bytes (the child's own ``ru_maxrss``,
    from ``os.wait4``: output goes to files, so nothing else waits for the child)."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        start = time.perf_counter()
        child = subprocess.Popen(command, stdout=out, stderr=err, text=True)
        _, status, usage = os.wait4(child.pid, 0)
        seconds = time.perf_counter() - start
        child.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        done = subprocess.CompletedProcess(command, child.returncode, out.read(), err.read())
    return done, seconds, usage.ru_maxrss * 1024


def speccompile(*args) -> list[str]:
    return [sys.executable, "-m", "speccompile.cli", *map(str, args)]


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3-0.6b", choices=sorted(SHAPES))
    parser.add_argument("--backends", default="onnx,torch")
    parser.add_argument("--out-dir", type=Path, default=REPO / "artifacts" / "scale")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--prompts", type=int, default=4, help="benchmark prompts to decode (of 12)")
    parser.add_argument("--make", type=Path, default=None, help=argparse.SUPPRESS)  # the child that makes a model
    args = parser.parse_args()
    if args.make is not None:
        make_model(args.shape, args.make)
        return

    model = args.out_dir / f"{args.shape}-random"
    if not (model / "config.json").is_file():
        print(f"making {model} (random weights) ...", file=sys.stderr, flush=True)
        args.out_dir.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, __file__, "--shape", args.shape, "--make", str(model)], check=True)
    weights = sum(p.stat().st_size for p in model.glob("*.safetensors"))
    prompts = Path(tempfile.mkstemp(suffix=".jsonl")[1])
    prompts.write_text("".join(open(PROMPTS).readlines()[: args.prompts]))

    rows = []
    for backend in args.backends.split(","):
        out = args.out_dir / f"{args.shape}-{backend}"
        print(f"$ speccompile build {model} -o {out} --backend {backend}", file=sys.stderr, flush=True)
        build, seconds, peak = run_measured(
            speccompile(
                "build", model, "-o", out, "--backend", backend, "--calibration", CALIBRATION, "--force", "--quiet"
            )
        )
        if build.returncode != 0:
            sys.exit(f"build failed (exit {build.returncode}):\n{build.stderr[-3000:]}")
        print(build.stderr.strip().splitlines()[-1], file=sys.stderr)
        bench = subprocess.run(
            speccompile(
                "bench",
                out,
                "--backend",
                backend,
                "--prompts",
                prompts,
                "--max-new-tokens",
                args.max_new_tokens,
                "--no-transformers",
                "--json",
                "--quiet",
            ),
            capture_output=True,
            text=True,
        )
        if bench.returncode != 0:
            sys.exit(f"bench failed (exit {bench.returncode}):\n{bench.stderr[-3000:]}")
        report = json.loads(bench.stdout)
        manifest = json.loads((out / "manifest.json").read_text())
        rows.append(
            {
                "shape": args.shape,
                "backend": backend,
                "build_seconds": round(seconds, 1),
                "budget": manifest["tuning"].get("budget"),
                "peak_bytes": peak,
                "fp32_weights_bytes": weights,
                "artifact_bytes": folder_bytes(out),
                "plan": manifest.get("default_plan"),
                "plain_tokens_per_s": report["autoregressive"]["tokens_per_s"],
                "speculative_tokens_per_s": report["speculative"]["tokens_per_s"],
                "identical": report["identical_detail"]["speculative_vs_autoregressive"],
            }
        )
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    prompts.unlink()
    print(
        "\n| shape | backend | build | peak memory | x fp32 weights | artifact | default plan | plain tok/s | "
        "speculative tok/s | identical to plain |\n|---|---|---|---|---|---|---|---|---|---|"
    )
    for r in rows:
        print(
            f"| {r['shape']} | {r['backend']} | {r['build_seconds']:.0f} s | {r['peak_bytes'] / 2**30:.2f} GiB | "
            f"{r['peak_bytes'] / r['fp32_weights_bytes']:.2f}x | {r['artifact_bytes'] / 2**30:.2f} GiB | {r['plan']} | "
            f"{r['plain_tokens_per_s']:.2f} | {r['speculative_tokens_per_s']:.2f} | {r['identical']} |"
        )


if __name__ == "__main__":
    main()
