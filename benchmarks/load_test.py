"""Load test of ``speccompile serve``: a bounded burst of greedy requests on loopback, every answer checked.

Starts ``speccompile serve ARTIFACT --max-batch N`` as a child process on 127.0.0.1 (a free port), computes
each prompt's expected greedy token ids with the runtime in this process first (batch-1, plain), then sends
``--requests`` requests with at most ``--concurrency`` in flight through the real ``openai`` client (no
retries, so 429s are counted, not hidden): mixed lengths (``--max-tokens``, half and a quarter of it in
turn), half streamed, and every ``--cancel-every``-th streamed request abandoned after its first chunk.
Meanwhile ``/health`` is polled every 0.2 s. It prints completed / wrong / failed / cancelled / 429 counts,
p50/p95 latency, total tokens/s, the slowest ``/health`` answer, and the server's resident memory (RSS)
idle, after a warm-up (whole batches, then a short run of the same mixed load) and after the run, then stops the server. Exit status 1 when an answer is wrong or
lost, ``/health`` failed, or memory grew over 5%.

    flock /tmp/speccompile-timing.lock python benchmarks/load_test.py artifacts/refcoder --max-batch 8
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai

BUILTIN_PROMPTS = ["def read_lines(path):", "class Stack:", "import os\n\n\ndef main():", "for i in range(10):"]


def rss_mib(pid: int) -> float:
    """Resident set size of ``pid`` in MiB (Linux /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def load_prompts(artifact: Path, path: str | None, count: int) -> list[str]:
    """``count`` prompts: from --prompts, else the artifact's source model's prompts.jsonl, else built in."""
    if path is None:
        source = json.loads((artifact / "manifest.json").read_text()).get("source", {}).get("path")
        candidate = Path(source) / "prompts.jsonl" if source else None
        path = str(candidate) if candidate and candidate.is_file() else None
    if path is None:
        return BUILTIN_PROMPTS[:count]
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return [row.get("prompt") or row["text"] for row in rows][:count]


def expected_answers(
    artifact: Path, prompts: list[str], max_tokens: int, backend: str | None, cache: Path | None = None
) -> dict[str, list[int]]:
    """Each prompt's greedy token ids from the runtime itself, alone and plain (every server answer of
    ``n`` tokens must be their first ``n``). With ``cache``, answers for the same manifest, backend, prompts and
    length are reused."""
    from speccompile.runtime import load

    key = hashlib.sha256(
        json.dumps([(artifact / "manifest.json").read_text(), backend, prompts, max_tokens, "ids"]).encode()
    ).hexdigest()
    if cache is not None and cache.is_file():
        stored = json.loads(cache.read_text())
        if stored.get("key") == key:
            return stored["answers"]
    model = load(artifact, backend=backend)
    answers = {
        p: model.generate(p, max_new_tokens=max_tokens, temperature=0.0, speculate=False).token_ids for p in prompts
    }
    if cache is not None:
        cache.write_text(json.dumps({"key": key, "answers": answers}))
    return answers


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(args, port: int) -> subprocess.Popen:
    command = [
        sys.executable,
        "-m",
        "speccompile.cli",
        "serve",
        str(args.artifact),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-batch",
        str(args.max_batch),
        "--max-queue",
        str(args.max_queue),
    ]
    if args.backend:
        command += ["--backend", args.backend]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return process
        except httpx.TransportError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise SystemExit(f"the server did not start: {process.stderr.read().decode()[-2000:]}")
        time.sleep(0.3)


async def one_request(
    client: openai.AsyncOpenAI, model: str, prompt: str, max_tokens: int, stream: bool, cancel: bool
) -> tuple[list[int], bool]:
    """The answer's token ids (the server's ``speccompile`` extension), streamed or not; ``cancel``: hang up
    after the first chunk (returns True then)."""
    if not stream:
        response = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0)
        return response.model_extra["speccompile"]["token_ids"], False
    ids: list[int] = []
    chunks = await client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True
    )
    async for chunk in chunks:
        if chunk.choices and chunk.choices[0].finish_reason is None:
            ids += (chunk.model_extra.get("speccompile") or {}).get("token_ids", [])
        if cancel and ids:
            await chunks.close()
            return ids, True
    return ids, False


