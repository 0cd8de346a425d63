"""The torch backend's CPU product forms (``runtime/backends/torch/cpu_linear.py``) side by side in one process: what a step and
a k-token verify cost with ``F.linear``, with MKL's packed product, and with what the load-time probe chose.

    python benchmarks/experiments/cpu_forms.py artifacts/smollm2-torch [--calls 15] [--context 128] [--forms standard,packed,auto]

Loads the artifact's canonical weights into one torch backend per form (``SPECCOMPILE_CPU_LINEAR`` set while
each loads), fills every cache with the same context, then times calls of 1, 2, 4, 8, 12 and 16 tokens at
that position, rotating through the backends call by call, so the machine's drifting speed weighs on all
alike. Prints the median milliseconds per call, each call's cost relative to the same backend's one-token
step (the verify-cost curve the tuner prices), the resident memory each backend added while loading, and
whether every form's logits agree with the first one's. Meant to be run alone on the machine.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np

TOKENS = (1, 2, 4, 8, 12, 16)


def resident_bytes() -> int:
    """This process's resident set (``VmRSS``), as ``benchmarks/onnx_memory.py`` reads it."""
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument(
        "--forms", default="standard,packed,auto", help="SPECCOMPILE_CPU_LINEAR values, comma-separated"
    )
    parser.add_argument("--calls", type=int, default=15, help="calls per backend and token count")
    parser.add_argument("--context", type=int, default=128)
    args = parser.parse_args()

    import torch
    from safetensors.torch import load_file

    from speccompile.runtime.artifact.manifest import read_manifest
    from speccompile.runtime.backends.torch import backend as torch_backend
    from speccompile.runtime.backends.torch.decoder import build_decoder

    torch.set_grad_enabled(False)
    manifest = read_manifest(args.artifact, verify_files=False)
    if "torch" not in manifest.backends or manifest.config.decoder == "generic":
        raise SystemExit(
            f"{args.artifact}: needs an artifact with canonical torch weights (build with --backend torch)"
        )
    weights = load_file(str(args.artifact / manifest.backends["torch"]["weights"]))
    backends, added = {}, {}
    for form in [f.strip() for f in args.forms.split(",") if f.strip()]:
        os.environ["SPECCOMPILE_CPU_LINEAR"] = form
        before = resident_bytes()
        backend = torch_backend.TorchBackend(build_decoder(manifest.config, {k: v.clone() for k, v in weights.items()}))
        added[form] = (resident_bytes() - before) / 2**20
        backends[form] = backend
        decoder = backend.decoder
        print(
            f"{form:>9}: streaming rows {sorted(decoder._streaming_rows)}, packed rows {sorted(decoder._packed_rows)}, "
            f"packs {decoder._packed_bytes / 2**20:.0f} MB, resident memory +{added[form]:.0f} MB while loading"
        )
    context = list(range(5, 5 + args.context))
    first = None
    for form, backend in backends.items():
        backend.reserve(args.context + max(TOKENS) + 1)
        logits = np.concatenate(
            [np.asarray(backend.forward(context, 0))[-1:], np.asarray(backend.forward(context[:8], args.context))]
        )
        if first is None:
            first = logits
        else:
            print(f"{form:>9}: logits within {np.abs(logits - first).max():.1e} of {next(iter(backends))}'s")
    rng = np.random.default_rng(0)
    times = {form: {k: [] for k in TOKENS} for form in backends}
    names = list(backends)
    for k in TOKENS:
        for call in range(args.calls + 2):
            order = names[call % len(names) :] + names[: call % len(names)]
            ids = rng.integers(5, manifest.config.vocab_size, k).tolist()
            for form in order:
                start = time.perf_counter()
                backends[form].forward(ids, args.context)
                if call >= 2:
                    times[form][k].append(time.perf_counter() - start)
    print("tokens " + "".join(f"{form:>22}" for form in names))
    for k in TOKENS:
        cells = []
        for form in names:
            ms = 1e3 * float(np.median(times[form][k]))
            step = 1e3 * float(np.median(times[form][1]))
            cells.append(f"{ms:8.1f} ms ({ms / step:4.2f}x)")
        print(f"{k:>6} " + "".join(f"{c:>22}" for c in cells))


if __name__ == "__main__":
    main()
