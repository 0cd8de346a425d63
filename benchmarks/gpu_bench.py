"""The benches and the table of ``benchmarks/gpu_check.sh``: every engine on the same GPU, same prompts.

    python benchmarks/gpu_bench.py rows ARTIFACT --model NAME --dtype float16 --prompts FILE [--n 8]
        [--new-tokens 64] [--engines torch-graphs,torch-graphs-host,torch,onnx,tensorrt,transformers]
        >> rows.jsonl
    python benchmarks/gpu_bench.py table rows.jsonl [--out table.txt]   (no rows file: the empty layout)
    python benchmarks/gpu_bench.py results --out results.json [--shapes S.json ...] [--rows rows.jsonl]
        [--steps steps.jsonl] [--info info.json]      (gpu_check.sh's one results JSON, and its tables printed)
    python benchmarks/gpu_bench.py batch ARTIFACT --model NAME --dtype D --prompts FILE [--streams 1,4,16]
        >> batch.jsonl     (batched rounds on torch-CUDA: N sequences at once, plain and speculative)

``results`` gathers what ``gpu_check.sh`` measured into one JSON (``rows``: every ``gpu_shapes.py`` row, every
``rows`` line as ``kind: "refcoder"``, every step's status as ``kind: "step"``) and prints the tables.

``rows`` prints one JSON line per engine, each measured in this one process (the artifact loaded once per
engine, warmed up first): the runtime decoding the prompts plainly and speculatively (torch on CUDA with
CUDA graphs and the device-resident round, the same with the host round, eager torch, ONNX Runtime's CUDA
provider, TensorRT), and transformers ``generate()`` on the source model (plain greedy, and its prompt
lookup as the "speculative" column). Prompts are tokenized once by the artifact's tokenizer, so every
engine decodes the same ids. An engine that fails is a row with its error, and the next one still runs
(TensorRT last: a crash there loses nothing else).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

ENGINES = {  # name -> (runtime backend, CUDA graphs, device round); transformers is not a runtime backend
    "torch-graphs": ("torch", "1", "1"),
    "torch-graphs-host": ("torch", "1", "0"),
    "torch": ("torch", "0", "1"),
    "onnx": ("onnx", "0", "0"),
    "tensorrt": ("tensorrt", "0", "0"),
}
LABELS = {
    "transformers": "transformers generate()",
    "torch-graphs": "torch-cuda graphs",
    "torch-graphs-host": "torch-cuda graphs, host round",
    "torch": "torch-cuda eager",
    "onnx": "ORT-CUDA",
    "tensorrt": "TensorRT",
}
PROMPT_LOOKUP_TOKENS = 10  # as speccompile bench's prompt-lookup baseline


def read_prompts(path: str, n: int) -> list[str]:
    texts = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            item = json.loads(line)
            texts.append(item.get("prompt") or item.get("text"))
    return texts[:n]


def timed(decode, prompts) -> tuple[list[list[int]], float]:
    """``decode(ids) -> new token ids`` over every prompt: the outputs and the seconds they took."""
    outputs, seconds = [], 0.0
    for ids in prompts:
        start = time.perf_counter()
        outputs.append(decode(ids))
        seconds += time.perf_counter() - start
    return outputs, seconds


def runtime_row(artifact: str, engine: str, prompts: list[list[int]], new_tokens: int, device: str) -> dict:
    """Plain and speculative decoding of the artifact's default plan on one engine."""
    from speccompile.runtime import load

    backend, graphs, on_device = ENGINES[engine]
    os.environ["SPECCOMPILE_CUDA_GRAPHS"], os.environ["SPECCOMPILE_DEVICE_ROUND"] = graphs, on_device
    model = load(artifact, backend=backend, device=device)
    stats = []

    def run(speculate: bool):
        def decode(ids):
            result = model.generate(ids, max_new_tokens=new_tokens, speculate=speculate)
            if speculate:
                stats.append(result.stats)
            return result.token_ids

        return decode

    longest = max(prompts, key=len)  # warm-up on the longest prompt: the cache reserved at its final size,
    for speculate in (False, True):  # CUDA graphs captured, TensorRT contexts and ORT kernels ready
        run(speculate)(longest)
    stats.clear()
    # in turns, prompt by prompt, the order alternating: drift between minutes falls on both alike
    plain, spec, plain_s, spec_s = [], [], 0.0, 0.0
    for i, ids in enumerate(prompts):
        for speculate in (False, True) if i % 2 == 0 else (True, False):
            out, seconds = timed(run(speculate), [ids])
            (spec if speculate else plain).extend(out)
            if speculate:
                spec_s += seconds
            else:
                plain_s += seconds
    rounds, accepted = sum(s.rounds or 0 for s in stats), sum(s.accepted for s in stats)
    tokens = sum(map(len, spec))
    return {
        "plain_tps": sum(map(len, plain)) / plain_s,
        "spec_tps": tokens / spec_s,
        "mean_accepted": (accepted + rounds) / max(rounds, 1),
        "identical": plain == spec,
        "outputs": plain,
        "plan": model.manifest.default_plan,
    }


