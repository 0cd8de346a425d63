"""What a call of several sequences' rows costs on ONNX Runtime's fused graphs, packed (``query_seqlens``: every row
of a round in one call, right-padded to the widest) against the older graphs (one-token rows together, every wider
row a call of its own).

    python benchmarks/experiments/packed_rows_curve.py [ARTIFACT] [--threads 2] [--context 128] [--rounds 5]
                                                      [--max-k 8] [--out FILE.json]

ARTIFACT: an artifact with torch weights (``--backend torch,onnx``); without one, a random-weight Llama with
SmolLM2-135M's shapes (30 blocks, hidden 576, 9 / 3 heads, MLP 1536, vocabulary 49152, tied head) is made here.
Its full model is exported twice: ``packed`` (the default export: products and MLPs on the call's tokens, only
GroupQueryAttention on the rows padded to the widest) and ``old`` (``packed_rows=False``). Every cell is ``run_rows`` on the backend of one variant after
``--context`` cached positions in every slot; cells and variants go round-robin for ``--rounds`` rounds and the
minimum per cell is kept (a shared machine only ever adds time).

Cells:
- ``mixed``: 16 one-token rows and one 64-token prompt chunk (17 slots) against 80 one-token rows (what the same
  80 tokens cost as steps); on ``old`` the chunk is a call of its own;
- ``verify n x k``: n sequences (1, 4, 16) each with a row of k tokens (k = 1..max-k: an input token and k - 1
  drafted ones); on ``old`` one call for k = 1, n calls for k > 1;
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

SMOLLM2 = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    max_position_embeddings=2048,
)
VARIANTS = {"packed": {}, "old": {"packed_rows": False}}


def random_source(layers: int):
    """(config, canonical weights) of a random-weight SmolLM2-shaped Llama."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from speccompile.convert import arch_config, canonical_weights

    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(**dict(SMOLLM2, num_hidden_layers=layers), initializer_range=0.04)).eval()
    config = arch_config(hf)
    return config, canonical_weights(hf, config)


def artifact_source(artifact: Path):
    from speccompile.artifact_writer import read_canonical_weights
    from speccompile.runtime.artifact.manifest import read_manifest

    manifest = read_manifest(artifact)
    return manifest.config, read_canonical_weights(artifact, manifest)


def backends(config, weights, folder: Path, threads: int) -> dict:
    """variant -> OnnxBackend on its own export of the full model (verify graph only)."""
    from speccompile.exporters.onnx_export import export_onnx_weights
    from speccompile.runtime.backends.onnx import OnnxBackend

    out = {}
    for name, options in VARIANTS.items():
        root = folder / name
        record = export_onnx_weights(config, weights, {}, root / "onnx", variant="fused", relative_to=root, **options)
        out[name] = OnnxBackend(root, record, config, threads=threads, roles=["verify"])
    return out


def cells(max_k: int) -> dict[str, list[tuple[int, int]]]:
    """cell name -> rows as (slot, width); the slots' pasts are ``--context`` long."""
    found = {
        "mixed: 16 steps + a 64-token chunk": [(s, 1) for s in range(16)] + [(16, 64)],
        "80 one-token rows": [(s, 1) for s in range(80)],
    }
    for n in (1, 4, 16):
        for k in range(1, max_k + 1):
            found[f"verify {n} x {k}"] = [(s, k) for s in range(n)]
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", nargs="?", type=Path)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-k", type=int, default=8)
    parser.add_argument("--layers", type=int, default=30, help="blocks of the random model (no ARTIFACT)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    import numpy as np

    from speccompile.runtime.segments import Row, full_model

    folder = Path(tempfile.mkdtemp(prefix="packed_rows_"))
    config, weights = artifact_source(args.artifact) if args.artifact else random_source(args.layers)
    engines = backends(config, weights, folder, args.threads)
    del weights
    full = full_model(config.num_layers)
    table = cells(args.max_k)
    slots = max(slot for rows in table.values() for slot, _ in rows) + 1
    rng = np.random.default_rng(0)
    past = rng.integers(3, config.vocab_size, args.context).tolist()
    for backend in engines.values():
        backend.reserve(args.context + 80, slots=slots)
        backend.run_rows(full, [Row(0, 0, past)])
        for slot in range(1, slots):
            backend.move_slot(0, slot, args.context)

    def call(backend, rows: list[tuple[int, int]]) -> float:
        batch = [Row(slot, args.context, rng.integers(3, config.vocab_size, width).tolist()) for slot, width in rows]
        start = time.perf_counter()
        backend.run_rows(full, batch)
        return time.perf_counter() - start

    best: dict[str, dict[str, float]] = {name: {} for name in table}
    for _ in range(args.rounds + 1):  # the first round warms up and is not kept
        for cell, rows in table.items():
            for variant, backend in engines.items():
                seconds = call(backend, rows)
                if _ > 0:
                    best[cell][variant] = min(best[cell].get(variant, seconds), seconds)
    names = list(engines)
    print(f"ms per call (best of {args.rounds}), {args.threads} threads, context {args.context}")
    print(f"{'cell':40s}" + "".join(f"{n:>12s}" for n in names) + f"{'tokens':>8s}")
    for cell, rows in table.items():
        tokens = sum(width for _, width in rows)
        print(f"{cell:40s}" + "".join(f"{1e3 * best[cell][n]:12.1f}" for n in names) + f"{tokens:8d}")
    if args.out:
        args.out.write_text(json.dumps({"threads": args.threads, "context": args.context, "ms": best}, indent=1))


if __name__ == "__main__":
    main()
