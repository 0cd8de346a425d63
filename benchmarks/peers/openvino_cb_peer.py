"""OpenVINO GenAI's continuous-batching pipeline as a peer under load: N streams at once, plain and with its
prompt lookup, on the same token ids.

Runs in its own venv (``openvino-genai``; ``benchmarks/streams.py`` sets it up and calls this), never imports
speccompile:

    python openvino_cb_peer.py MODEL_DIR IDS.json --streams 1,4,8 [--max-new-tokens 64] [--threads 2]
        [--requests 16] [--precision f32] [--kv-cache-precision default] [--assistant-tokens 5] [--max-ngram 3]

For each stream count N and each mode (plain, prompt lookup): a closed loop keeps N requests in flight
(``add_request`` then ``step`` until done; a finished request is replaced by the next prompt of that run's
list: IDS.json holds one list of prompts for every run, or one per run keyed "warm", "1", "4", ...) until
``--requests`` requests have completed. Prints one JSON object: per mode and N, the aggregate tokens/s, the
per-request latencies and times to first token, and every request's output ids (greedy).

``--precision`` sets the products' precision (``INFERENCE_PRECISION_HINT``), not the KV cache's: OpenVINO's CPU
plugin keeps the KV cache in its own ``KV_CACHE_PRECISION``, 8-bit (``u8``) by default in the 2026.4 measured here,
whatever the products run in. ``--kv-cache-precision f32`` keeps it in fp32 (the computation of the fp32 model); the report
names the precision each run had.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
import openvino as ov
import openvino_genai as genai


def run(pipe, prompts: list[list[int]], streams: int, requests: int, config) -> dict:
    next_prompt, live, done = 0, {}, []
    start = time.perf_counter()
    while len(done) < requests:
        while len(live) < streams and next_prompt < requests:
            ids = prompts[next_prompt % len(prompts)]
            handle = pipe.add_request(next_prompt, ov.Tensor(np.asarray([ids], dtype=np.int64)), config)
            live[next_prompt] = (handle, time.perf_counter(), None)
            next_prompt += 1
        pipe.step()
        now = time.perf_counter()
        for rid, (handle, began, first) in list(live.items()):
            if first is None and handle.can_read():
                first = now
                live[rid] = (handle, began, first)
            if handle.get_status() == genai.GenerationStatus.FINISHED:
                outputs = handle.read_all()
                ids = list(outputs[0].generated_ids) if outputs else []
                done.append({"id": rid, "latency": now - began, "ttft": (first or now) - began, "ids": ids})
                del live[rid]
    seconds = time.perf_counter() - start
    tokens = sum(len(r["ids"]) for r in done)
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds, "requests": done}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir")
    parser.add_argument("ids_file")
    parser.add_argument("--streams", default="1,4,8")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--precision", default="f32")
    parser.add_argument(
        "--kv-cache-precision",
        default="default",
        help="KV_CACHE_PRECISION: default (the CPU plugin's own, u8 on CPUs today), f32, f16, bf16, u8",
    )
    parser.add_argument("--assistant-tokens", type=int, default=5)
    parser.add_argument("--max-ngram", type=int, default=3)
    parser.add_argument("--modes", default="plain,prompt_lookup")
    parser.add_argument(
        "--prefix-caching",
        action="store_true",
        help="keep computed KV blocks for later prompts with the same first tokens (SchedulerConfig.enable_prefix_caching)",
    )
    args = parser.parse_args()
    properties = {"INFERENCE_NUM_THREADS": args.threads}
    if args.precision != "default":
        properties["INFERENCE_PRECISION_HINT"] = args.precision
    if args.kv_cache_precision == "default":
        kv_cache = ov.Core().get_property("CPU", "KV_CACHE_PRECISION").get_type_name()  # what the plugin will use
    else:
        properties["KV_CACHE_PRECISION"] = kv_cache = args.kv_cache_precision
    sets = json.load(open(args.ids_file))  # a list of prompts for every run, or one list per run
    if isinstance(sets, list):
        sets = {"warm": sets, **{n: sets for n in args.streams.split(",")}}
    report: dict = {
        "versions": {"openvino": ov.__version__, "openvino_genai": genai.__version__},
        "prefix_caching": args.prefix_caching,
        "kv_cache_precision": kv_cache,
    }
    for mode in args.modes.split(","):
        scheduler = genai.SchedulerConfig()
        scheduler.max_num_seqs = max(int(n) for n in args.streams.split(","))
        scheduler.cache_size = 1  # GB of KV blocks: ample for these streams
        scheduler.dynamic_split_fuse = True
        scheduler.enable_prefix_caching = args.prefix_caching
        extra = {"prompt_lookup": True} if mode == "prompt_lookup" else {}
        pipe = genai.ContinuousBatchingPipeline(args.model_dir, scheduler, "CPU", {**properties, **extra})
        config = pipe.get_config()
        config.max_new_tokens = args.max_new_tokens
        config.do_sample = False
        if mode == "prompt_lookup":
            config.num_assistant_tokens = args.assistant_tokens
            config.max_ngram_size = args.max_ngram
        run(pipe, sets["warm"], 1, 1, config)  # warm-up: kernels compiled, blocks allocated
        report[mode] = {}
        for streams in map(int, args.streams.split(",")):
            report[mode][str(streams)] = run(pipe, sets[str(streams)], streams, max(args.requests, streams), config)
        del pipe
    json.dump(report, sys.stdout)


if __name__ == "__main__":
    main()