async def run_load(base_url: str, model_name: str, prompts: list[str], expected: dict[str, list[int]], args) -> dict:
    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=args.timeout)
    gate = asyncio.Semaphore(args.concurrency)
    outcome = {
        "completed": 0,
        "wrong": 0,
        "wrong_done": 0,
        "failed": 0,
        "cancelled": 0,
        "rejected_429": 0,
        "tokens": 0,
        "latencies": [],
        "errors": [],
        "health_max_s": 0.0,
        "health_failures": 0,
    }
    running = True

    async def watch_health() -> None:
        async with httpx.AsyncClient(base_url=base_url, timeout=30) as http:
            while running:
                start = time.perf_counter()
                try:
                    ok = (await http.get("/health")).status_code == 200
                except httpx.HTTPError:
                    ok = False
                outcome["health_max_s"] = max(outcome["health_max_s"], time.perf_counter() - start)
                outcome["health_failures"] += not ok
                await asyncio.sleep(0.2)

    async def job(i: int) -> None:
        prompt = prompts[i % len(prompts)]
        length = (args.max_tokens, args.max_tokens // 2, args.max_tokens // 4)[i % 3] or 1
        stream = i % 2 == 1
        cancel = stream and args.cancel_every > 0 and (i // 2) % args.cancel_every == args.cancel_every - 1
        async with gate:
            start = time.perf_counter()
            try:
                ids, cancelled = await one_request(client, model_name, prompt, length, stream, cancel)
            except openai.RateLimitError:
                outcome["rejected_429"] += 1
                return
            except Exception as exc:  # noqa: BLE001 - every failure is counted and the first few printed
                outcome["failed"] += 1
                outcome["errors"].append(f"request {i}: {type(exc).__name__}: {exc}")
                return
            want = expected[prompt][:length]
            if cancelled:
                outcome["cancelled"] += 1
                good = ids == want[: len(ids)]
            else:
                outcome["latencies"].append(time.perf_counter() - start)
                outcome["tokens"] += len(ids)
                good = ids == want
                outcome["completed"] += good
                outcome["wrong_done"] += not good
            if not good:
                outcome["wrong"] += 1
                outcome["errors"].append(
                    f"request {i}: its tokens differ from prompt {i % len(prompts)}'s batch-1 output"
                )

    watcher = asyncio.create_task(watch_health())
    start = time.perf_counter()
    await asyncio.gather(*(job(i) for i in range(args.requests)))
    outcome["seconds"] = time.perf_counter() - start
    running = False
    await watcher
    await client.close()
    return outcome


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else (values or [0])[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", type=Path, nargs="?", default=Path("artifacts/refcoder"))
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--slots", type=int, default=None, help="old name of --max-batch")
    parser.add_argument("--cancel-every", type=int, default=10, help="abandon every n-th streamed request")
    parser.add_argument("--max-queue", type=int, default=16)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--distinct-prompts", type=int, default=40)
    parser.add_argument("--prompts", default=None, help=".jsonl with 'prompt' or 'text' per line")
    parser.add_argument("--backend", default=None)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    parser.add_argument(
        "--expected-cache",
        type=Path,
        default=None,
        help="JSON file to keep the expected answers in between runs (recomputed when stale)",
    )
    parser.add_argument("--json", action="store_true", help="also print the figures as one JSON line")
    args = parser.parse_args()
    args.max_batch = args.slots or args.max_batch

    prompts = load_prompts(args.artifact, args.prompts, args.distinct_prompts)
    t0 = time.perf_counter()
    expected = expected_answers(args.artifact, prompts, args.max_tokens, args.backend, args.expected_cache)
    print(f"expected greedy answers for {len(prompts)} prompts computed in {time.perf_counter() - t0:.1f}s")

    port = free_port()
    server = start_server(args, port)
    base_url = f"http://127.0.0.1:{port}"
    try:
        model_name = httpx.get(base_url + "/health").json()["model"]
        rss_idle = rss_mib(server.pid)
        # Warm-up: the batch decodes the longest prompt at every place, then every prompt once, so the KV cache
        # has reached the size the run needs (the batch's places and the slots of the prompts it keeps for later
        # ones that begin alike, runtime/decoding/prompt_cache.py); "before" is measured after it, so growth over
        # the run means memory is not given back.
        by_length = sorted(prompts, key=len, reverse=True)
        warm = argparse.Namespace(
            **{**vars(args), "requests": args.max_batch, "concurrency": args.max_batch, "cancel_every": 0}
        )
        warmup = asyncio.run(run_load(base_url, model_name, by_length[:1], expected, warm))
        every = argparse.Namespace(**{**vars(warm), "requests": len(prompts)})
        asyncio.run(run_load(base_url, model_name, by_length, expected, every))
        # then a short run of the measured load itself (arrivals beside running sequences, cancellations): the
        # shapes of its calls (prompt chunks packed beside steps and verifies) set ONNX Runtime's arena high-water
        # mark, which a warm-up of whole batches never reaches
        mixed = argparse.Namespace(**{**vars(args), "requests": 4 * args.max_batch})
        asyncio.run(run_load(base_url, model_name, prompts, expected, mixed))
        rss_before = rss_mib(server.pid)
        result = asyncio.run(run_load(base_url, model_name, prompts, expected, args))
        rss_after = rss_mib(server.pid)
        health = httpx.get(base_url + "/health").json()
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()

    lat = result["latencies"]
    accounted = (
        result["completed"] + result["wrong_done"] + result["cancelled"] + result["failed"] + result["rejected_429"]
    )
    growth = (rss_after - rss_before) / rss_before
    figures = {
        "max_batch": args.max_batch,
        "requests": args.requests,
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "completed": result["completed"],
        "wrong": result["wrong"],
        "failed": result["failed"],
        "rejected_429": result["rejected_429"],
        "cancelled": result["cancelled"],
        "lost": args.requests - accounted,
        "health_max_s": result["health_max_s"],
        "health_failures": result["health_failures"],
        "p50_s": percentile(lat, 50),
        "p95_s": percentile(lat, 95),
        "wall_s": result["seconds"],
        "tokens": result["tokens"],
        "tokens_per_s": result["tokens"] / result["seconds"],
        "rss_idle_mib": rss_idle,
        "rss_before_mib": rss_before,
        "rss_after_mib": rss_after,
        "rss_growth": growth,
        "warmup_ok": warmup["completed"] == args.max_batch,
        "health_after": health["status"],
    }
    print(
        f"{args.artifact}, --max-batch {args.max_batch}, {args.requests} requests, {args.concurrency} concurrent, "
        f"{args.max_tokens} / {args.max_tokens // 2} / {args.max_tokens // 4} tokens (half streamed, every "
        f"{args.cancel_every}th stream abandoned)"
    )
    print(
        f"  completed {figures['completed']} (answers equal to their own expected text), wrong {figures['wrong']}, "
        f"failed {figures['failed']}, cancelled {figures['cancelled']}, 429 {figures['rejected_429']}, "
        f"lost {figures['lost']}; /health slowest {figures['health_max_s']:.2f}s, failed {figures['health_failures']}"
    )
    print(
        f"  latency p50 {figures['p50_s']:.2f}s, p95 {figures['p95_s']:.2f}s; {figures['tokens']} tokens in "
        f"{figures['wall_s']:.1f}s = {figures['tokens_per_s']:.1f} tokens/s"
    )
    print(
        f"  server RSS: idle {rss_idle:.0f} MiB, after warm-up {rss_before:.0f} MiB, after the run "
        f"{rss_after:.0f} MiB ({100 * growth:+.1f}%)"
    )
    for line in result["errors"][:5]:
        print("  " + line)
    if args.json:
        print(json.dumps(figures))
    ok = (
        figures["wrong"] == 0
        and figures["failed"] == 0
        and figures["lost"] == 0
        and figures["health_failures"] == 0
        and abs(growth) <= 0.05
    )
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
