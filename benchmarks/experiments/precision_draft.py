"""Precision self-drafts on a real model: the model's own graph with int8 / int4 products drafts,
the fp32 model verifies (ONNX Runtime: the fused graph with ``MatMulNBits``; torch: the decoder's dynamic-int8
twin, int8 only). Prints, per plan, the speedup over plain decoding timed in turns, tokens per round, the
draft acceptance and whether every output equals plain decoding.

    speccompile build MODEL -o ART --backend onnx          # any ONNX Runtime artifact with fp32 fused graphs
    python benchmarks/experiments/precision_draft.py ART [--prompts FILE] [--max-new-tokens 96] [--plans int8,int4,int4/b128]
                                                     [--hybrid] [--backend torch]

For ONNX Runtime the artifact is copied (``ART-precision``) and re-exported with precision plans added next
to its own (the quantized weights go into the same weights.bin, once); on torch the plans are added to the
loaded manifest (the int8 twin is made at load, nothing is stored). Nothing is tuned: each plan drafts up to
``--max-draft`` tokens with the adaptive threshold. A plan string is a precision as the draft kind writes it:
``int4`` (block 32, asymmetric: the block layout of SmolLM2's Q4_1 GGUF, though not its values: integer zero
points; ``benchmarks/experiments/quant_agreement.py``),
``int4/b128`` (block 128: a grid that does not match the GGUF's), ``int4/b32s`` (symmetric), ``int8``; with
``@N`` (``int8/b128s@2``) the draft is a token tree with up to N - 1 of its runner-ups beside each token it
drafts (``sources.model.branches``).
``--hybrid`` adds, per precision, the hybrid of the artifact's default lookup plan and that precision draft
(a lookup hit when there is one, else the precision draft, extended by lookup: ``runtime/drafting/hybrid.py``).
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

from speccompile.runtime.drafting import has_model_part

BENCHMARKS = Path(__file__).resolve().parent.parent  # benchmarks/ (this script is in benchmarks/experiments/)


def plan_for(precision: str, max_draft: int):
    """The plan of a ``--plans`` entry: a precision, then ``@N`` for a model-draft tree of ``N`` branches
    (``sources.model.branches``: the draft's choice and up to N - 1 runner-ups at each drafted position)."""
    from speccompile.runtime.artifact.manifest import DraftPlan
    from speccompile.runtime.segments import parse_precision

    precision, _, branches = precision.partition("@")
    scheme, block, symmetric = parse_precision(precision)
    name = f"precision-{precision.replace('/', '-')}" + (f"-tree{branches}" if branches else "")
    return DraftPlan.of(
        name=name,
        kind="precision",
        params={"precision": scheme, "block_size": block, "symmetric": symmetric},
        sources={"model": {"max_draft": max_draft, "branches": int(branches or 1)}},
    )


def hybrid_for(precision: str, max_draft: int, lookup_plan):
    """The precision draft of ``precision`` behind ``lookup_plan``'s lookups (the same sources and sizes)."""
    import dataclasses

    from speccompile.passes.precision_tune import behind_lookup

    plan = plan_for(precision, max_draft)
    return dataclasses.replace(behind_lookup(plan, lookup_plan), name=plan.name + "+lookup")


def lookup_plan_of(manifest):
    """The artifact's plan named ``lookup``, else its default plan when that is a lookup plan."""
    plan = manifest.plans.get("lookup") or manifest.plans.get(manifest.default_plan)
    return plan if plan is not None and plan.lookup and not has_model_part(plan) else None


def with_precision_plans(source: Path, out: Path, precisions: list[str], max_draft: int, hybrid: bool = False) -> Path:
    """A copy of ``source`` whose ONNX export also holds the precision plans' draft graphs."""
    from speccompile.artifact_writer import hash_files, read_canonical_weights
    from speccompile.exporters.onnx_export import export_onnx_weights, export_options
    from speccompile.runtime.artifact.manifest import read_manifest, write_manifest

    manifest = read_manifest(source)
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(source, out, ignore=shutil.ignore_patterns("onnx"))
    weights = read_canonical_weights(source, manifest)
    plans = dict(manifest.plans)
    lookup_plan = lookup_plan_of(manifest) if hybrid else None
    if hybrid and (lookup_plan is None or not lookup_plan.lookup):
        raise SystemExit("--hybrid needs an artifact with a lookup plan (build it with --method lookup or precision)")
    for precision in precisions:
        for plan in [plan_for(precision, max_draft)] + (
            [hybrid_for(precision, max_draft, lookup_plan)] if hybrid else []
        ):
            plans[plan.name] = plan
    record = manifest.backends["onnx"]
    started = time.perf_counter()
    manifest.backends["onnx"] = export_onnx_weights(
        manifest.config, weights, plans, out / "onnx", relative_to=out, **export_options(record)
    )
    print(f"exported in {time.perf_counter() - started:.1f}s")
    manifest.plans = plans
    manifest.files = hash_files(out)
    write_manifest(out, manifest)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--prompts", default=str(BENCHMARKS / "data" / "smollm2_prompts.jsonl"))
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--max-draft", type=int, default=6)
    parser.add_argument("--plans", default="int8,int4,int4/b128")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--hybrid", action="store_true")
    parser.add_argument("--backend", choices=("onnx", "torch"), default="onnx")
    parser.add_argument(
        "--branch-floor",
        type=float,
        default=None,
        help="a model-draft tree's least leaf probability (default: drafters.BRANCH_MIN_PROBABILITY)",
    )
    args = parser.parse_args()
    if args.branch_floor is not None:
        from speccompile.runtime.drafting import model_draft as drafters

        drafters.BRANCH_MIN_PROBABILITY = args.branch_floor

    from speccompile.bench import load_prompts
    from speccompile.runtime import load

    precisions = [p for p in args.plans.split(",") if p]
    if args.backend == "onnx":
        root = with_precision_plans(
            args.artifact,
            args.artifact.with_name(args.artifact.name + "-precision"),
            precisions,
            args.max_draft,
            args.hybrid,
        )
        model = load(root, backend="onnx")
        record = model.manifest.backends["onnx"]
        extra = sum(t["nbytes"] for name, t in record["tensors"].items() if ".int4" in name or ".int8" in name)
        print(
            f"weights.bin {record['weights_bytes'] / 1e6:.1f} MB, of which quantized draft weights {extra / 1e6:.1f} MB"
        )
    else:
        model = load(args.artifact, backend="torch")
        lookup_plan = lookup_plan_of(model.manifest)
        for precision in precisions:
            model.manifest.plans[plan_for(precision, args.max_draft).name] = plan_for(precision, args.max_draft)
            if args.hybrid:
                hybrid = hybrid_for(precision, args.max_draft, lookup_plan)
                model.manifest.plans[hybrid.name] = hybrid
        from speccompile.runtime.drafting import check_plans

        model.plans = check_plans(model.manifest)  # the added plans read, as loading reads the manifest's
        model.backend.check_plans(model.plans)
    texts, source = load_prompts(args.prompts, model.manifest)
    prompts = [model.encode_prompt(t) for t in texts]
    names = [None, *(plan_for(p, args.max_draft).name for p in precisions)]
    if args.hybrid:
        names += [plan_for(p, args.max_draft).name + "+lookup" for p in precisions]
    names += [
        name
        for name in dict.fromkeys([model.manifest.default_plan, "lookup"])
        if name in model.manifest.plans and name not in names
    ]
    for name in names:  # warm-up: every session once
        model.generate(prompts[0], max_new_tokens=8, plan=name, speculate=name is not None)
    seconds = dict.fromkeys(names, 0.0)
    rounds, accepted, drafted, identical = (dict.fromkeys(names[1:], 0) for _ in range(4))
    leaves = {name: [0, 0] for name in names[1:]}  # a model-draft tree's runner-up leaves: drafted, accepted
    for turn, ids in enumerate(prompts):
        order = names if turn % 2 == 0 else names[::-1]
        results = {
            name: model.generate(ids, max_new_tokens=args.max_new_tokens, plan=name, speculate=name is not None)
            for name in order
        }
        for name, result in results.items():
            seconds[name] += result.stats.seconds
            if name is not None:
                rounds[name] += result.stats.rounds
                accepted[name] += result.stats.accepted
                drafted[name] += result.stats.drafted
                identical[name] += result.token_ids == results[None].token_ids
                leaves[name] = [a + b for a, b in zip(leaves[name], result.stats.per_source.get("branch", [0, 0]))]
    print(f"{len(prompts)} prompts ({source}), {args.max_new_tokens} new tokens, in turns; plain {seconds[None]:.1f}s")
    for name in names[1:]:
        print(
            f"{name:28s} {seconds[None] / seconds[name]:.3f}x plain  {(accepted[name] + rounds[name]) / max(rounds[name], 1):.2f} "
            f"tokens/round  acceptance {accepted[name] / max(drafted[name], 1):.2f}  identical {identical[name]}/{len(prompts)}"
            + (f"  leaves accepted {leaves[name][1]}/{leaves[name][0]}" if leaves[name][0] else "")
        )


if __name__ == "__main__":
    main()
