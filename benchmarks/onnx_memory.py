"""Resident memory of an ONNX artifact: plain decoding (the verify graph alone) vs speculative decoding
(every session its plans need), with ORT weight pre-packing on (default) and off.

    python benchmarks/onnx_memory.py ARTIFACT

Each measurement runs in a fresh interpreter, so nothing loaded earlier counts; ``tests/test_onnx.py``
asserts its bounds with ``measure`` from here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

_CHILD = r"""
import json, sys
def rss():
    for line in open('/proc/self/status'):
        if line.startswith('VmRSS:'):
            return int(line.split()[1]) * 1024
import numpy, onnxruntime
from speccompile.runtime.artifact.manifest import read_manifest
from speccompile.runtime.backends.onnx import OnnxBackend
from speccompile.runtime.drafting import check_plans
root, roles, prepack, threads = sys.argv[1], sys.argv[2], sys.argv[3] == 'on', int(sys.argv[4])
manifest = read_manifest(root, verify_files=False)
base = rss()
plans = check_plans(manifest)
b = OnnxBackend.from_artifact(root, manifest, plans, roles=None if roles == 'all' else roles.split(','), prepack=prepack,
                              threads=threads)
b.reserve(64)
b.forward(list(range(5, 40)), 0)
for plan in (plans.values() if roles == 'all' else ()):
    if plan.draft_head_file:  # an exit adapter / reduced vocabulary: its graphs are opened with the plan
        b.load_draft_head(plan.draft_head_file, root)
    b.draft(plan, 9, 35)
    b.verify(plan, [9, 10], 35, 1)
print(json.dumps({'bytes': rss() - base, 'sessions': sorted(b.sessions)}))
"""


def measure(root, roles: str, prepack: bool, threads: int = 0) -> dict:
    """RSS (bytes above the interpreter with onnxruntime imported) after loading ``root`` with the
    sessions ``roles`` ("verify", or "all" for what its plans need) and running each once."""
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(root), roles, "on" if prepack else "off", str(threads)],
        capture_output=True,
        text=True,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        timeout=300,
    )
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(root: str) -> None:
    for prepack in (True, False):
        plain, spec = measure(root, "verify", prepack), measure(root, "all", prepack)
        print(
            f"prepack {'on' if prepack else 'off'}: plain decoding (verify) {plain['bytes'] / 2**20:.1f} MiB; "
            f"speculative ({', '.join(spec['sessions'])}) {spec['bytes'] / 2**20:.1f} MiB; "
            f"ratio {spec['bytes'] / plain['bytes']:.3f}x"
        )


if __name__ == "__main__":
    main(sys.argv[1])  # an artifact built with --backend onnx
