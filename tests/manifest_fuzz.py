"""Fuzz ``load`` with mutated manifests of real artifacts: how many mutations load, how many the
runtime refuses with its own error type, how many only its boundary's net caught (an ``ArtifactOpenError``:
an exception no check foresaw), and how many *escape* as another exception type (the goal: zero).

Builds a tiny random Llama (tests/tiny_models.py) into a torch and an ONNX artifact, then runs
``--examples`` mutations of each manifest (``tests/helpers_reliability.mutations``: every path of the
manifest, two edits in three under the fields the runtime acts on) through ``load``. Hypothesis generates
them (generate phase only, no shrinking), seeded, so a run is reproducible.

    python tests/manifest_fuzz.py                      # 2,000 mutations per backend
    python tests/manifest_fuzz.py --examples 5000 --backends torch

Exit status 1 if any mutation escaped, with each escape's type and message printed.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("SPECCOMPILE_CPU_LINEAR", "standard")  # no product timing at each load


def build_artifacts(work: Path, backends: list[str]) -> dict[str, Path]:
    from tiny_models import make_model

    from speccompile.build import BuildOptions, build

    model = make_model("llama", work / "model")
    built = {}
    for backend in backends:
        out = work / f"artifact-{backend}"
        build(
            BuildOptions(
                model=str(model),
                out=out,
                method="cosine",
                max_draft=2,
                calibration_tokens=8,
                confirm_prompts=1,
                confirm_tokens=8,
                backends=(backend,),
                show_progress=False,
            ),
            log=lambda message: None,
        )
        built[backend] = out
    return built


def fuzz(source: Path, folder: Path, examples: int, seed: int) -> tuple[collections.Counter, list[str]]:
    from helpers_reliability import load_outcome, mutations, write_manifest
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hypothesis_seed
    from hypothesis import strategies as st

    shutil.copytree(source, folder)
    document = json.loads((source / "manifest.json").read_text())
    counts: collections.Counter = collections.Counter()
    escapes: list[str] = []

    @hypothesis_seed(seed)
    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(st.data())
    def run(data):
        write_manifest(folder, data.draw(mutations(document)))
        try:
            counts[load_outcome(folder)] += 1
        except Exception as exc:  # an escape: recorded, not raised, so the count covers every example
            counts["escaped"] += 1
            escapes.append(f"{type(exc).__name__}: {str(exc)[:300]}")

    run()
    return counts, escapes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=2000, help="mutations per backend")
    parser.add_argument("--backends", default="torch,onnx")
    parser.add_argument("--seed", type=int, default=27)
    args = parser.parse_args()
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    total_escapes = 0
    with tempfile.TemporaryDirectory(prefix="manifest-fuzz-") as tmp:
        work = Path(tmp)
        started = time.perf_counter()
        artifacts = build_artifacts(work, backends)
        print(f"built {', '.join(backends)} artifacts of a tiny Llama in {time.perf_counter() - started:.0f}s")
        for backend, source in artifacts.items():
            started = time.perf_counter()
            counts, escapes = fuzz(source, work / f"fuzz-{backend}", args.examples, args.seed)
            total = sum(counts.values())
            print(
                f"{backend}: {total} mutations in {time.perf_counter() - started:.0f}s: {counts['loaded']} loaded, "
                f"{counts['refused']} refused by the checks, {counts['net']} caught by the boundary's net, "
                f"{counts['escaped']} escaped"
            )
            for line in escapes:
                print(f"  escaped: {line}")
            total_escapes += counts["escaped"]
    print(f"escapes: {total_escapes}")
    return 1 if total_escapes else 0


if __name__ == "__main__":
    sys.exit(main())
