"""Aggregate tokens/s of 1 against 2 Ray Serve replicas on two local Ray nodes, every answer checked.

Starts a Ray cluster of two nodes on 127.0.0.1 (head and worker, ``--node-cpus`` each, no dashboard, Serve's
HTTP proxy on the head only) and serves the artifact there with 1 replica, then 2 (one per node), in turns
(1, 2, 2, 1 for ``--rounds 2``). Each turn sends the same bounded burst as ``load_test.py`` (``--requests``
greedy completions, ``--concurrency`` in flight, half streamed, no retries) through the ``openai`` client and
checks every answer against the runtime's greedy text, computed in this process first. Prints each turn's
tokens/s (completion tokens / wall seconds of the burst) and the ratio of the means. A replica's torch uses
as many threads as its CPUs (Ray sets OMP_NUM_THREADS), so on one machine the two nodes split its cores.

    flock -x /tmp/speccompile-timing.lock python benchmarks/ray_replicas.py artifacts/refcoder-torch --backend torch
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import sys
from pathlib import Path

os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # 127.0.0.1 stays 127.0.0.1 (ray_serve.pin_loopback)

import httpx  # noqa: E402
import ray  # noqa: E402
from load_test import expected_answers, load_prompts, run_load  # noqa: E402
from ray import serve  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from speccompile.server import ray_serve as rs  # noqa: E402

LOOPBACK = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((LOOPBACK, 0))
        return sock.getsockname()[1]


def one_turn(url: str, replicas: int, prompts: list[str], expected: dict[str, str], args) -> dict:
    """Deploy ``replicas`` replicas (one per node), warm each up, then time the burst."""
    rs.deploy(
        rs.ServeArgs(
            artifact=str(args.artifact),
            replicas=replicas,
            max_batch=args.max_batch,
            max_queue=max(16, args.concurrency),
            backend=args.backend,
            replica_cpus=args.node_cpus,
        )
    )
    model_name = httpx.get(url + "/health", timeout=60).json()["model"]
    warm = argparse.Namespace(**{**vars(args), "requests": 2 * replicas, "concurrency": replicas})
    asyncio.run(run_load(url, model_name, prompts[:1], expected, warm))
    result = asyncio.run(run_load(url, model_name, prompts, expected, args))
    result["replicas"] = replicas
    result["tokens_per_s"] = result["tokens"] / result["seconds"]
    result.pop("latencies")
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", type=Path, nargs="?", default=Path("artifacts/refcoder"))
    parser.add_argument("--backend", default=None, help="the replicas' backend (default: the artifact's first)")
    parser.add_argument("--max-batch", type=int, default=1, help="requests each replica decodes at once, in one batch")
    parser.add_argument("--node-cpus", type=int, default=1, help="CPUs of each of the two Ray nodes")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--distinct-prompts", type=int, default=12)
    parser.add_argument("--prompts", default=None, help=".jsonl with 'prompt' or 'text' per line")
    parser.add_argument("--rounds", type=int, default=2, help="turns of (1, 2) replicas, mirrored: 1,2,2,1,...")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    parser.add_argument("--json", action="store_true", help="also print the figures as one JSON line")
    args = parser.parse_args()
    args.artifact = args.artifact.absolute()

    prompts = load_prompts(args.artifact, args.prompts, args.distinct_prompts)
    expected = expected_answers(args.artifact, prompts, args.max_tokens, args.backend)
    order = [n for i in range(args.rounds) for n in ((1, 2) if i % 2 == 0 else (2, 1))]

    rs.pin_loopback()
    head = {"num_cpus": args.node_cpus, "node_ip_address": LOOPBACK, "include_dashboard": False}
    cluster = Cluster(initialize_head=True, connect=True, head_node_args=head)
    turns = []
    try:
        cluster.add_node(num_cpus=args.node_cpus, node_ip_address=LOOPBACK)
        cluster.wait_for_nodes(timeout=120)
        url = rs.start_serve(LOOPBACK, free_port())
        for replicas in order:
            turn = one_turn(url, replicas, prompts, expected, args)
            turns.append(turn)
            print(
                f"  {replicas} replica(s): {turn['tokens']} tokens in {turn['seconds']:.1f}s = "
                f"{turn['tokens_per_s']:.1f} tokens/s; completed {turn['completed']}, wrong {turn['wrong']}, "
                f"failed {turn['failed']}, 429 {turn['rejected_429']}",
                flush=True,
            )
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            cluster.shutdown()

    mean = {n: statistics.mean(t["tokens_per_s"] for t in turns if t["replicas"] == n) for n in (1, 2)}
    ok = all(t["completed"] == args.requests for t in turns)
    print(
        f"{args.artifact.name} ({args.backend or 'default backend'}), two nodes of {args.node_cpus} CPU(s) on "
        f"127.0.0.1, {args.requests} requests x {args.max_tokens} tokens, {args.concurrency} in flight, "
        f"turns {order}: 1 replica {mean[1]:.1f} tokens/s, 2 replicas {mean[2]:.1f} tokens/s, "
        f"{mean[2] / mean[1]:.2f}x; every answer equal to its greedy text: {'yes' if ok else 'NO'}"
    )
    if args.json:
        print(json.dumps({"turns": turns, "mean_tokens_per_s": mean, "ratio": mean[2] / mean[1], "all_ok": ok}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
