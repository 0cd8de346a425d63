"""The torch backend's CPU product forms timed per weight shape: why ``runtime/backends/torch/cpu_linear.py`` chooses
them shape by shape.

    python benchmarks/experiments/cpu_forms_by_shape.py artifacts/scale/qwen3-0.6b-torch [--rows 1,2,8] [--repeats 4]

Loads the artifact's torch weights with no product form switched on (``SPECCOMPILE_CPU_LINEAR=standard``), packs
q/k/v and gate/up as the backend does, groups the products a step runs by weight shape, and times every weight
of each shape in model order with ``F.linear``, ``W @ x^T`` (streaming) and MKL's packed product, in turns, best
of ``--repeats``. Prints milliseconds per shape and row count, the packed form's time over the best other form's
(below ``PACK_GAIN`` the backend packs that shape), and the megabytes a shape's packs take. Each shape's packs
are made only while it is timed. Meant to be run alone on the machine.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--rows", default="1,2,8", help="row counts to time, comma-separated")
    parser.add_argument("--repeats", type=int, default=4)
    args = parser.parse_args()
    os.environ["SPECCOMPILE_CPU_LINEAR"] = "standard"  # the forms are applied here, not chosen at load

    import torch
    import torch.nn.functional as F

    from speccompile.runtime.backends.torch import cpu_linear
    from speccompile.runtime.backends.torch.backend import TorchBackend
    from speccompile.runtime.model import read_artifact

    if cpu_linear.MklPack.missing():
        raise SystemExit(f"no packed form here: {cpu_linear.MklPack.missing()}")
    manifest = read_artifact(args.artifact)
    backend = TorchBackend.from_files(args.artifact / manifest.backends["torch"]["weights"], manifest.config)
    decoder = backend.decoder
    products = [entry[0] for m in decoder.modules() for entry in (m.__dict__.get("_qkv"), m.__dict__.get("_gate_up"))]
    products = [p for p in products if p is not None]
    replaced = {
        id(part)
        for m in decoder.modules()
        for name in ("_qkv", "_gate_up")
        if name in m.__dict__
        for part in m.__dict__[name][2]
    }
    weights = [m.weight for m in decoder.modules() if isinstance(m, torch.nn.Linear) and id(m) not in replaced]
    weights = list(dict.fromkeys(weights + [p.weight for p in products]))
    groups: dict[tuple[int, ...], list[torch.Tensor]] = {}
    for w in weights:
        groups.setdefault(tuple(w.shape), []).append(w)
    rows = [int(r) for r in args.rows.split(",")]
    print(
        f"{args.artifact}: {len(weights)} products, {sum(w.numel() for w in weights) * 4 / 2**20:.0f} MB, "
        f"{torch.get_num_threads()} threads, PACK_GAIN {cpu_linear.PACK_GAIN}"
    )
    print("| shape | weights | MB | rows | F.linear ms | streaming ms | packed ms | packed / best other |")
    print("|---|---|---|---|---|---|---|---|")
    with torch.inference_mode():
        for shape, group in groups.items():
            packs = [cpu_linear.MklPack(w) for w in group]
            for n in rows:
                x = torch.randn(n, shape[1])
                best = {"standard": float("inf"), "streaming": float("inf"), "packed": float("inf")}
                for _ in range(args.repeats):
                    for form in best:
                        start = time.perf_counter()
                        for w, pack in zip(group, packs):
                            if form == "packed":
                                pack.product(x, w, None, n)
                            elif form == "streaming":
                                cpu_linear.streaming_product(x, w)
                            else:
                                F.linear(x, w)
                        best[form] = min(best[form], time.perf_counter() - start)
                ratio = best["packed"] / min(best["standard"], best["streaming"])
                print(
                    f"| {shape[0]}x{shape[1]} | {len(group)} | {sum(w.numel() for w in group) * 4 / 2**20:.0f} | {n} | "
                    f"{best['standard'] * 1e3:.1f} | {best['streaming'] * 1e3:.1f} | {best['packed'] * 1e3:.1f} | "
                    f"{ratio:.2f} |"
                )
            del packs


if __name__ == "__main__":
    main()
