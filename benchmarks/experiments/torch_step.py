"""The torch backend's CPU step with and without packed projections, side by side in one process.

    python benchmarks/experiments/torch_step.py artifacts/smollm2-torch [--form streaming] [--calls 30]

Loads the artifact's canonical weights into two torch backends, one whose q/k/v and gate/up products
are packed (``runtime/backends/torch/decoder.pack_projections``, what ``TorchBackend`` does on CPU) and one without,
fills both caches with the same 128-token context, then times calls of 1, 2, 4 and 8 tokens at that
position, alternating between the two backends call by call (the order flipping each call), so the
machine's drifting speed weighs on both alike. Prints the median milliseconds per call and the ratio.

``--form`` sets ``SPECCOMPILE_CPU_LINEAR`` for both (``streaming``, ``standard`` or ``packed``: the product
form held fixed, so only packing differs; ``auto``: each backend runs its own product-form probe, as in
use). ``benchmarks/experiments/cpu_forms.py`` compares the product forms themselves.
Meant to be run under ``flock /tmp/speccompile-timing.lock``.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--form", choices=["auto", "streaming", "standard", "packed"], default="streaming")
    parser.add_argument("--calls", type=int, default=30, help="calls per backend and token count")
    parser.add_argument("--context", type=int, default=128)
    args = parser.parse_args()
    os.environ["SPECCOMPILE_CPU_LINEAR"] = args.form

    from safetensors.torch import load_file

    import speccompile.runtime.backends.torch.backend as torch_backend
    from speccompile.runtime.artifact.manifest import read_manifest
    from speccompile.runtime.backends.torch.decoder import build_decoder

    manifest = read_manifest(args.artifact, verify_files=False)
    if "torch" not in manifest.backends or manifest.config.decoder == "generic":
        raise SystemExit(
            f"{args.artifact}: needs an artifact with canonical torch weights (build with --backend torch)"
        )
    weights = load_file(str(args.artifact / manifest.backends["torch"]["weights"]))
    packing = torch_backend.pack_projections
    torch_backend.pack_projections = lambda decoder: []  # the unpacked backend
    try:
        unpacked = torch_backend.TorchBackend(build_decoder(manifest.config, weights))
    finally:
        torch_backend.pack_projections = packing
    packed = torch_backend.TorchBackend(build_decoder(manifest.config, weights))
    print(
        f"{args.artifact.name}, {manifest.config.num_layers} blocks, SPECCOMPILE_CPU_LINEAR={args.form}; "
        f"streaming form for rows {sorted(unpacked.decoder._streaming_rows)} (unpacked), "
        f"{sorted(packed.decoder._streaming_rows)} (packed); MKL-packed form for rows "
        f"{sorted(unpacked.decoder._packed_rows)} (unpacked), {sorted(packed.decoder._packed_rows)} (packed)"
    )
    context = list(range(5, 5 + args.context))
    for backend in (unpacked, packed):
        backend.reserve(args.context + 16)
        backend.forward(context, 0)
    rng = np.random.default_rng(0)
    for k in (1, 2, 4, 8):
        times = {"unpacked": [], "packed": []}
        for call in range(args.calls):
            tokens = rng.integers(3, manifest.config.vocab_size, k).tolist()
            order = [("unpacked", unpacked), ("packed", packed)]
            for name, backend in order if call % 2 == 0 else order[::-1]:
                start = time.perf_counter()
                backend.forward(tokens, args.context)
                times[name].append(time.perf_counter() - start)
        a, b = (float(np.median(times[n])) * 1e3 for n in ("unpacked", "packed"))
        print(
            f"{k} token{'s' if k > 1 else ' '}: unpacked {a:6.1f} ms, packed {b:6.1f} ms, packed is {a / b:.2f}x as fast",
            flush=True,
        )


if __name__ == "__main__":
    main()
