"""Many streams at once: the server's batch (continuous batching) against OpenVINO GenAI's, N requests in flight.

    python benchmarks/streams.py ARTIFACT [--backend onnx] [--streams 1,4,8,16] [--requests 16]
        [--max-new-tokens 64] [--prompts benchmarks/data/smollm2_prompts.jsonl]
        [--peers openvino --source MODEL_DIR] [--peer-weights fp32|int8|int4] [--peer-kv-cache default,f32] [--json OUT.json] [--cost-curve 64]

For each stream count N, a closed loop keeps N requests in flight through ``speccompile.server.scheduler``
(what ``speccompile serve --max-batch N`` runs; no HTTP), after an untimed warm-up of both at the largest N,
first decoding plainly (plain batched decoding),
then speculatively with the artifact's default plan (speculative batched decoding, draft lengths chosen by
the load policy from the call costs the build stored, or timed at start), the two in turns per N. Every answer is checked against the
prompt's own batch-1 plain greedy output. ``--peers openvino`` then runs OpenVINO GenAI's
``ContinuousBatchingPipeline`` (plain and its prompt lookup) on the source model exported to OpenVINO
(``benchmarks/peer_compare.py``'s venv and export), same prompts (token ids), threads and stream counts, with its
prefix caching on (``--peer-prefix-caching off`` turns it off), as ours keeps the prompts a batch has read
(``runtime/decoding/prompt_cache.py``), once with its CPU plugin's default KV cache (8-bit, ``u8``, in OpenVINO
2026.4: what a user gets, not the fp32 model's computation) and once with an fp32 KV cache (``--peer-kv-cache``). The prompts share a chat template, and 16 requests over 12 prompts
repeat some: with prompts kept across the runs, both engines read most prompts from their caches.

Prints one table: engine, N, aggregate tokens/s, ratio to the artifact's single-stream plain throughput,
p50 / p95 request latency, time to first token and inter-token latency (each request's mean gap between
tokens after its first), and how many answers equal their batch-1 greedy output.
``--cost-curve ROWS`` first prints what the load policy prices drafts with: the time of one call of n
one-token rows (n up to ROWS) and of one row of w tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def closed_loop(scheduler, prompts: list[list[int]], streams: int, requests: int, max_new: int) -> dict:
    """Keep ``streams`` requests in flight until ``requests`` have finished; their outcomes in order."""
    from speccompile.server.openai_api import SamplingOptions
    from speccompile.server.scheduler import Job

    finished: dict[int, object] = {}
    lock = threading.Condition()
    submitted = 0

    def submit(index: int) -> None:
        options = SamplingOptions(max_new, 0.0, 1.0, 0, None, [])

        def done(result, i=index):
            with lock:
                finished[i] = result
                lock.notify()

        scheduler.submit(Job(list(prompts[index % len(prompts)]), options, None, done))

    start = time.perf_counter()
    with lock:
        while submitted < min(streams, requests):
            submit(submitted)
            submitted += 1
        while len(finished) < requests:
            before = len(finished)
            lock.wait(timeout=600)
            if len(finished) == before:
                raise RuntimeError("no request finished in 10 minutes")
            while submitted < requests and submitted - len(finished) < streams:
                submit(submitted)
                submitted += 1
    seconds = time.perf_counter() - start
    outcomes = [finished[i] for i in range(requests)]
    for outcome in outcomes:
        if isinstance(outcome, BaseException):
            raise outcome
    tokens = sum(len(o.token_ids) for o in outcomes)
    return {
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "latencies": [o.seconds for o in outcomes],
        "ttfts": [o.ttft for o in outcomes if o.ttft is not None],
        "itls": inter_token_latencies([(o.seconds, o.ttft, len(o.token_ids)) for o in outcomes]),
        "outputs": [list(o.token_ids) for o in outcomes],
    }


def inter_token_latencies(requests: list[tuple[float, float | None, int]]) -> list[float]:
    """Each request's mean seconds between tokens after its first, from (latency, time to first token, tokens):
    what a streaming user waits per token once the answer has begun (requests of one token have none)."""
    return [(latency - ttft) / (tokens - 1) for latency, ttft, tokens in requests if ttft is not None and tokens > 1]


def prompt_sets(base: list[list[int]], counts: list[int], requests: int, marker=None) -> dict[str, list[list[int]]]:
    """The prompts of each run: "warm" (the untimed warm-up) and one set per stream count. Without ``marker``
    every run decodes ``base`` (16 requests over 12 prompts repeat some, and every run repeats the last).
    With it (``--unique-prompts``) each request of each run gets a prompt of its own: a base prompt with
    ``marker(text)``'s tokens inserted after the prefix all base prompts share (the chat template), so caches
    of earlier prompts help only with that prefix, as for many users of one service."""
    keys = {"warm": max(counts), **{str(n): max(requests, n) for n in counts}}
    if marker is None:
        return {key: base for key in keys}
    shared = len(os.path.commonprefix(base))
    return {
        key: [
            base[i % len(base)][:shared] + marker(f"(request {run}.{i}) ") + base[i % len(base)][shared:]
            for i in range(n)
        ]
        for run, (key, n) in enumerate(keys.items())
    }


def references(model, sets: dict[str, list[list[int]]], max_new: int) -> dict[tuple[int, ...], list[int]]:
    """Every timed prompt's batch-1 plain greedy output (a replica: the engines' caches are not touched)."""
    alone = model.replica()
    out: dict[tuple[int, ...], list[int]] = {}
    for key, prompts in sets.items():
        if key == "warm":
            continue
        for ids in prompts:
            if tuple(ids) not in out:
                out[tuple(ids)] = alone.generate(ids, max_new_tokens=max_new, speculate=False).token_ids
    return out


def identical(outputs: list[list[int]], prompts: list[list[int]], reference: dict) -> int:
    """How many of a run's outputs (request i decoded ``prompts[i % len(prompts)]``) equal their reference."""
    return sum(out == reference[tuple(prompts[i % len(prompts)])] for i, out in enumerate(outputs))


