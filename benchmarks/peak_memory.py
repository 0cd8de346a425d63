"""Peak resident memory of decoding with an artifact: plain against speculative with its default plan, each in a
fresh process (the memory figure: what a draft costs in memory, not only on disk).

    python benchmarks/peak_memory.py ART [--backend torch|onnx] [--prompt TEXT] [--max-new-tokens 64]
                                     [--cpu-linear standard,auto]

Each row loads the artifact in a new interpreter, decodes the prompt once (plain, or speculatively with the
default plan) and reports the process's peak resident set (``VmHWM``), the resident set after loading, and the
tokens it produced. On torch, ``--cpu-linear`` repeats the rows per ``SPECCOMPILE_CPU_LINEAR`` value (``auto``
keeps MKL-packed copies of the products' weights when they win the load-time timing; ``standard`` never does,
``runtime/backends/torch/cpu_linear.py``). Also prints the bytes of the artifact's files and, for ONNX Runtime, the bytes of
weights.bin only precision self-drafts read.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

_CHILD = r"""
import json, sys
def status(key):
    for line in open('/proc/self/status'):
        if line.startswith(key + ':'):
            return int(line.split()[1]) * 1024
from speccompile.runtime import load
root, backend, prompt, tokens, speculate = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5] == '1'
model = load(root, backend=backend)
loaded = status('VmRSS')
result = model.generate(prompt, max_new_tokens=tokens, speculate=speculate)
print(json.dumps({'peak': status('VmHWM'), 'loaded': loaded, 'tokens': result.token_ids,
                  'plan': model.manifest.default_plan if speculate else None}))
"""


def measure(artifact: Path, backend: str, prompt: str, tokens: int, speculate: bool, cpu_linear: str | None) -> dict:
    env = dict(os.environ)
    if cpu_linear:
        env["SPECCOMPILE_CPU_LINEAR"] = cpu_linear
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(artifact), backend, prompt, str(tokens), "1" if speculate else "0"],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--backend", default=None, help="torch or onnx (default: the artifact's first backend)")
    parser.add_argument("--prompt", default="Write a Python function that checks whether a string is a palindrome.")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--cpu-linear", default="standard,auto", help="torch: SPECCOMPILE_CPU_LINEAR values to compare")
    args = parser.parse_args()

    manifest = json.loads((args.artifact / "manifest.json").read_text())
    backend = args.backend or next(iter(manifest["backends"]))
    files = sum(entry.get("bytes", 0) for entry in manifest.get("files", {}).values())
    line = f"{args.artifact.name} ({backend}): artifact files {files / 2**20:.0f} MB"
    if backend == "onnx":
        line += f", of which {manifest['backends']['onnx'].get('precision_draft_bytes', 0) / 2**20:.0f} MB only precision drafts read"
    print(line + f"; default plan {manifest.get('default_plan')!r}")
    forms = args.cpu_linear.split(",") if backend == "torch" else [None]
    print("| decoding | SPECCOMPILE_CPU_LINEAR | peak resident | resident after load | tokens |\n|---|---|---|---|---|")
    plain_tokens = None
    for form in forms:
        for speculate in (False, True):
            row = measure(args.artifact, backend, args.prompt, args.max_new_tokens, speculate, form)
            plain_tokens = row["tokens"] if plain_tokens is None else plain_tokens
            same = "" if not speculate else (" (= plain)" if row["tokens"] == plain_tokens else " (differs from plain)")
            print(
                f"| {'speculative, ' + str(row['plan']) if speculate else 'plain'} | {form or '-'} | "
                f"{row['peak'] / 2**20:.0f} MB | {row['loaded'] / 2**20:.0f} MB | {len(row['tokens'])}{same} |"
            )


if __name__ == "__main__":
    main()
