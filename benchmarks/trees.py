"""Chains, token trees and lookahead decoding on one artifact, timed in turns on the backend that runs it.

    python benchmarks/trees.py artifacts/smollm2-onnx                      # the benchmark prompts, 96 new tokens
    python benchmarks/trees.py artifacts/refcoder-onnx --prompts PATH      # (default: the artifact's bench prompts)

Decodes every prompt with: plain decoding; every plan of the artifact (build it with ``--method lookahead``
for the lookup plan, its token-tree pricing, the lookahead and LogitSpec plans); the lookup plan as a token
tree (3 branches per source, up to 12 tokens); the widest tree (the lookup sources, 8 LogitSpec guesses and
a lookahead window, up to 24 tokens: the most tokens per round, whatever its rows cost); lookahead decoding alone (a Jacobi window of W guesses verified in
the same call, and its n-gram pool; ``runtime/lookahead.py``) as a chain and, where the backend verifies
trees, with pooled n-grams as more branches. Each prompt runs every engine once per round, in an order that rotates,
so drift on the machine falls on all of them alike. Prints tokens/s, the ratio to plain decoding, tokens per
round (the verifier's own included), drafted tokens (tree nodes) per round, and whether every output equals
plain decoding token for token. Also prints the backend's verify-cost curve, which decides whether a tree's
extra rows pay.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))


def engines(model, args) -> dict:
    """Plain decoding, every plan of the artifact, the tree variant of its lookup plan, lookahead alone."""
    from speccompile.runtime.manifest import DraftPlan

    out = {"plain": None}
    for name, plan in model.manifest.plans.items():
        out[f"{name}: {plan.describe()}"] = plan
    trees_ok = model.backend.tree_unsupported() is None
    lookup = model.manifest.plans.get("lookup")
    if lookup is not None and trees_ok:
        chain = replace(lookup, lookup_branches=1, tree_nodes=0)
        if lookup.lookup_branches > 1:  # the build chose a tree: time its chain next to it
            out[f"lookup as a chain: {chain.describe()}"] = chain
        else:
            tree = replace(chain, lookup_branches=args.branches, lookup_max_draft=max(chain.lookup_max_draft, 4),
                           tree_nodes=args.tree_nodes)
            out[f"lookup as a tree: {tree.describe()}"] = tree
        wide = replace(chain, lookup=chain.lookup + ["logitspec", "lookahead"], logitspec_top_k=8, lookup_branches=8,
                       lookup_max_draft=max(chain.lookup_max_draft, 4), tree_nodes=args.wide_nodes)
        out[f"the widest tree: {wide.describe()}"] = wide
    for window in args.windows:
        la = DraftPlan(name="lookahead", lookup=["lookahead"], lookahead_window=window, lookahead_ngram=args.ngram)
        out[f"lookahead alone, W={window}, chain"] = la
        if trees_ok:
            out[f"lookahead alone, W={window}, tree of the window and {args.branches} pooled n-grams"] = replace(
                la, lookup_branches=args.branches + 1, tree_nodes=window + args.branches * (args.ngram - 1))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--backend", default=None)
    parser.add_argument("--prompts", default=None, help="prompts file (default: the artifact's bench prompts)")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--windows", type=lambda s: [int(x) for x in s.split(",")], default=[2, 4])
    parser.add_argument("--ngram", type=int, default=2)
    parser.add_argument("--branches", type=int, default=3)
    parser.add_argument("--tree-nodes", type=int, default=12)
    parser.add_argument("--wide-nodes", type=int, default=24, help="node budget of the widest tree (lookup, LogitSpec "
                        "and lookahead branches together)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    from speccompile.bench import load_prompts
    from speccompile.runtime.model import load
    from speccompile.runtime.speculative import DecodeRequest, decode_all

    model = load(args.artifact, backend=args.backend) if args.backend else load(args.artifact)
    texts, source = load_prompts(args.prompts, model.manifest)
    prompts = [model.tokenizer.encode(t) for t in texts]
    plans = engines(model, args)
    names = list(plans)
    seconds = {n: 0.0 for n in names}
    tokens = {n: 0 for n in names}
    rounds = {n: [0, 0, 0] for n in names}  # rounds, accepted, drafted
    outputs: dict[str, list] = {n: [None] * len(prompts) for n in names}
    for warm in prompts[:1]:
        for plan in plans.values():
            decode_all(model.backend, DecodeRequest(warm, 8, eos_ids=model.eos_ids), plan, args.artifact)
    for r in range(args.rounds):
        for i, prompt in enumerate(prompts):
            shift = (r * len(prompts) + i) % len(names)
            for name in names[shift:] + names[:shift]:
                request = DecodeRequest(prompt, args.max_new_tokens, eos_ids=model.eos_ids)
                start = time.perf_counter()
                out, stats = decode_all(model.backend, request, plans[name], args.artifact)
                seconds[name] += time.perf_counter() - start
                tokens[name] += len(out)
                outputs[name][i] = out
                rounds[name][0] += stats.rounds
                rounds[name][1] += stats.accepted
                rounds[name][2] += stats.drafted
    costs = model.manifest.tuning.get("step_costs", {}).get("forward")
    print(f"# {args.artifact.name} on {model.backend.name}: {len(prompts)} prompts ({source}), {args.max_new_tokens} new "
          f"tokens, {args.rounds} rounds in turns")
    if costs:
        print("verify cost / one step: " + ", ".join(f"{k}: {costs[k - 1] / costs[0]:.2f}" for k in (2, 4, 6, 8, 12, 16)
                                                       if k <= len(costs)))
    print("\n| engine | tokens/s | vs plain | tokens / round | drafted / round | identical to plain |")
    print("|---|---|---|---|---|---|")
    rate = {n: tokens[n] / seconds[n] for n in names}
    report = {}
    for name in names:
        n_rounds, accepted, drafted = rounds[name]
        same = sum(a == b for a, b in zip(outputs[name], outputs["plain"]))
        per_round = f"{(accepted + n_rounds) / n_rounds:.2f}" if n_rounds else "-"
        drafted_round = f"{drafted / n_rounds:.2f}" if n_rounds else "-"
        print(f"| {name} | {rate[name]:.1f} | {rate[name] / rate['plain']:.2f}x | {per_round} | {drafted_round} | "
              f"{same}/{len(prompts)} |")
        report[name] = {"tokens_per_s": rate[name], "vs_plain": rate[name] / rate["plain"],
                        "tokens_per_round": (accepted + n_rounds) / n_rounds if n_rounds else None,
                        "drafted_per_round": drafted / n_rounds if n_rounds else None, "identical": same}
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
