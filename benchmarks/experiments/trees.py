"""Chains, token trees and lookahead decoding on one artifact, timed in turns on the backend that runs it.

    python benchmarks/experiments/trees.py artifacts/smollm2-onnx                      # the benchmark prompts, 96 new tokens
    python benchmarks/experiments/trees.py artifacts/refcoder-onnx --prompts PATH      # (default: the artifact's bench prompts)

Decodes every prompt with: plain decoding; every plan of the artifact (build it with ``--method lookahead``
for the lookup plan, its token-tree pricing, the lookahead and LogitSpec plans); the lookup plan as a token
tree (3 branches per source, up to 12 tokens); wide trees (the lookup sources, LogitSpec guesses, a
lookahead window and Token Recycling's successors; ``--wide 24/8/8,64/16/12``: node budget / LogitSpec top-k / branches per source, default
24 nodes with 8 guesses and 8 branches: the most tokens per round, whatever the rows cost); Token Recycling alone (``runtime/drafting/recycling.py``: the verifier's
earlier top tokens after each token, as a chain and a tree of 8); lookahead decoding alone (a Jacobi window of W guesses verified in
the same call, and its n-gram pool; ``runtime/drafting/lookahead.py``) as a chain and, where the backend verifies
trees, with pooled n-grams as more branches. Each prompt runs every engine once per round, in an order that rotates,
so drift on the machine falls on all of them alike. Prints tokens/s, the ratio to plain decoding, tokens per
round (the verifier's own included), drafted tokens (tree nodes) per round, and whether every output equals
plain decoding token for token. Also prints the backend's verify-cost curve, which decides whether a tree's
extra rows pay; ``--tree-cost`` times tree verifies against chain verifies of as many rows, ``--premise``
how often the token two ahead is among a position's other top-k tokens (LogitSpec's premise).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

from speccompile.runtime.drafting import describe

REPO = Path(__file__).resolve().parent.parent.parent  # this script is in benchmarks/experiments/
sys.path.insert(0, str(REPO))


def engines(model, args) -> dict:
    """Plain decoding, every plan of the artifact, the tree variant of its lookup plan, lookahead alone."""
    from speccompile.runtime.artifact.manifest import DraftPlan

    out = {"plain": None}
    for name, plan in model.manifest.plans.items():
        out[f"{name}: {describe(plan)}"] = plan
    trees_ok = model.backend.tree_unsupported() is None
    lookup = model.manifest.plans.get("lookup")
    if lookup is not None and trees_ok:
        chain = replace(lookup, lookup_branches=1, tree_nodes=0)
        if lookup.lookup_branches > 1 and "lookup-chain" not in model.manifest.plans:  # time a tree's chain next to it
            out[f"lookup as a chain: {describe(chain)}"] = chain
        else:
            tree = replace(
                chain,
                lookup_branches=args.branches,
                lookup_max_draft=max(chain.lookup_max_draft, 4),
                tree_nodes=args.tree_nodes,
            )
            out[f"lookup as a tree: {describe(tree)}"] = tree
        for nodes, top_k, branches in args.wide:
            wide = replace(
                chain.with_options(logitspec={"top_k": top_k}),
                lookup=chain.lookup + ["logitspec", "lookahead", "recycling"],
                lookup_branches=branches,
                lookup_max_draft=max(chain.lookup_max_draft, 4),
                tree_nodes=nodes,
            )
            out[f"a wide tree ({nodes} nodes): {describe(wide)}"] = wide
    recycling = DraftPlan.of(name="recycling", lookup=["recycling"], lookup_max_draft=4)
    out["Token Recycling alone, chain"] = recycling
    if trees_ok:
        out["Token Recycling alone, tree of 8"] = replace(recycling, lookup_branches=4, tree_nodes=8)
    for window in args.windows:
        la = DraftPlan.of(
            name="lookahead", lookup=["lookahead"], sources={"lookahead": {"window": window, "ngram": args.ngram}}
        )
        out[f"lookahead alone, W={window}, chain"] = la
        if trees_ok:
            out[f"lookahead alone, W={window}, tree of the window and {args.branches} pooled n-grams"] = replace(
                la, lookup_branches=args.branches + 1, tree_nodes=window + args.branches * (args.ngram - 1)
            )
    return out


def tree_cost(backend, context: int = 128, repeats: int = 15) -> None:
    """A tree verify against a chain verify of as many rows (after ``context`` cached positions, best of
    ``repeats``): whether the step-cost curve the build measured on chains prices trees too."""
    import numpy as np

    from speccompile.passes.cost_model import _best_seconds

    backend.reserve(context + 32)
    rng = np.random.default_rng(0)
    backend.forward(rng.integers(0, 1000, context).tolist(), 0)

    def best(call) -> float:
        return min(_best_seconds(call) for _ in range(repeats))

    step = best(lambda: backend.forward([5], context))
    print("\n| rows | chain verify / step | tree verify / step | tree / chain |\n|---|---|---|---|")
    for t in (4, 8, 12, 17, 25):
        tokens = rng.integers(0, 1000, t).tolist()
        parents = [-1] + [int(rng.integers(-1, i)) for i in range(1, t - 1)]  # a random tree of t - 1 nodes
        chain = best(lambda: backend.forward(tokens, context))
        tree = best(lambda: backend.forward_tree(tokens, parents, context))
        print(f"| {t} | {chain / step:.2f}x | {tree / step:.2f}x | {tree / chain:.3f} |")


def logitspec_premise(backend, sequences: list[tuple[list[int], int]]) -> None:
    """How often the token two ahead is among the other top-k tokens of a position's logits (LogitSpec's
    premise), over the plain outputs."""
    import numpy as np

    ks, hits, total = (1, 2, 4, 8, 16), {k: 0 for k in (1, 2, 4, 8, 16)}, 0
    for tokens, prompt_len in sequences:
        backend.reserve(len(tokens) + 1)
        logits = backend.forward(tokens, 0)
        for i in range(prompt_len - 1, len(tokens) - 2):
            top = np.argsort(-logits[i])[:17].tolist()
            others = [t for t in top if t != tokens[i + 1]]
            total += 1
            for k in ks:
                hits[k] += tokens[i + 2] in others[:k]
    print(
        f"\nLogitSpec's premise, over {total} positions of the plain outputs: the token two ahead is among the "
        "other top-k of a position's logits " + ", ".join(f"top {k} {hits[k] / total:.1%}" for k in ks)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--backend", default=None)
    parser.add_argument("--prompts", default=None, help="prompts file (default: the artifact's bench prompts)")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument(
        "--rounds", type=int, default=2, help="rounds in turns (0: only plain outputs, for --premise and --tree-cost)"
    )
    parser.add_argument("--windows", type=lambda s: [int(x) for x in s.split(",")], default=[2, 4])
    parser.add_argument("--ngram", type=int, default=2)
    parser.add_argument("--branches", type=int, default=3)
    parser.add_argument("--tree-nodes", type=int, default=12)
    parser.add_argument(
        "--wide",
        type=lambda s: [tuple(int(x) for x in w.split("/")) for w in s.split(",")],
        default=[(24, 8, 8)],
        help="wide trees to time, each NODES/LOGITSPEC_TOP_K/BRANCHES, comma separated (default 24/8/8)",
    )
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--tree-cost", action="store_true", help="also time tree against chain verifies of as many rows"
    )
    parser.add_argument("--premise", action="store_true", help="also print LogitSpec's premise on the plain outputs")
    args = parser.parse_args()

    from speccompile.bench import load_prompts
    from speccompile.runtime.decoding.speculative import DecodeRequest, decode_all
    from speccompile.runtime.model import load

    model = load(args.artifact, backend=args.backend) if args.backend else load(args.artifact)
    texts, source = load_prompts(args.prompts, model.manifest)
    prompts = [model.tokenizer.encode(t) for t in texts]
    plans = engines(model, args) if args.rounds > 0 else {"plain": None}  # --rounds 0: the extra checks only
    names = list(plans)
    seconds = {n: 0.0 for n in names}
    tokens = {n: 0 for n in names}
    rounds = {n: [0, 0, 0] for n in names}  # rounds, accepted, drafted
    outputs: dict[str, list] = {n: [None] * len(prompts) for n in names}
    for warm in prompts[:1]:
        for plan in plans.values():
            decode_all(model.backend, DecodeRequest(warm, 8, eos_ids=model.eos_ids), plan, args.artifact)
    for r in range(max(args.rounds, 1)):
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
    print(
        f"# {args.artifact.name} on {model.backend.name}: {len(prompts)} prompts ({source}), {args.max_new_tokens} new "
        f"tokens, {args.rounds} rounds in turns"
    )
    if costs:
        print(
            "verify cost / one step: "
            + ", ".join(f"{k}: {costs[k - 1] / costs[0]:.2f}" for k in (2, 4, 6, 8, 12, 16) if k <= len(costs))
        )
    if args.rounds == 0:
        names = []
    else:
        print("\n| engine | tokens/s | vs plain | tokens / round | drafted / round | identical to plain |")
        print("|---|---|---|---|---|---|")
    rate = {n: tokens[n] / seconds[n] for n in names}
    report = {}
    for name in names:
        n_rounds, accepted, drafted = rounds[name]
        same = sum(a == b for a, b in zip(outputs[name], outputs["plain"]))
        per_round = f"{(accepted + n_rounds) / n_rounds:.2f}" if n_rounds else "-"
        drafted_round = f"{drafted / n_rounds:.2f}" if n_rounds else "-"
        print(
            f"| {name} | {rate[name]:.1f} | {rate[name] / rate['plain']:.2f}x | {per_round} | {drafted_round} | "
            f"{same}/{len(prompts)} |"
        )
        report[name] = {
            "tokens_per_s": rate[name],
            "vs_plain": rate[name] / rate["plain"],
            "tokens_per_round": (accepted + n_rounds) / n_rounds if n_rounds else None,
            "drafted_per_round": drafted / n_rounds if n_rounds else None,
            "identical": same,
        }
    if args.premise:
        logitspec_premise(model.backend, [(p + out, len(p)) for p, out in zip(prompts, outputs["plain"])])
    if args.tree_cost and model.backend.tree_unsupported() is None:
        tree_cost(model.backend)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