def speccompile_rows(args, sets: dict[str, list[list[int]]]) -> tuple[list[dict], dict]:
    from speccompile.runtime import load
    from speccompile.server.scheduler import Scheduler

    model = load(args.artifact, backend=args.backend)
    reference = references(model, sets, args.max_new_tokens)
    counts = [int(n) for n in args.streams.split(",")]
    batch = max(counts)
    schedulers = {
        "plain batched": Scheduler(model, max_batch=batch, max_queue=args.requests, speculate=False),
        # a replica: its own cache slots (the same weights), since a batch's slots and kept prompts are its own
        "speculative batched": Scheduler(model.replica(), max_batch=batch, max_queue=args.requests, speculate=True),
    }
    costs = schedulers["speculative batched"].costs
    if costs is not None:
        where = "from the build's manifest" if costs.source == "manifest" else "timed at start"
        print(f"call costs ({where}): {json.dumps(costs.as_dict())}", file=sys.stderr)
    for scheduler in schedulers.values():
        # untimed: the first call with more sequences than before grows the cache's slots (new buffers and
        # views), which would otherwise be timed in whichever engine ran first at that stream count
        closed_loop(scheduler, sets["warm"], batch, batch, 2)
    rows = []
    for turn, streams in enumerate(counts):
        names = list(schedulers) if turn % 2 == 0 else list(reversed(schedulers))
        prompts = sets[str(streams)]
        for name in names:
            scheduler = schedulers[name]
            scheduler.max_batch = streams  # the same loaded batch, N places
            run = closed_loop(scheduler, prompts, streams, max(args.requests, streams), args.max_new_tokens)
            run["identical"] = identical(run["outputs"], prompts, reference)
            rows.append({"engine": f"speccompile {name}", "streams": streams, **run})
            print(f"{name:22} N={streams:3}: {run['tokens_per_s']:.1f} tokens/s", file=sys.stderr, flush=True)
    for scheduler in schedulers.values():
        scheduler.close()
    return rows, reference


