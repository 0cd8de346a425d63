"""Are quantized (and fp32 fused) ONNX artifacts lossless on the real model, and what does that cost?

    flock /tmp/speccompile-timing.lock python benchmarks/experiments/quantized_lossless.py [--variants int4,int4-unpadded,...]
        [--max-new-tokens 96] [--rounds 1] [--limit N] [--out-dir artifacts/quantized-lossless] [--json FILE]

SmolLM2-135M-Instruct (``benchmarks/smollm2.py`` sets it up) is exported once per variant into
``--out-dir`` with the same exporter ``speccompile build --backend onnx [--quantize ...]`` runs, next to a
lookup plan (n-gram 5..1, one token after a match of <= 1 token: the drafts the ONNX build keeps on this
model; no model subgraph, so every round is verified by the full graph). ``int4`` / ``int8`` / ``fp32``
are today's graphs; ``-unpadded`` is the graph form before padding (GroupQueryAttention on exactly the
call's rows, so one-token steps take MLAS's one-row kernel: see ``exporters/onnx_fused.FusedGraph.padding``);
``int4-products-unpadded`` pads attention but not the products, whatever the build's CPU measures
(``Quantizer.one_row_path_differs``: where it finds a one-row MatMulNBits kernel, ``int4`` pads them);
``int4-fp32act`` is MatMulNBits ``accuracy_level`` 1 (fp32 activations), the other candidate fix.

For every prompt (the real-model benchmark's 12 and the 10 below), every variant decodes it plainly and
speculatively (greedy, ``--max-new-tokens``), the variants in turns, the order rotating per prompt: this
machine's speed drifts by 10-40% between minutes and other processes share its two cores, so only the
ratios between variants of one run mean anything. Per variant: plain and speculative tokens/s, speculative
outputs identical to plain, and at each divergence the top-2 logit gap of the variant's own plain logits
(one prefill call over prompt + output so far) with the near-tie rule of docs/design.md section 6 (1e-4);
and the largest logit difference between one 4-token call and four 1-token steps over the same positions
(the first prompt's output), which is what decides whether a verify is the step it replaces.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import numpy as np

BENCHMARKS = Path(__file__).resolve().parent.parent  # benchmarks/ (this script is in benchmarks/experiments/)
REPO = BENCHMARKS.parent
sys.path.insert(0, str(BENCHMARKS))  # smollm2

NEAR_TIE = 1e-4  # docs/design.md section 6
VARIANTS = {
    "int4": {"variant": "fused", "quantize": "int4"},
    "int4-unpadded": {"variant": "fused", "quantize": "int4", "pad_rows": False},
    "int4-products-unpadded": {"variant": "fused", "quantize": "int4", "pad_products": False},
    "int8": {"variant": "fused", "quantize": "int8"},
    "int8-unpadded": {"variant": "fused", "quantize": "int8", "pad_rows": False},
    "int4-fp32act": {"variant": "fused", "quantize": "int4", "accuracy_level": 1, "pad_rows": False},
    "fp32": {"variant": "fused"},
    "fp32-unpadded": {"variant": "fused", "pad_rows": False},
}
SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
# Ten prompts that are not the benchmark's: five code, five prose.
OTHER_PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number iteratively, with a docstring.",
    "Explain what this does and suggest a clearer name:\n\n```python\ndef f(xs):\n    return [x for x in xs if x]\n```",
    "Write a SQL query that lists the five customers with the highest total order value.",
    "Convert this JavaScript to Python:\n\n```js\nconst total = items.reduce((sum, item) => sum + item.price, 0);\n```",
    "Write a bash one-liner that counts the lines of every .py file in a folder, largest first.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What are three differences between weather and climate?",
    "Give me a packing list for a two-day hiking trip in the mountains.",
    "Summarise the causes of the French Revolution in one paragraph.",
    "Write a polite email declining an invitation to a conference talk.",
]
PLAN = {
    "name": "lookup",
    "lookup": ["ngram"],
    "lookup_max_draft": 8,
    "sources": {"ngram": {"min": 1, "max": 5, "short": 1}},
}


def chat(user: str) -> str:
    return f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


def prompts() -> list[str]:
    bench = [
        json.loads(line)["prompt"]
        for line in (BENCHMARKS / "data" / "smollm2_prompts.jsonl").read_text().splitlines()
        if line.strip()
    ]
    return bench + [chat(p) for p in OTHER_PROMPTS]


def export_variants(names: list[str], out_dir: Path) -> dict[str, Path]:
    """One artifact folder per variant (exported unless it exists): onnx/ + tokenizer/ + manifest."""
    import torch
    from smollm2 import ensure_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from speccompile.convert import arch_config, canonical_weights
    from speccompile.exporters.onnx_export import export_onnx_weights
    from speccompile.runtime.artifact.manifest import DraftPlan, Manifest, file_record, write_manifest

    folder = ensure_model()
    roots = {name: out_dir / name for name in names}
    missing = [name for name, root in roots.items() if not (root / "manifest.json").is_file()]
    if missing:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        config = arch_config(model)
        weights = {k: v.numpy() for k, v in canonical_weights(model, config).items()}
        tokenizer = AutoTokenizer.from_pretrained(folder)
        eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
        for name in missing:
            root = roots[name]
            shutil.rmtree(root, ignore_errors=True)
            tokenizer.save_pretrained(root / "tokenizer")
            print(f"exporting {name} ...", file=sys.stderr, flush=True)
            record = export_onnx_weights(config, weights, {}, root / "onnx", "float32", **VARIANTS[name])
            files = {
                str(p.relative_to(root)): file_record(root, str(p.relative_to(root)))
                for p in sorted(root.rglob("*"))
                if p.is_file()
            }
            plan = DraftPlan.of(**PLAN)
            write_manifest(
                root,
                Manifest(
                    config=config,
                    plans={plan.name: plan},
                    default_plan=plan.name,
                    files=files,
                    backends={"onnx": record},
                    source={"path": str(folder)},
                    tokens={"eos_token_ids": sorted({eos, tokenizer.eos_token_id})},
                ),
            )
    return roots


def top2_gap(backend, tokens: list[int]) -> float:
    backend.reserve(len(tokens) + 1)
    top = np.sort(backend.forward(tokens, 0)[-1])[-2:]
    return float(top[1] - top[0])


def verify_vs_steps(backend, tokens: list[int], k: int = 4) -> float:
    """Largest |logit| difference between one k-token call and k one-token steps at the same positions."""
    backend.reserve(len(tokens) + 1)
    backend.forward(tokens[:-k], 0)
    together = backend.forward(tokens[-k:], len(tokens) - k)
    apart = np.stack([backend.forward([t], len(tokens) - k + j)[-1] for j, t in enumerate(tokens[-k:])])
    return float(np.abs(together - apart).max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default="int4,int4-unpadded,int8,int8-unpadded")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=1, help="times every prompt is decoded by every variant")
    parser.add_argument("--limit", type=int, default=None, help="only the first N prompts")
    parser.add_argument("--out-dir", type=Path, default=REPO / "artifacts" / "quantized-lossless")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    from speccompile.runtime import load

    names = args.variants.split(",")
    roots = export_variants(names, args.out_dir)
    models = {name: load(roots[name], backend="onnx") for name in names}
    texts = prompts()[: args.limit]
    ids = [models[names[0]].encode_prompt(t) for t in texts]
    for m in models.values():  # warm-up
        m.generate(ids[0], max_new_tokens=8, speculate=False)
        m.generate(ids[0], max_new_tokens=8)
    results = {
        name: {"plain": [], "spec": [], "plain_s": 0.0, "spec_s": 0.0, "tokens": 0, "spec_tokens": 0} for name in names
    }
    for r in range(args.rounds):
        for p, prompt_ids in enumerate(ids):
            order = names[(p + r) % len(names) :] + names[: (p + r) % len(names)]
            for name in order:
                m, res = models[name], results[name]
                plain = m.generate(prompt_ids, max_new_tokens=args.max_new_tokens, speculate=False)
                spec = m.generate(prompt_ids, max_new_tokens=args.max_new_tokens)
                res["plain_s"] += plain.stats.seconds
                res["spec_s"] += spec.stats.seconds
                res["tokens"] += plain.stats.new_tokens
                res["spec_tokens"] += spec.stats.new_tokens
                if r == 0:
                    res["plain"].append(plain.token_ids)
                    res["spec"].append(spec.token_ids)
            print(f"round {r} prompt {p + 1}/{len(ids)} done", file=sys.stderr, flush=True)
    report = {"prompts": len(ids), "max_new_tokens": args.max_new_tokens, "rounds": args.rounds, "variants": {}}
    for name in names:
        res, backend = results[name], models[name].backend
        divergences = []
        for p, (plain, spec) in enumerate(zip(res["plain"], res["spec"])):
            if plain != spec:
                i = next((k for k, (a, b) in enumerate(zip(plain, spec)) if a != b), min(len(plain), len(spec)))
                gap = top2_gap(backend, ids[p] + plain[:i])
                divergences.append({"prompt": p, "at": i, "gap": gap, "near_tie": gap < NEAR_TIE})
        rounding = verify_vs_steps(backend, ids[0] + res["plain"][0][:24])
        report["variants"][name] = {
            "options": VARIANTS[name],
            "plain_tokens_per_s": round(res["tokens"] / res["plain_s"], 2),
            "speculative_tokens_per_s": round(res["spec_tokens"] / res["spec_s"], 2),
            "speedup": round((res["spec_tokens"] / res["spec_s"]) / (res["tokens"] / res["plain_s"]), 3),
            "identical": f"{len(ids) - len(divergences)}/{len(ids)}",
            "near_tie_divergences": sum(d["near_tie"] for d in divergences),
            "real_divergences": sum(not d["near_tie"] for d in divergences),
            "divergences": divergences,
            "max_verify_vs_steps": rounding,
        }
    base = names[0]
    print(
        f"{len(ids)} prompts, {args.max_new_tokens} new tokens, {args.rounds} round(s), variants in turns; "
        f"tokens/s relative to {base} plain in the last column"
    )
    for name, v in report["variants"].items():
        rel = v["plain_tokens_per_s"] / report["variants"][base]["plain_tokens_per_s"]
        print(
            f"  {name:15s} plain {v['plain_tokens_per_s']:7.1f}  speculative {v['speculative_tokens_per_s']:7.1f} "
            f"({v['speedup']:.2f}x)  identical {v['identical']:6s} (near-tie {v['near_tie_divergences']}, real "
            f"{v['real_divergences']})  |4-token - 4 steps| {v['max_verify_vs_steps']:.1e}  plain {rel:.2f}x {base}"
        )
        for d in v["divergences"]:
            print(f"      prompt {d['prompt']}: first divergence at token {d['at']}, top-2 gap {d['gap']:.2e}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
