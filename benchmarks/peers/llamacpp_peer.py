"""llama.cpp as a peer, in its own venv (``llama-cpp-python`` built from source, ``gguf``).

    python llamacpp_peer.py convert SOURCE.gguf OUT.gguf --quant f32|q8_0|q4_0|same
    python llamacpp_peer.py bench MODEL.gguf IDS.json [--max-new-tokens 96] [--threads 2] [--eos 1,2]
                                  [--n-ctx 2048] [--kv-f32] [--flash-attn]
    python llamacpp_peer.py curve MODEL.gguf [--max-k 16] [--context 128] [--rounds 5] [--threads 2]

``convert`` writes a GGUF of the same checkpoint: ``f32`` de-quantizes every tensor of SOURCE (our fp32
weights are exactly that de-quantization), keeping its metadata and tokenizer; ``q8_0`` / ``q4_0``
quantize that f32 file with llama.cpp's own quantizer; ``same`` copies SOURCE. ``bench`` decodes every
prompt greedily, plainly and with llama-cpp-python's prompt-lookup drafter (``LlamaPromptLookupDecoding``,
5 tokens, n-grams up to 3), stopping at ``--eos`` or after ``--max-new-tokens``; prints one JSON object like
``openvino_genai_peer.py``, with each request's time to its first token and its whole time under ``requests``
(long inputs need ``--n-ctx`` above their length; ``--kv-f32`` keeps the KV cache in float32, the fp32 model's
computation, where llama.cpp's default is float16; ``--flash-attn`` turns on its fused attention). ``curve`` times one k-token batch decode after ``--context`` cached positions
for k = 1..max-k (minimum over rounds, k in turns), for ``benchmarks/verify_curve.py``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

FTYPES = {"q8_0": 7, "q4_0": 2}  # llama_ftype values (LLAMA_FTYPE_MOSTLY_*)


def dequantized_copy(source: Path, out: Path) -> None:
    """``source`` with every tensor de-quantized to F32, metadata copied field by field."""
    import gguf

    reader = gguf.GGUFReader(str(source))
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(out), arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        if name == "general.file_type":
            writer.add_file_type(gguf.LlamaFileType.ALL_F32)
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), kind, sub_type=sub)
    for tensor in reader.tensors:
        data = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        writer.add_tensor(tensor.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def convert(args) -> None:
    source, out = Path(args.source), Path(args.out)
    if args.quant == "same":
        shutil.copy(source, out)
        return
    f32 = out if args.quant == "f32" else Path(tempfile.mkdtemp()) / "f32.gguf"
    dequantized_copy(source, f32)
    if args.quant != "f32":
        import llama_cpp

        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = FTYPES[args.quant]
        params.nthread = 2
        if llama_cpp.llama_model_quantize(str(f32).encode(), str(out).encode(), params) != 0:
            sys.exit(f"llama.cpp could not quantize {f32} to {args.quant}")
        f32.unlink()


def bench(args) -> None:
    import llama_cpp
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    prompts = json.load(open(args.ids_file))
    eos = {int(t) for t in args.eos.split(",") if t}
    common = dict(n_ctx=args.n_ctx, n_threads=args.threads, n_threads_batch=args.threads, verbose=False, seed=0)
    if args.kv_f32:
        common.update(type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32)
    if args.flash_attn:
        common.update(flash_attn=True)
    engines = {
        "plain": Llama(args.model, **common),
        # logits_all: llama-cpp-python turns it on for a draft model but sizes its logits buffer by the argument
        # (n_batch rows), so a prompt longer than a batch fails unless it is asked for
        "prompt_lookup": Llama(
            args.model,
            draft_model=LlamaPromptLookupDecoding(num_pred_tokens=5, max_ngram_size=3),
            logits_all=True,
            **common,
        ),
    }

    def decode(llm, ids, limit):
        """The new tokens and the time of the first one from the call (``generate`` yields it after reading the
        prompt)."""
        out, start, first = [], time.perf_counter(), None
        for token in llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True):
            first = time.perf_counter() - start if first is None else first
            out.append(int(token))
            if token in eos or len(out) >= limit or llm.token_eos() == token:
                break
        return out, first

    report = {mode: {"new_tokens": 0, "seconds": 0.0, "outputs": [], "requests": []} for mode in engines}
    for llm in engines.values():
        decode(llm, prompts[0][:64], 4)  # warm-up
    for ids in prompts:
        for mode, llm in engines.items():
            start = time.perf_counter()
            out, first = decode(llm, ids, args.max_new_tokens)
            seconds = time.perf_counter() - start
            report[mode]["seconds"] += seconds
            report[mode]["new_tokens"] += len(out)
            report[mode]["outputs"].append(out)
            report[mode]["requests"].append({"ids": out, "ttft": first, "latency": seconds})

    report["versions"] = {"llama_cpp_python": llama_cpp.__version__}
    json.dump(report, sys.stdout)


def curve(args) -> None:
    """Seconds of one k-token decode after ``context`` cached positions, k = 1..max_k."""
    import llama_cpp
    from llama_cpp import Llama

    llm = Llama(
        args.model,
        n_ctx=args.context + args.max_k + 8,
        n_batch=512,
        n_threads=args.threads,
        n_threads_batch=args.threads,
        verbose=False,
        logits_all=True,
    )
    rng = np.random.default_rng(0)
    vocab = llm.n_vocab()
    prefix = rng.integers(100, vocab, args.context).tolist()
    inputs = [rng.integers(100, vocab, k).tolist() for k in range(1, args.max_k + 1)]
    llm.reset()
    llm.eval(prefix)
    best = [float("inf")] * args.max_k

    def once(ids):
        llm.n_tokens = args.context  # roll the cache back: the next eval writes at positions context..
        llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(llm.ctx), 0, args.context, -1)
        start = time.perf_counter()
        llm.eval(ids)
        return time.perf_counter() - start

    for ids in inputs:
        once(ids)
    for _ in range(args.rounds):
        for k, ids in enumerate(inputs):
            best[k] = min(best[k], once(ids))
    json.dump({"seconds": best}, sys.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("convert")
    c.add_argument("source")
    c.add_argument("out")
    c.add_argument("--quant", default="f32", choices=["f32", "same", *FTYPES])
    b = sub.add_parser("bench")
    b.add_argument("model")
    b.add_argument("ids_file")
    b.add_argument("--max-new-tokens", type=int, default=96)
    b.add_argument("--threads", type=int, default=2)
    b.add_argument("--eos", default="")
    b.add_argument("--n-ctx", type=int, default=2048, help="context size (prompt plus new tokens must fit)")
    b.add_argument("--kv-f32", action="store_true", help="a float32 KV cache (default: llama.cpp's float16)")
    b.add_argument("--flash-attn", action="store_true", help="llama.cpp's fused attention")
    k = sub.add_parser("curve")
    k.add_argument("model")
    k.add_argument("--max-k", type=int, default=16)
    k.add_argument("--context", type=int, default=128)
    k.add_argument("--rounds", type=int, default=5)
    k.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    {"convert": convert, "bench": bench, "curve": curve}[args.command](args)


if __name__ == "__main__":
    main()