def openvino_rows(args, sets: dict[str, list[list[int]]], reference: dict) -> list[dict]:
    """OpenVINO GenAI's continuous batching, plain and prompt lookup, once per ``--peer-kv-cache`` precision."""
    from peer_compare import openvino_model, venv

    venvs = Path(args.venvs)
    python = venv(venvs, "openvino", ["optimum-intel[openvino]", "openvino-genai"])
    folder = openvino_model(venvs, Path(args.source), args.peer_weights)
    ids_file = venvs / "streams_ids.json"
    ids_file.write_text(json.dumps(sets))
    rows = []
    for kv_cache in args.peer_kv_cache.split(","):
        command = [
            str(python),
            str(HERE / "peers" / "openvino_cb_peer.py"),
            str(folder),
            str(ids_file),
            "--streams",
            args.streams,
            "--requests",
            str(args.requests),
            "--max-new-tokens",
            str(args.max_new_tokens),
            "--threads",
            str(args.threads),
            "--kv-cache-precision",
            kv_cache,
        ] + (["--prefix-caching"] if args.peer_prefix_caching == "on" else [])
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            print(f"OpenVINO GenAI ({kv_cache} KV cache) failed: {done.stderr[-1500:]}", file=sys.stderr)
            continue
        report = json.loads(done.stdout)
        caching = ", prefix caching" if report.get("prefix_caching") else ""
        precision = report.get("kv_cache_precision", kv_cache) + (" (its default)" if kv_cache == "default" else "")
        for mode in ("plain", "prompt_lookup"):
            for streams, run in report.get(mode, {}).items():
                outputs = [r["ids"] for r in sorted(run["requests"], key=lambda r: r["id"])]
                rows.append(
                    {
                        "engine": f"OpenVINO GenAI CB {mode.replace('_', ' ')}{caching}, {args.peer_weights} weights, "
                        f"{precision} KV cache",
                        "streams": int(streams),
                        "tokens": run["tokens"],
                        "seconds": run["seconds"],
                        "tokens_per_s": run["tokens_per_s"],
                        "latencies": [r["latency"] for r in run["requests"]],
                        "ttfts": [r["ttft"] for r in run["requests"]],
                        "itls": inter_token_latencies(
                            [(r["latency"], r["ttft"], len(r["ids"])) for r in run["requests"]]
                        ),
                        "identical": identical(outputs, sets[streams], reference),
                        "outputs": outputs,
                    }
                )
    return rows


def print_cost_curve(artifact: str, backend: str | None, max_rows: int, max_width: int = 9) -> None:
    """The cost of a batched call as the load policy times it (``CallCosts.measure``): n one-token rows in one
    call, n = 1, 2, 4 .. ``max_rows``, and one row of w tokens (a verify alone), on this machine's cores."""
    from speccompile.runtime import load
    from speccompile.runtime.decoding.load import CallCosts

    model = load(artifact, backend=backend)
    costs = CallCosts.measure(model.backend, max_rows=max_rows, max_width=max_width)
    print(f"cost of a batched call ({model.backend.name}, rows in one call: {costs.one_call})")
    print("| one-token rows in one call | ms per call | ms per row |")
    print("|---|---|---|")
    for n, seconds in sorted(costs.batched.items()):
        print(f"| {n} | {seconds * 1e3:.1f} | {seconds * 1e3 / n:.2f} |")
    print("| one row of w tokens | ms per call | ms per token |")
    print("|---|---|---|")
    for w, seconds in sorted(costs.alone.items()):
        print(f"| {w} | {seconds * 1e3:.1f} | {seconds * 1e3 / w:.2f} |")
    del model


