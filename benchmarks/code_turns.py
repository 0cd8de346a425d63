"""Two versions of the runtime on the same artifacts, timed in turns: did a change keep outputs and speed?

    python benchmarks/code_turns.py --python OLD_VENV/bin/python --python NEW_VENV/bin/python \\
        --artifact ART_TORCH:torch --artifact ART_ONNX:onnx --prompts benchmarks/data/smollm2_prompts.jsonl \\
        [--turns 3] [--max-new-tokens 96] [--json OUT.json]

Each ``--python`` is an interpreter with one version of speccompile installed (a venv per checkout). For
every turn and artifact, each version in turn loads the artifact in a fresh process and decodes every prompt
plainly and speculatively (greedy, the default plan); the table gives each version's tokens/s summed over
the turns, the speculative / plain ratio, and whether the token ids are the same across versions and equal
plain. Versions alternate inside a turn, so a machine that slows down slows both.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

WORKER = r"""
import json, sys, time
from speccompile.runtime import load
artifact, backend, prompts_file, new = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
prompts = [json.loads(l) for l in open(prompts_file) if l.strip()]
prompts = [p.get("prompt") or p.get("text") for p in prompts]
model = load(artifact, backend=backend)
out = {"plain": [], "spec": [], "plain_s": 0.0, "spec_s": 0.0, "rounds": 0}
model.generate(prompts[0], max_new_tokens=8, speculate=True)  # warm-up: sessions, kernels, first-use costs
for text in prompts:
    for mode in ("plain", "spec"):
        start = time.perf_counter()
        result = model.generate(text, max_new_tokens=new, speculate=mode == "spec")
        out[mode + "_s"] += time.perf_counter() - start
        out[mode].append(result.token_ids)
        if mode == "spec":
            out["rounds"] += result.stats.rounds or 0
print(json.dumps(out))
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", action="append", required=True, help="an interpreter per version (2 or more)")
    parser.add_argument("--artifact", action="append", required=True, help="PATH:BACKEND")
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    results: dict = {}
    for turn in range(args.turns):
        for spec in args.artifact:
            path, backend = spec.rsplit(":", 1)
            order = args.python if turn % 2 == 0 else list(reversed(args.python))  # rotate: drift hits both
            for python in order:
                start = time.perf_counter()
                done = subprocess.run(
                    [python, "-c", WORKER, path, backend, args.prompts, str(args.max_new_tokens)],
                    capture_output=True,
                    text=True,
                )
                if done.returncode != 0:
                    print(done.stderr[-2000:], file=sys.stderr)
                    return 1
                run = json.loads(done.stdout.strip().splitlines()[-1])
                results.setdefault(spec, {}).setdefault(python, []).append(run)
                print(
                    f"turn {turn + 1} {backend:5} {python}: plain {run['plain_s']:.1f}s spec {run['spec_s']:.1f}s "
                    f"({time.perf_counter() - start:.0f}s)",
                    file=sys.stderr,
                    flush=True,
                )
    print("| artifact | version | plain tokens/s | speculative tokens/s | spec/plain | spec == plain | ids as first |")
    print("|---|---|---|---|---|---|---|")
    for spec, by_version in results.items():
        first = None
        for python, runs in by_version.items():
            tokens = sum(len(ids) for ids in runs[0]["plain"])
            plain = tokens * len(runs) / sum(r["plain_s"] for r in runs)
            spec_tokens = sum(len(ids) for ids in runs[0]["spec"])
            speculative = spec_tokens * len(runs) / sum(r["spec_s"] for r in runs)
            same = all(r["spec"] == r["plain"] for r in runs)
            ids = (runs[0]["plain"], runs[0]["spec"])
            first = ids if first is None else first
            print(
                f"| {spec} | {python} | {plain:.1f} | {speculative:.1f} | {speculative / plain:.2f}x | "
                f"{'yes' if same else 'NO'} | {'yes' if ids == first else 'NO'} |"
            )
    if args.json:
        args.json.write_text(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
