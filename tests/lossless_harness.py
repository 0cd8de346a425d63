"""Randomized lossless harness: speculative greedy output == the same backend's plain greedy output.

Each case draws, from a seeded generator: a family (all nine), a prompt (length and tokens), a drafter
(layer skip, early exit, n-gram lookup, retrieval, hybrid of lookup with either model draft), its draft
lengths, threshold, adaptivity and n-gram sizes, and the number of new tokens; then decodes plainly and
speculatively on one backend and compares token for token. A divergence is *explained* when the plain
reference's top-2 logit gap at that position is below 1e-4 (fp32 near-tie, docs/design.md section 6) and
*unexplained* otherwise (a bug).

    python tests/lossless_harness.py --cases 500 --backend torch
    python tests/lossless_harness.py --cases 500 --backend onnx --seed 1

Tiny random-weight transformers models of every family are built from configs (tests/tiny_models.py). For
ONNX, each family's graphs are exported once with a pool of random model plans that cases draw from.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from speccompile.runtime.drafting import describe, options

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

NEAR_TIE = 1e-4
DATASTORE = "retrieval/datastore.safetensors"
POOL = 12  # random model plans exported per family for ONNX


@dataclass
class Outcome:
    cases: int = 0
    identical: int = 0
    explained: list[str] = field(default_factory=list)
    unexplained: list[str] = field(default_factory=list)
    accepted: int = 0
    by_kind: dict[str, int] = field(default_factory=dict)


def random_model_plan(rng: np.random.Generator, L: int, name: str):
    from speccompile.runtime.artifact.manifest import DraftPlan

    k, threshold = int(rng.integers(1, 9)), float(rng.choice([0.0, 0.0, 0.2, 0.5, 0.8]))
    adaptive = bool(rng.integers(0, 2))
    if rng.random() < 0.5:
        return DraftPlan.of(
            name=name,
            exit_layer=int(rng.integers(1, L)),
            sources={"model": {"max_draft": k, "threshold": threshold, "adaptive": adaptive}},
        )
    attn = sorted(set(rng.choice(L, int(rng.integers(0, L + 1)), replace=False).tolist()))
    mlp = sorted(set(rng.choice(L, int(rng.integers(0 if attn else 1, L + 1)), replace=False).tolist()))
    return DraftPlan.of(
        name=name,
        skip_attn=attn,
        skip_mlp=mlp,
        sources={"model": {"max_draft": k, "threshold": threshold, "adaptive": adaptive}},
    )


def with_lookup(rng: np.random.Generator, plan, name: str):
    """``plan`` (or nothing) with random lookup sources in front of it."""
    from dataclasses import replace

    from speccompile.runtime.artifact.manifest import DraftPlan

    sources = [["ngram"], ["retrieval"], ["ngram", "retrieval"], ["retrieval", "ngram"]][int(rng.integers(0, 4))]
    lo = int(rng.integers(1, 4))
    ngram = {"min": lo, "max": lo + int(rng.integers(0, 3))}
    settings = dict(lookup=sources, lookup_max_draft=int(rng.integers(1, 11)), extend=bool(rng.integers(0, 2)))
    options = {"ngram": ngram, "retrieval": {"datastore": DATASTORE if "retrieval" in sources else None}}
    if plan is None:
        return DraftPlan.of(name=name, sources=options, **settings)
    return replace(plan.with_options(**options), name=name, **settings)


class Family:
    """One tiny model of a family: decoder, torch backend, a datastore and (for ONNX) exported graphs."""

    def __init__(self, family: str, root: Path, backend: str, rng: np.random.Generator):
        from tiny_models import make_model
        from transformers import AutoModelForCausalLM

        from speccompile.convert import arch_config, canonical_weights
        from speccompile.runtime.backends.torch.backend import TorchBackend
        from speccompile.runtime.backends.torch.decoder import build_decoder
        from speccompile.runtime.decoding.speculative import DecodeRequest, decode_all
        from speccompile.runtime.drafting.retrieval import Datastore

        folder = make_model(family, root / family)
        hf = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
        config = arch_config(hf)
        self.decoder = build_decoder(config, canonical_weights(hf, config))
        self.root = root / f"{family}-artifact"
        (self.root / "retrieval").mkdir(parents=True)
        torch_backend = TorchBackend(self.decoder)
        seqs = []
        for _ in range(8):
            prompt = rng.integers(3, config.vocab_size, int(rng.integers(3, 30))).tolist()
            seqs.append(prompt + decode_all(torch_backend, DecodeRequest(prompt, 24))[0])
        Datastore.build(seqs).save(self.root / DATASTORE)
        L = config.num_layers
        self.pool = [random_model_plan(rng, L, f"pool-{i}") for i in range(POOL)]
        if backend == "onnx":
            from speccompile.exporters.onnx_export import export_onnx
            from speccompile.runtime.backends.onnx import OnnxBackend

            record = export_onnx(self.decoder, {p.name: p for p in self.pool}, self.root / "onnx")
            self.backend = OnnxBackend(self.root, record, config, threads=1)
        else:
            self.backend = torch_backend

    def top2_gap(self, tokens: list[int]) -> float:
        import torch

        with torch.inference_mode():
            logits = self.decoder(torch.tensor([tokens]))[0, -1].float()
        top = torch.topk(logits, 2).values
        return float(top[0] - top[1])


def draw_plan(rng: np.random.Generator, fam: Family):
    from dataclasses import replace

    kind = ["model", "lookup", "hybrid"][int(rng.integers(0, 3))]
    model = fam.pool[int(rng.integers(0, POOL))]
    if kind == "model":
        return kind, replace(model, measured={})
    if kind == "lookup":
        return kind, with_lookup(rng, None, "lookup")
    return kind, with_lookup(rng, model, model.name)  # keeps the pool name: its ONNX graphs are exported


def run_cases(cases: int, backend: str = "torch", seed: int = 0, families=None, log=print) -> Outcome:
    from tiny_models import FAMILIES

    from speccompile.runtime.decoding.speculative import DecodeRequest, decode_all

    rng = np.random.default_rng(seed)
    families = list(families or FAMILIES)
    outcome = Outcome()
    with tempfile.TemporaryDirectory(prefix="speccompile-harness-") as tmp:
        built: dict[str, Family] = {}
        for case in range(cases):
            name = families[int(rng.integers(0, len(families)))]
            if name not in built:
                built[name] = Family(name, Path(tmp), backend, rng)
            fam = built[name]
            vocab = fam.decoder.config.vocab_size
            prompt = rng.integers(3, vocab, int(rng.integers(1, 40))).tolist()
            if rng.random() < 0.3:  # repetitive prompts give lookups something to find
                prompt = (prompt[: int(rng.integers(2, 8))] * 6)[: len(prompt) + 10]
            new_tokens = int(rng.integers(2, 49))
            kind, plan = draw_plan(rng, fam)
            plain, _ = decode_all(fam.backend, DecodeRequest(prompt, new_tokens))
            spec, stats = decode_all(fam.backend, DecodeRequest(prompt, new_tokens), plan, fam.root)
            outcome.cases += 1
            outcome.accepted += stats.accepted
            outcome.by_kind[kind] = outcome.by_kind.get(kind, 0) + 1
            if spec == plain:
                outcome.identical += 1
                continue
            i = next((k for k, (a, b) in enumerate(zip(plain, spec)) if a != b), min(len(plain), len(spec)))
            gap = fam.top2_gap(prompt + plain[:i])
            line = (
                f"case {case}: {name} {kind} plan {describe(plan)} k={options(plan, 'model').max_draft} th={options(plan, 'model').threshold} "
                f"prompt {len(prompt)} tokens, diverges at new token {i}, top-2 gap {gap:.2e}"
            )
            (outcome.explained if gap < NEAR_TIE else outcome.unexplained).append(line)
    return outcome


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=500)
    parser.add_argument("--backend", choices=["torch", "onnx"], default="torch")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    start = time.perf_counter()
    out = run_cases(args.cases, args.backend, args.seed)
    print(
        f"{args.backend}: {out.cases} cases in {time.perf_counter() - start:.0f} s (seed {args.seed}; "
        + ", ".join(f"{k} {v}" for k, v in sorted(out.by_kind.items()))
        + f"), {out.accepted} drafted tokens accepted"
    )
    print(
        f"  identical: {out.identical}, mismatches explained by near-ties: {len(out.explained)}, "
        f"unexplained: {len(out.unexplained)}"
    )
    for line in out.explained + out.unexplained:
        print("  " + line)
    sys.exit(1 if out.unexplained else 0)


if __name__ == "__main__":
    main()
