"""Exit adapters and reduced draft vocabularies, measured. Run every part under the timing lock:

    flock /tmp/speccompile-timing.lock python benchmarks/experiments/adapter_bench.py loss  [--model smollm2] [--exit-layer 8] [--seconds 120]
    flock /tmp/speccompile-timing.lock python benchmarks/experiments/adapter_bench.py build [--model smollm2] [--exit-layer auto] [--time-budget 420]
    flock /tmp/speccompile-timing.lock python benchmarks/experiments/adapter_bench.py compare   # refcoder: adapter vs shared-head early exit
    flock /tmp/speccompile-timing.lock python benchmarks/experiments/adapter_bench.py form  [--model smollm2] [--exit-layer 8] [--seconds 120]

``loss`` trains the same adapter (same data, same seconds) with the KL and the top-1 loss and prints the
exit agreement each reaches (held-out corpus positions and the calibration continuations) and the
expected speedup: how the default loss was chosen. ``build`` builds an artifact with ``--method adapter``
(ONNX first, so the plan is tuned and confirmed on ONNX Runtime, plus torch), then benches the adapter plan
against plain decoding on both backends with the benchmark prompts and prints the closing table.
``compare`` builds refcoder with ``--method early-exit`` and with ``--method adapter`` and prints both
confirmed speedups. ``form`` trains, on the same data for the same seconds, the shipped adapter (a gated MLP,
no KV) and an attention + MLP block of the model's width (initialised from block E, causal attention over
the chunk, as it would run with its own KV cache) and prints the held-out exit agreement of each: how the
adapter's form was chosen.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent  # benchmarks/ (this script is in benchmarks/experiments/)
REPO = BENCHMARKS.parent
sys.path.insert(0, str(BENCHMARKS))  # smollm2

SMOLLM2_PROMPTS = BENCHMARKS / "data" / "smollm2_prompts.jsonl"
SMOLLM2_CALIBRATION = BENCHMARKS / "data" / "smollm2_calibration.jsonl"


def model_and_data(name: str) -> tuple[str, list[str], str | None]:
    """(model, extra build arguments, prompts file) for smollm2 or refcoder."""
    if name == "smollm2":
        from smollm2 import ensure_model

        return str(ensure_model()), ["--calibration", str(SMOLLM2_CALIBRATION)], str(SMOLLM2_PROMPTS)
    if name == "refcoder":
        return "refcoder", [], None
    sys.exit("--model must be smollm2 or refcoder")


def speccompile(*args: str) -> str:
    command = [sys.executable, "-m", "speccompile.cli", *map(str, args)]
    print("$ speccompile " + " ".join(map(str, args)), file=sys.stderr, flush=True)
    result = subprocess.run(command, stdout=subprocess.PIPE, text=True)
    if result.returncode != 0:
        sys.exit(f"speccompile {args[0]} failed (exit {result.returncode})")
    return result.stdout


# -- loss: KL against top-1, same data and time -------------------------------------------------------
def prepare_data(args):
    """The tuning context, teacher data and training vocabulary the adapter pass would use, at one exit."""
    from transformers import AutoTokenizer

    from speccompile.build import calibration_prompts
    from speccompile.calibration import load_calibration
    from speccompile.convert import arch_config, canonical_weights
    from speccompile.loading import load_source
    from speccompile.passes.adapter import TRAIN_VOCAB, AdapterAutotune, teacher_data, vocab_ranking
    from speccompile.passes.ir import DecoderIR
    from speccompile.passes.tuning import TuningContext

    model, build_extra, _ = model_and_data(args.model)
    source = load_source(model)
    config = arch_config(source.model)
    ir = DecoderIR(config, canonical_weights(source.model, config))
    texts = load_calibration(build_extra[1] if build_extra else None)
    prompts = calibration_prompts(texts, source.tokenizer, config.max_position_embeddings, 80)
    context = TuningContext.prepare(ir, prompts, 64, 8)
    tokenizer = AutoTokenizer.from_pretrained(source.path) if args.model == "smollm2" else source.tokenizer
    chooser = AdapterAutotune(
        context, lambda t: tokenizer(t)["input_ids"], exit_layer=args.exit_layer, tokens=args.tokens
    )
    chunks, holdout = chooser._chunks(256)
    data = teacher_data(ir.decoder(), chunks, [args.exit_layer], holdout)
    continuations = [ref.targets.tolist() for ref in context.references]
    ranking = vocab_ranking(continuations, data.argmax[data.train], config.vocab_size)
    train_vocab = ranking[:TRAIN_VOCAB] if config.vocab_size > TRAIN_VOCAB else None
    return ir, context, data, train_vocab, chunks, holdout


def loss_experiment(args) -> None:
    import torch

    from speccompile.passes.adapter import AdapterTrainer, exit_agreement, write_head
    from speccompile.runtime.artifact.manifest import DraftPlan

    ir, context, data, train_vocab, _, _ = prepare_data(args)
    held = torch.nonzero(~data.train).flatten()
    rows = {}
    shared = DraftPlan.of(name="shared", exit_layer=args.exit_layer)
    rows["shared head"] = (
        exit_agreement(ir.decoder(), data, args.exit_layer, None, held),
        context.profile(shared).match_rate,
        context.score(shared).expected_speedup,
        0.0,
    )
    for loss in ("kl", "top1"):
        trainer = AdapterTrainer(ir.decoder(), data, args.exit_layer, train_vocab, loss)
        log = trainer.train(args.seconds)
        head = trainer.draft_head(None)
        relative = write_head(context, f"loss-{loss}", head)
        plan = DraftPlan.of(
            name=loss, exit_layer=args.exit_layer, head=f"adapter:{args.exit_layer}", draft_head_file=relative
        )
        rows[f"adapter, {loss}"] = (
            exit_agreement(ir.decoder(), data, args.exit_layer, head, held),
            context.profile(plan).match_rate,
            context.score(plan).expected_speedup,
            log.seconds,
        )
    print(
        f"\n{args.model}, exit after block {args.exit_layer}, {int(data.train.sum())} training tokens, "
        f"{len(held)} held out, {args.seconds:.0f}s per loss"
    )
    print("| draft | held-out agreement | calibration agreement | expected speedup | train s |")
    print("|---|---|---|---|---|")
    for name, (held_agree, calib, speedup, seconds) in rows.items():
        print(f"| {name} | {held_agree:.3f} | {calib:.3f} | {speedup:.2f}x | {seconds:.0f} |")


# -- build + bench ----------------------------------------------------------------------------------
def bench(artifact: Path, backend: str, prompts: str | None, plan: str, new_tokens: int) -> dict:
    extra = ["--prompts", prompts] if prompts else []
    out = speccompile(
        "bench",
        artifact,
        "--backend",
        backend,
        "--plan",
        plan,
        "--no-transformers",
        "--json",
        "--max-new-tokens",
        str(new_tokens),
        "--quiet",
        *extra,
    )
    return json.loads(out)


def build_and_bench(args) -> None:
    model, build_extra, prompts = model_and_data(args.model)
    out = args.out_dir / f"{args.model}-adapter"
    start = time.perf_counter()
    speccompile(
        "build",
        model,
        "-o",
        out,
        "--method",
        "adapter",
        "--exit-layer",
        args.exit_layer_text,
        "--backend",
        "onnx,torch",
        "--time-budget",
        str(args.time_budget),
        "--force",
        "--quiet",
        *build_extra,
    )
    build_seconds = time.perf_counter() - start
    manifest = json.loads((out / "manifest.json").read_text())
    plan = manifest["plans"]["adapter"]
    m, a = plan["measured"], plan["measured"]["adapter"]
    reports = {backend: bench(out, backend, prompts, "adapter", args.max_new_tokens) for backend in ("onnx", "torch")}
    print(
        f"\n{args.model}: build {build_seconds:.0f}s, adapter pass {m['tuning_seconds']:.0f}s "
        f"(teacher {a['teacher_seconds']:.0f}s, training {a['train_seconds']:.0f}s, {a['stopped_by']})"
    )
    print(
        "| exit layer | adapter params | draft vocab | training tokens / s | loss | exit agreement before -> after "
        "(calibration) | held out | head cost ratio (model / timed) | confirmed speedup (build, ORT) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    print(
        f"| {a['exit_layer']} | {a['parameters']} | {plan['draft_vocab'] or 'full'} | {a['tokens']} / "
        f"{a['train_seconds']:.0f} | {a['loss']} {a['first_loss']} -> {a['final_loss']} | {a['exit_agreement_before']:.3f} "
        f"-> {a['exit_agreement_after']:.3f} | {a['held_out_agreement_before']} -> {a['held_out_agreement_after']} | "
        f"{m.get('head_cost_ratio', '-')} / {m.get('head_cost_ratio_timed', '-')} | {m.get('confirmed_speedup')}x |"
    )
    print("\n| backend | plain tok/s | adapter tok/s | speedup | mean accepted | identical |")
    print("|---|---|---|---|---|---|")
    for backend, r in reports.items():
        print(
            f"| {backend} | {r['autoregressive']['tokens_per_s']} | {r['speculative']['tokens_per_s']} | "
            f"{r['speedup']['speculative_vs_autoregressive']}x | {r['speculative']['mean_accepted']} | "
            f"{r['identical_detail']['speculative_vs_autoregressive']} |"
        )
    if args.json:
        args.json.write_text(json.dumps({"manifest_plan": plan, "bench": reports}, indent=2))


def compare(args) -> None:
    out = args.out_dir
    rows = {}
    for method in ("early-exit", "adapter"):
        folder = out / f"refcoder-{method}"
        extra = ["--time-budget", str(args.time_budget)] if method == "adapter" else []
        speccompile(
            "build", "refcoder", "-o", folder, "--method", method, "--backend", "onnx", "--force", "--quiet", *extra
        )
        manifest = json.loads((folder / "manifest.json").read_text())
        for name, plan in manifest["plans"].items():
            rows[f"{method}: {name}"] = plan
    print(
        "\n| plan | exit layer | draft vocab | acceptance | expected | confirmed speedup (ORT) | confirmed mean accepted |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, plan in rows.items():
        m = plan["measured"]
        print(
            f"| {name} | {plan['exit_layer']} | {plan['draft_vocab'] or 'full'} | {m['acceptance_rate']} | "
            f"{m['expected_speedup']}x | {m.get('confirmed_speedup')}x | {m.get('confirmed_mean_accepted')} |"
        )


def form_experiment(args) -> None:
    import copy

    import torch
    import torch.nn.functional as F

    from speccompile.passes.adapter import AdapterTrainer, exit_agreement
    from speccompile.runtime.backends.torch.decoder import Positions

    ir, context, data, train_vocab, chunks, holdout = prepare_data(args)
    decoder, E = ir.decoder(), args.exit_layer
    lengths = [len(c) for c in chunks]
    held = torch.nonzero(~data.train).flatten()
    results = {"shared head": exit_agreement(decoder, data, E, None, held)}
    mlp = AdapterTrainer(decoder, data, E, train_vocab, "kl")
    mlp.train(args.seconds, max_epochs=1000)
    results["gated MLP adapter (shipped)"] = exit_agreement(decoder, data, E, mlp.draft_head(None), held)

    # An attention + MLP block of the model's width, initialised from block E, trained on whole chunks.
    block = copy.deepcopy(decoder.layers[E])
    block.load_state_dict({k: v.clone() for k, v in decoder.layers[E].state_dict().items()})
    block.requires_grad_(True).train()
    kernel = mlp.kernel.__class__(decoder, None, train_vocab)  # final norm + the training-vocabulary head rows
    starts = torch.tensor([0] + lengths).cumsum(0)
    index = mlp.target_index

    def run_block(h):
        t = h.shape[1]
        q, k, v = block.attn.project(block.attn_norm(h), decoder.rope_at(Positions.of(0, t, h.device, None)))
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=decoder.config.scale, enable_gqa=block.attn.n_kv != block.attn.n_heads
        )
        h = h + block.attn.o(out.transpose(1, 2).reshape(1, t, -1))
        return h + block.mlp(block.mlp_norm(h))

    train_chunks = [c for c in range(len(chunks)) if c not in holdout]
    optimizer = torch.optim.AdamW([p for p in block.parameters()], lr=5e-4)
    start, steps = time.perf_counter(), 0
    gen = torch.Generator().manual_seed(0)
    while time.perf_counter() - start < args.seconds:
        c = train_chunks[int(torch.randint(len(train_chunks), (1,), generator=gen))]
        rows = torch.arange(starts[c], starts[c + 1])
        logq = F.log_softmax(kernel(run_block(data.hidden[E][rows][None]))[0].float(), -1)
        present = index[rows] >= 0
        p = data.top_logprobs[rows].exp() * present
        p = p / p.sum(-1, keepdim=True).clamp(min=1e-9)
        loss = (torch.special.xlogy(p, p) - p * logq.gather(1, index[rows].clamp(min=0))).sum(-1).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        steps += 1
    hits = total = 0
    full = mlp.kernel.__class__(decoder, None, None)
    with torch.no_grad():
        for c in sorted(holdout):
            rows = torch.arange(starts[c], starts[c + 1])
            hits += int((full(run_block(data.hidden[E][rows][None]))[0].argmax(-1) == data.argmax[rows]).sum())
            total += len(rows)
    results[f"attention + MLP block ({steps} chunk steps)"] = hits / max(total, 1)
    print(
        f"\n{args.model}, exit after block {E}, {int(data.train.sum())} training tokens, {len(held)} held out, "
        f"{args.seconds:.0f}s each"
    )
    print("| draft at the exit | held-out exit agreement |\n|---|---|")
    for name, value in results.items():
        print(f"| {name} | {value:.3f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", choices=["loss", "build", "compare", "form"])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--exit-layer", default=None)
    parser.add_argument("--seconds", type=float, default=120.0, help="loss: training seconds per loss")
    parser.add_argument("--tokens", type=int, default=32768, help="loss: training tokens")
    parser.add_argument("--time-budget", type=float, default=420.0, help="build/compare: the adapter pass's budget")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--out-dir", type=Path, default=REPO / "artifacts")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.part in ("loss", "form"):
        args.exit_layer = int(args.exit_layer or 8)
        (loss_experiment if args.part == "loss" else form_experiment)(args)
    elif args.part == "build":
        args.exit_layer_text = args.exit_layer or "auto"
        build_and_bench(args)
    else:
        compare(args)


if __name__ == "__main__":
    main()
