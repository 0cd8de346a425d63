"""OpenVINO GenAI as a peer: plain decoding and its own prompt lookup on the same token ids.

Runs in its own venv (``openvino-genai``; see ``benchmarks/peer_compare.py``, which sets it up and calls
this), never imports speccompile:

    python openvino_genai_peer.py MODEL_DIR IDS.json [--max-new-tokens 96] [--threads 2]
                                  [--precision f32] [--assistant-tokens 5] [--max-ngram 3]
    python openvino_genai_peer.py MODEL_DIR --curve [--max-k 16] [--context 128] [--rounds 5]

MODEL_DIR is an ``optimum-cli export openvino`` folder; IDS.json a list of prompts' token-id lists (the
driver tokenizes them with the artifact's tokenizer, so every engine sees the same ids). Both pipelines
are built once; each prompt is decoded plainly then with prompt lookup, greedily, stopping at the model's
eos or after --max-new-tokens. Prints one JSON object: new tokens, seconds and output ids per mode.
``--precision`` is the CPU plugin's INFERENCE_PRECISION_HINT ("default" leaves the plugin's choice,
bf16 on CPUs with AMX/AVX-512 BF16).

``--curve`` times the exported model itself (the stateful IR the pipelines run, compiled by the CPU plugin):
one k-token infer after ``--context`` cached positions, k = 1..max-k, the KV state restored to those
positions before every call; minimum over rounds, k in turns. Prints ``{"seconds": [...]}`` for
``benchmarks/verify_curve.py``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
import openvino as ov
import openvino_genai as genai


def curve(args, properties: dict) -> None:
    core = ov.Core()
    request = core.compile_model(f"{args.model_dir}/openvino_model.xml", "CPU", properties).create_infer_request()
    names = {i.get_any_name() for i in request.model_inputs}
    rng = np.random.default_rng(0)

    def infer(ids: list[int], pos: int) -> None:
        feed = {
            "input_ids": np.asarray([ids], dtype=np.int64),
            "attention_mask": np.ones((1, pos + len(ids)), dtype=np.int64),
        }
        if "position_ids" in names:
            feed["position_ids"] = np.arange(pos, pos + len(ids), dtype=np.int64)[None]
        if "beam_idx" in names:
            feed["beam_idx"] = np.zeros(1, dtype=np.int32)
        request.infer(feed)

    request.reset_state()
    infer(rng.integers(100, 49000, args.context).tolist(), 0)
    saved = [(state, state.state.data.copy()) for state in request.query_state()]
    inputs = [rng.integers(100, 49000, k).tolist() for k in range(1, args.max_k + 1)]
    best = [float("inf")] * args.max_k
    for r in range(args.rounds + 1):
        for k, ids in enumerate(inputs):
            for state, data in saved:
                state.state = ov.Tensor(data)
            start = time.perf_counter()
            infer(ids, args.context)
            if r:  # round 0 warms up
                best[k] = min(best[k], time.perf_counter() - start)
    json.dump({"seconds": best}, sys.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir")
    parser.add_argument("ids_file", nargs="?")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--precision", default="f32")
    parser.add_argument("--assistant-tokens", type=int, default=5)
    parser.add_argument("--max-ngram", type=int, default=3)
    parser.add_argument("--curve", action="store_true")
    parser.add_argument("--max-k", type=int, default=16)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    properties = {"INFERENCE_NUM_THREADS": args.threads}
    if args.precision != "default":
        properties["INFERENCE_PRECISION_HINT"] = args.precision
    if args.curve:
        return curve(args, properties)
    prompts = json.load(open(args.ids_file))
    plain = genai.LLMPipeline(args.model_dir, "CPU", **properties)
    lookup = genai.LLMPipeline(args.model_dir, "CPU", prompt_lookup=True, **properties)

    def config(speculative: bool) -> genai.GenerationConfig:
        c = plain.get_generation_config()
        c.max_new_tokens = args.max_new_tokens
        c.do_sample = False
        if speculative:
            c.num_assistant_tokens = args.assistant_tokens
            c.max_ngram_size = args.max_ngram
        return c

    modes = {"plain": (plain, config(False)), "prompt_lookup": (lookup, config(True))}
    report = {mode: {"new_tokens": 0, "seconds": 0.0, "outputs": []} for mode in modes}
    for pipe, c in modes.values():  # warm-up: first calls compile kernels and allocate
        pipe.generate(ov.Tensor(np.asarray([prompts[0]], dtype=np.int64)), c)
    for ids in prompts:
        tensor = ov.Tensor(np.asarray([ids], dtype=np.int64))
        for mode, (pipe, c) in modes.items():
            start = time.perf_counter()
            result = pipe.generate(tensor, c)
            seconds = time.perf_counter() - start
            out = list(result.tokens[0])
            if out[: len(ids)] == list(ids):  # some pipelines echo the prompt
                out = out[len(ids) :]
            report[mode]["new_tokens"] += len(out)
            report[mode]["seconds"] += seconds
            report[mode]["outputs"].append(out)
    report["versions"] = {"openvino": ov.__version__, "openvino_genai": genai.__version__}
    report["properties"] = {k: str(v) for k, v in properties.items()}
    if args.precision == "default":  # what "default" is on this CPU (bf16 where AMX or AVX-512 BF16 is present)
        report["properties"]["INFERENCE_PRECISION_HINT (plugin default)"] = str(
            ov.Core().get_property("CPU", "INFERENCE_PRECISION_HINT")
        )
    json.dump(report, sys.stdout)


if __name__ == "__main__":
    main()
