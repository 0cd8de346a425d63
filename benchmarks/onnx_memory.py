"""Resident memory of an ONNX artifact: plain decoding (the verify graph alone) vs speculative decoding
(every session its plans need), with ORT weight pre-packing on (default) and off.

    python benchmarks/onnx_memory.py ARTIFACT
"""
import json, subprocess, sys
SCRIPT = r"""
import json, sys
def rss():
    for line in open('/proc/self/status'):
        if line.startswith('VmRSS:'):
            return int(line.split()[1]) * 1024
import numpy, onnxruntime
from speccompile.runtime.manifest import read_manifest
from speccompile.runtime.onnx_backend import OnnxBackend
root, roles, prepack = sys.argv[1], sys.argv[2], sys.argv[3] == 'on'
manifest = read_manifest(root, verify_files=False)
base = rss()
b = OnnxBackend.from_artifact(root, manifest, roles=None if roles == 'all' else roles.split(','), prepack=prepack)
b.reserve(64)
b.forward(list(range(5, 40)), 0)
for plan in (manifest.plans.values() if roles == 'all' else ()):
    b.draft(plan, 9, 35)
    b.verify(plan, [9, 10], 35, 1)
print(json.dumps({'mib': (rss() - base) / 2**20, 'sessions': sorted(b.sessions)}))
"""
root = sys.argv[1]  # an artifact built with --backend onnx
for prepack in ("on", "off"):
    r = {roles: json.loads(subprocess.run([sys.executable, "-c", SCRIPT, root, roles, prepack], capture_output=True,
                                          text=True, check=True).stdout.splitlines()[-1]) for roles in ("verify", "all")}
    print(f"prepack {prepack}: plain decoding (verify) {r['verify']['mib']:.1f} MiB; speculative "
          f"({', '.join(r['all']['sessions'])}) {r['all']['mib']:.1f} MiB; ratio {r['all']['mib'] / r['verify']['mib']:.3f}x")
