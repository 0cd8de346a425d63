"""What the ONNX test files share: a minimal ONNX-only artifact, its backend, a per-family artifact cache, and
the logits check of every graph against the torch backend."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch
from tiny_models import make_tokenizer

from speccompile.artifact_writer import hash_files
from speccompile.exporters.onnx_export import export_onnx
from speccompile.runtime.artifact.manifest import DraftPlan, Manifest, read_manifest, write_manifest
from speccompile.runtime.backends.onnx import OnnxBackend
from speccompile.runtime.drafting import check_plans, read_plan

TOL = 1e-4


def make_artifact(
    decoder, plan_map: dict[str, DraftPlan], root: Path, tokenizer: Path | None = None, **options
) -> Path:
    """An ONNX-only artifact folder: onnx/ + tokenizer/ (the runtime opens it, so the manifest hashes it, like
    every file) + manifest.json, no torch weights. ``tokenizer``: a tokenizer.json to copy (default: a new one)."""
    root.mkdir(parents=True, exist_ok=True)
    if tokenizer is None:
        make_tokenizer(root / "tokenizer")
    else:
        (root / "tokenizer").mkdir(parents=True, exist_ok=True)
        shutil.copyfile(tokenizer, root / "tokenizer" / "tokenizer.json")
    record = export_onnx(decoder, plan_map, root / "onnx", **options)
    manifest = Manifest(
        config=decoder.config,
        plans=plan_map,
        default_plan=next(iter(plan_map)),
        files=hash_files(root),
        backends={"onnx": record},
    )
    write_manifest(root, manifest)
    return root


def split_memory_bounds(root: Path, plain: int, speculative: int) -> None:
    """With pre-packing on, plain decoding (the verify session) holds the weights about once, packed (and a tied
    embedding table twice), and an
    early-exit artifact's sessions (prefix, suffix, head) each weight packed once plus one unpacked copy of the
    tensors they share (the tied embedding: a Gather and a head); a weight packed twice would add the weights again."""
    from speccompile.runtime.backends.onnx.initializers import shared_tensors

    record = json.loads((root / "manifest.json").read_text())["backends"]["onnx"]
    weights = (root / "onnx" / "weights.bin").stat().st_size
    names = shared_tensors(record["graphs"], [k for k in record["graphs"] if k != "verify"], record["tensors"])
    shared = sum({(t["offset"], t["nbytes"]): t["nbytes"] for n, t in record["tensors"].items() if n in names}.values())
    print(
        f"\npre-packed: weights {weights / 2**20:.1f} MiB, plain (verify) {plain / 2**20:.1f} MiB, early exit "
        f"{speculative / 2**20:.1f} MiB, of which shared tensors {shared / 2**20:.1f} MiB"
    )
    embed = record["tensors"]["embed.weight"]["nbytes"]  # a tied table twice: the Gather's and the head's packed
    assert plain <= 1.25 * weights + embed, f"plain decoding holds {plain / weights:.2f}x the weights"
    sessions = 48 * 2**20  # two more sessions' own arenas and threads (about 20 MiB each here)
    assert speculative <= plain + shared + sessions, f"the early exit holds {speculative / weights:.2f}x the weights"


def open_onnx(root: Path, manifest=None, **kwargs) -> OnnxBackend:
    """The artifact's ONNX backend over its plans read (``manifest``: a changed copy of the artifact's)."""
    manifest = read_manifest(root) if manifest is None else manifest
    return OnnxBackend.from_artifact(root, manifest, check_plans(manifest), **kwargs)


def ort_backend(root: Path, **kwargs) -> OnnxBackend:
    return open_onnx(root, threads=1, **kwargs)


def artifact_cache(tiny_decoder, base: Path, plans, tokenizer_of=None, **options):
    """family -> (decoder, artifact root, plans, OnnxBackend), each built once (``plans(num_layers)``)."""
    cache = {}

    def get(family: str):
        if family not in cache:
            _, decoder = tiny_decoder(family)
            plan_map = plans(decoder.config.num_layers)
            tokenizer = tokenizer_of(family) if tokenizer_of is not None else None
            root = make_artifact(decoder, plan_map, base / family, tokenizer, **options)
            cache[family] = (decoder, root, plan_map, ort_backend(root))
        return cache[family]

    return get


def check_logits(ort, ref, decoder, plan_map: dict[str, DraftPlan], family: str, tol: float = TOL) -> None:
    """Every graph through the backend protocol: prefill past the mistral window, steps of 1 and 3 tokens, a
    step against one full forward, then per plan three drafts, a verify (with early-exit reuse) and a
    rolled-back step, all within ``tol`` of the torch backend on the same cache state."""
    for b in (ort, ref):
        b.reserve(64)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(3, decoder.config.vocab_size, (48,), generator=gen).tolist()

    def same(a, b, what):
        err = float(np.abs(a - b).max())
        assert a.shape == b.shape and err < tol, f"{family} {what}: max |ORT - torch| = {err:.2e}"

    same(ort.forward(tokens[:30], 0), ref.forward(tokens[:30], 0), "prefill")
    same(ort.forward(tokens[30:31], 30), ref.forward(tokens[30:31], 30), "1-token step")
    same(ort.forward(tokens[31:34], 31), ref.forward(tokens[31:34], 31), "3-token step")
    with torch.inference_mode():
        full = decoder(torch.tensor([tokens[:34]]))[0].numpy()
    same(ort.forward(tokens[33:34], 33), full[33:34], "step vs one-shot full forward")
    for name, plan in plan_map.items():
        pos, read = 34, read_plan(plan, decoder.config.num_layers)
        for j in range(3):
            same(
                ort.draft(read, tokens[pos + j], pos + j),
                ref.draft(read, tokens[pos + j], pos + j),
                f"{name} draft {j}",
            )
        round_tokens = tokens[pos : pos + 4]
        same(ort.verify(read, round_tokens, pos, 3), ref.verify(read, round_tokens, pos, 3), f"{name} verify")
        same(
            ort.forward(tokens[pos + 1 : pos + 2], pos + 1),
            ref.forward(tokens[pos + 1 : pos + 2], pos + 1),
            f"{name} rollback step",
        )


def check_greedy_lossless(
    ort, decoder, plan_map: dict[str, DraftPlan], prompts: int, new_tokens: int, step: int
) -> None:
    """ORT plain greedy == torch plain greedy, and ORT speculative == ORT plain for every plan, on ``prompts``
    random prompts (lengths 3, 3 + step, ...); divergences only at near-ties of the model (at most one), and
    some draft accepted."""
    from lossless import assert_same_greedy, run

    from speccompile.runtime.backends.torch.backend import TorchBackend

    ref = TorchBackend(decoder)
    gen = torch.Generator().manual_seed(3)
    near_ties = accepted = 0
    for p in range(prompts):
        prompt = torch.randint(3, decoder.config.vocab_size, (3 + step * p,), generator=gen).tolist()
        plain, _ = run(ort, prompt, new_tokens)
        assert len(plain) == new_tokens
        near_ties += assert_same_greedy(decoder, prompt, run(ref, prompt, new_tokens)[0], plain)  # ORT == torch
        for plan in plan_map.values():
            spec, stats = run(ort, prompt, new_tokens, plan)
            near_ties += assert_same_greedy(decoder, prompt, plain, spec)
            accepted += stats.accepted
    assert near_ties <= 1, f"{near_ties} near-tie divergences: too many to be rounding"
    assert accepted > 0, "no drafted token was ever accepted: the accept path was not exercised"