def print_table(rows: list[dict]) -> None:
    single = next(
        (r["tokens_per_s"] for r in rows if r["engine"] == "speccompile plain batched" and r["streams"] == 1), None
    )
    print(
        "| engine | streams | tokens/s | vs 1-stream plain | p50 / p95 latency s | p50 / p95 TTFT s "
        "| p50 / p95 inter-token ms | = batch-1 greedy |"
    )
    print("|---|---|---|---|---|---|---|---|")

    def p50_p95(values: list[float], scale: float = 1.0, digits: int = 2) -> str:
        if not values:
            return "-"
        low, high = np.percentile(values, [50, 95]) * scale
        return f"{low:.{digits}f} / {high:.{digits}f}"

    for r in rows:
        versus = f"{r['tokens_per_s'] / single:.2f}x" if single else "-"
        print(
            f"| {r['engine']} | {r['streams']} | {r['tokens_per_s']:.1f} | {versus} | {p50_p95(r['latencies'])} | "
            f"{p50_p95(r['ttfts'])} | {p50_p95(r.get('itls', []), 1e3, 1)} | {r['identical']}/{len(r['outputs'])} |"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact")
    parser.add_argument("--backend", default=None)
    parser.add_argument("--streams", default="1,4,8,16")
    parser.add_argument("--requests", type=int, default=16, help="requests per stream count (at least N)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--prompts", default=str(HERE / "data" / "smollm2_prompts.jsonl"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--peers", default="", help="openvino: OpenVINO GenAI's continuous batching too")
    parser.add_argument("--source", default=None, help="the source model folder (for --peers)")
    parser.add_argument("--venvs", default=None)
    parser.add_argument(
        "--peer-prefix-caching",
        choices=("on", "off"),
        default="on",
        help="OpenVINO GenAI's prefix caching (on: as ours, which keeps the prompts a batch has read)",
    )
    parser.add_argument(
        "--peer-weights",
        choices=("fp32", "int8", "int4"),
        default="fp32",
        help="the weight format of OpenVINO's export (optimum-cli --weight-format; int4 in groups of 32): the "
        "artifact's own (an artifact built with --quantize int8 compares with int8)",
    )
    parser.add_argument(
        "--peer-kv-cache",
        default="default,f32",
        help="OpenVINO GenAI's KV cache precisions to run, comma-separated: default (its CPU plugin's own: u8 in "
        "2026.4, an 8-bit cache) and f32 (the fp32 model's computation, as ours)",
    )
    parser.add_argument(
        "--unique-prompts",
        action="store_true",
        help="a prompt of its own for every request of every run (a marker after the shared chat template)",
    )
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--cost-curve", type=int, default=0, metavar="ROWS", help="also print the batched call's cost, 1..ROWS rows"
    )
    args = parser.parse_args()
    if args.cost_curve:
        print_cost_curve(args.artifact, args.backend, args.cost_curve)
    from peer_compare import DEFAULT_VENVS

    from speccompile.runtime import load

    args.venvs = args.venvs or str(DEFAULT_VENVS)
    opened = load(args.artifact, backend=args.backend)
    texts = [json.loads(line) for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    prompts = [opened.encode_prompt(t.get("prompt") or t.get("text")) for t in texts]
    marker = opened.tokenizer.encode if args.unique_prompts else None
    sets = prompt_sets(prompts, [int(n) for n in args.streams.split(",")], args.requests, marker)
    del opened
    rows, reference = speccompile_rows(args, sets)
    if "openvino" in args.peers:
        if args.source is None:
            sys.exit("--peers openvino needs --source MODEL_DIR (the model the artifact was built from)")
        rows += openvino_rows(args, sets, reference)
    print_table(rows)
    if args.json:
        args.json.write_text(json.dumps([{k: v for k, v in r.items() if k != "outputs"} for r in rows], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