def transformers_row(
    source: str, dtype: str, prompts: list[list[int]], new_tokens: int, eos: list[int], device: str
) -> dict:
    """transformers ``generate()`` (greedy) on the source model, on the GPU; its prompt lookup as "speculative"."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(source, dtype=getattr(torch, dtype)).to(device).eval()
    pad = eos[0] if eos else 0

    def run(**extra):
        config = GenerationConfig(
            max_new_tokens=new_tokens, do_sample=False, num_beams=1, eos_token_id=eos or None, pad_token_id=pad, **extra
        )

        @torch.inference_mode()
        def decode(ids):
            tokens = torch.tensor([ids], device=device)
            out = model.generate(tokens, attention_mask=torch.ones_like(tokens), generation_config=config)
            return out[0, len(ids) :].tolist()

        return decode

    lookup = {"prompt_lookup_num_tokens": PROMPT_LOOKUP_TOKENS}
    for warm_up in (run(), run(**lookup)):
        warm_up(prompts[0][:16])
    plain, plain_s = timed(run(), prompts)
    spec, spec_s = timed(run(**lookup), prompts)
    return {
        "plain_tps": sum(map(len, plain)) / plain_s,
        "spec_tps": sum(map(len, spec)) / spec_s,
        "mean_accepted": None,
        "identical": plain == spec,
        "outputs": plain,
    }


def batch_rows(args) -> None:
    """Batched rounds (``runtime/decoding/batch.py``) on the GPU: N sequences at once, plain and speculative, each
    output against its own batch-1 plain output; one JSON line per (mode, N)."""
    from speccompile.runtime import load
    from speccompile.runtime.decoding.batch import BatchDecoder
    from speccompile.runtime.decoding.load import CallCosts, longest_draft
    from speccompile.runtime.decoding.speculative import DecodeRequest

    model = load(args.artifact, backend="torch", device=args.device)
    prompts = [model.encode_prompt(text) for text in read_prompts(args.prompts, args.n)]
    eos = model.manifest.eos_ids
    alone = [model.generate(ids, max_new_tokens=args.new_tokens, speculate=False).token_ids for ids in prompts]
    # the default plan; where none beat plain decoding at build, the first plan (the check is of the round)
    plan = model.draft_plan() or next(iter(model.manifest.plans.values()), None)
    counts = [int(n) for n in args.streams.split(",")]
    costs = None
    if plan is not None and max(counts) > 1:  # what the load policy prices drafts with, timed on this GPU
        costs = CallCosts.measure(model.backend, max_rows=max(counts), max_width=longest_draft(plan) + 1)
    for streams in counts:
        for mode, chosen in (("plain", None), ("speculative", plan)):
            engine = BatchDecoder(model.backend, max_batch=max(streams, 2), costs=costs, root=model.root)
            outputs: dict[int, list[int]] = {}
            live: dict[int, object] = {}
            waiting = list(range(len(prompts)))
            start = time.perf_counter()
            while waiting or live:
                while waiting and len(live) < streams:
                    i = waiting.pop(0)
                    live[i] = engine.add(DecodeRequest(prompts[i], args.new_tokens, eos_ids=eos), chosen)
                    outputs[i] = []
                owner = {id(s): i for i, s in live.items()}
                for seq, new in engine.step():
                    outputs[owner[id(seq)]].extend(new)
                for i, seq in list(live.items()):
                    if seq.finished:
                        engine.remove(seq)
                        del live[i]
            seconds = time.perf_counter() - start
            tokens = sum(map(len, outputs.values()))
            same = sum(outputs[i] == alone[i] for i in range(len(prompts)))
            row = {"model": args.model, "dtype": args.dtype, "mode": mode, "streams": streams}
            row["plan"] = None if chosen is None else chosen.name
            row.update({"tokens_per_s": tokens / seconds, "identical": f"{same}/{len(prompts)}"})
            print(json.dumps(row), flush=True)


def rows(args) -> None:
    from speccompile.runtime import load

    opened = load(args.artifact)  # tokenizer and manifest only matter here; CPU is enough
    prompts = [opened.encode_prompt(text) for text in read_prompts(args.prompts, args.n)]
    source = opened.manifest.source.get("path", "")
    for engine in args.engines.split(","):
        row = {"model": args.model, "dtype": args.dtype, "engine": engine}
        start = time.perf_counter()
        try:
            if engine == "transformers":
                eos = sorted(opened.manifest.eos_ids)
                row.update(transformers_row(source, args.dtype, prompts, args.new_tokens, eos, args.device))
            elif ENGINES[engine][0] not in opened.manifest.backends:
                row["error"] = f"not built ({ENGINES[engine][0]} missing from the artifact)"
            else:
                row.update(runtime_row(args.artifact, engine, prompts, args.new_tokens, args.device))
        except Exception as error:  # one engine's failure is its row; the others still run
            row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:160] if str(error) else ''}"
            traceback.print_exc(file=sys.stderr)
        row["seconds"] = round(time.perf_counter() - start, 1)
        print(json.dumps(row), flush=True)


COLUMNS = (
    ("model", 9),
    ("dtype", 8),
    ("engine", 30),
    ("plain tok/s", 11),
    ("spec tok/s", 10),
    ("spec/plain", 10),
    ("vs generate()", 13),
    ("mean acc", 8),
    ("spec==plain", 11),
    ("plain==generate()", 17),
)


def table(rows_file: str | None) -> str:
    """The table: one line per (model, dtype, engine); speed against plain decoding on the same engine and
    against transformers generate() of the same model and dtype; whether speculative output equals plain
    output (the lossless claim) and whether plain output equals transformers greedy output."""
    rows = [json.loads(line) for line in Path(rows_file).read_text().splitlines() if line.strip()] if rows_file else []
    reference = {(r["model"], r["dtype"]): r for r in rows if r["engine"] == "transformers" and "error" not in r}
    lines = ["  ".join(f"{name:>{width}}" if i > 2 else f"{name:{width}}" for i, (name, width) in enumerate(COLUMNS))]
    for r in sorted(rows, key=lambda r: (r["model"], r["dtype"], list(LABELS).index(r["engine"]))):
        head = f"{r['model']:9}  {r['dtype']:8}  {LABELS[r['engine']]:30}"
        if "error" in r:
            lines.append(f"{head}  {r['error']}")
            continue
        ref = reference.get((r["model"], r["dtype"]))
        versus = f"{r['spec_tps'] / ref['plain_tps']:12.2f}x" if ref else f"{'-':>13}"
        same = "-" if ref is None else ("yes" if r["outputs"] == ref["outputs"] else "no")
        accepted = "-" if r["mean_accepted"] is None else f"{r['mean_accepted']:.2f}"
        lines.append(
            f"{head}  {r['plain_tps']:11.1f}  {r['spec_tps']:10.1f}  {r['spec_tps'] / r['plain_tps']:9.2f}x  "
            f"{versus}  {accepted:>8}  {('yes' if r['identical'] else 'NO'):>11}  {same:>17}"
        )
    if not rows:
        lines.append(
            "(no rows yet: one line per model x dtype x engine; transformers' speculative column is its "
            f"prompt lookup, {PROMPT_LOOKUP_TOKENS} tokens)"
        )
    return "\n".join(lines)


def read_lines(path: str | None) -> list[dict]:
    """The JSON objects of a JSON-lines file (none when it is missing or empty: a step that never ran; a line that is
    not one is passed over)."""
    if not path or not Path(path).is_file():
        return []
    found = []
    for line in Path(path).read_text().splitlines():
        try:
            found.append(json.loads(line))
        except ValueError:  # a line a killed step left half written, or a log line
            continue
    return [item for item in found if isinstance(item, dict)]


def results(args) -> None:
    """One results JSON of a GPU check: the machine (``--info``), each step's status, every gpu_shapes row and every
    refcoder bench row; then the tables (gpu_shapes', refcoder's, the steps)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from gpu_shapes import print_tables

    info = json.loads(Path(args.info).read_text()) if args.info and Path(args.info).is_file() else {}
    steps = [{"kind": "step", **step} for step in read_lines(args.steps)]
    shapes = []
    for path in args.shapes:
        if Path(path).is_file():
            shapes += json.loads(Path(path).read_text())["rows"]
    refcoder = [{"kind": "refcoder", **row} for row in read_lines(args.rows)]
    Path(args.out).write_text(
        json.dumps({"benchmark": "gpu_check", **info, "rows": steps + shapes + refcoder}, indent=1)
    )
    print_tables(shapes)
    if refcoder:
        print("\nrefcoder: the artifact's default plan against plain decoding, in turns, same engine")
        print(table(args.rows))
    print("\nsteps:")
    for step in steps:
        print(f"  {step['step']:<28} {step['status']:<10} {step.get('seconds', 0):>5}s  {step.get('note', '')}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    bench = commands.add_parser("rows")
    bench.add_argument("artifact")
    bench.add_argument("--model", required=True)
    bench.add_argument("--dtype", required=True, choices=["float16", "float32", "bfloat16"])
    bench.add_argument("--prompts", required=True)
    bench.add_argument("--n", type=int, default=8)
    bench.add_argument("--new-tokens", type=int, default=64)
    bench.add_argument("--engines", default="transformers," + ",".join(ENGINES))
    bench.add_argument("--device", default="cuda", help="cuda; cpu only to try the script without a GPU")
    batched = commands.add_parser("batch")
    batched.add_argument("artifact")
    batched.add_argument("--model", required=True)
    batched.add_argument("--dtype", required=True)
    batched.add_argument("--prompts", required=True)
    batched.add_argument("--n", type=int, default=16)
    batched.add_argument("--new-tokens", type=int, default=64)
    batched.add_argument("--streams", default="1,4,16")
    batched.add_argument("--device", default="cuda")
    gather = commands.add_parser("results")
    gather.add_argument("--out", required=True)
    gather.add_argument("--shapes", nargs="*", default=[], help="gpu_shapes.py --json files")
    gather.add_argument("--rows", default=None, help="a rows JSON-lines file")
    gather.add_argument("--steps", default=None, help="JSON lines, one per step of gpu_check.sh")
    gather.add_argument("--info", default=None, help="a JSON object of the machine, versions and command")
    show = commands.add_parser("table")
    show.add_argument("rows_file", nargs="?")
    show.add_argument("--out")
    args = parser.parse_args(argv)
    if args.command == "rows":
        rows(args)
        return
    if args.command == "batch":
        batch_rows(args)
        return
    if args.command == "results":
        results(args)
        return
    text = table(args.rows_file)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
