"""The int8 twin's draft step on a GPU against the plain step, at Llama-3.2-1B's shape, in one process.

    python benchmarks/experiments/cuda_twin_step.py [--dtype bfloat16] [--tokens 1,4] [--turns 20] [--calls 20]
                                                    [--lowerings auto,weight-only,fp8] [--context 512]
    python benchmarks/experiments/cuda_twin_step.py --smoke     # tiny shapes on the CPU: the script runs, no figures

Builds a random-weight decoder of Llama-3.2-1B's shape (hidden 2048, 16 blocks, 32 heads, 8 KV heads,
intermediate 8192, vocabulary 128256, tied embeddings) on the GPU itself (nothing is downloaded: a step's cost
depends on the shapes, not the values), fills a static cache to ``--context`` positions, and times, for each
token count, the plain step and each lowering's twin step (``runtime/backends/torch/cuda_twin.py``: ``auto``
measures each shape's fastest form, ``weight-only`` and ``fp8`` name one form for every product), every step
replayed from a CUDA graph over the same cache as the backend replays its steps. Timings use CUDA events, in
turns: each turn runs ``--calls`` steps of each contender, the order rotating every turn, so a drifting clock
weighs on all alike; the table gives the median milliseconds per step and the twin's step over the plain one.
The twin's acceptance is not measured here (random weights): ``benchmarks/experiments/precision_draft.py``
measures it on a real model.

Without a GPU it says so and exits 0; ``--smoke`` runs the same code at tiny shapes on the CPU, eagerly,
timed with the host clock (for the tests: its figures mean nothing).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/: the real shapes and their weights
from gpu_shapes import SHAPES, arch_config, random_decoder  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.add_argument("--tokens", default="1,4", help="token counts per step (a draft step is 1)")
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--calls", type=int, default=20, help="steps per contender per turn")
    parser.add_argument("--lowerings", default="auto,weight-only,fp8")
    parser.add_argument("--context", type=int, default=512, help="positions in the cache before the timed steps")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (runs the code, no figures)")
    args = parser.parse_args()

    import torch

    from speccompile.runtime.backends.torch import cuda_twin
    from speccompile.runtime.backends.torch.decoder import KVCache
    from speccompile.runtime.backends.torch.graphs import StaticSteps, cuda_capture_with, eager_capture
    from speccompile.runtime.backends.torch.int8_twin import int8_twin, set_twin_lowering
    from speccompile.runtime.segments import full_model

    if args.smoke:
        device, capture = torch.device("cpu"), eager_capture
        torch.set_num_threads(1)  # tiny products: threads only contend
        args.turns, args.calls, args.context = 2, 2, 16
        lowerings = ["weight-only", "fp8"]
    elif not torch.cuda.is_available():
        print("cuda_twin_step.py needs a CUDA GPU (PyTorch sees none); --smoke runs it at tiny shapes on the CPU")
        return
    else:
        device, capture = torch.device("cuda"), cuda_capture_with(torch.cuda.graph_pool_handle())
        lowerings = [name for name in args.lowerings.split(",") if name]
    dtype = getattr(torch, args.dtype) if not args.smoke else torch.float32
    counts = [int(t) for t in args.tokens.split(",")]

    shape = SHAPES["smoke" if args.smoke else "1b"]
    max_len = args.context + max(counts) + 1
    decoder = random_decoder(shape, device, dtype, max_positions=max_len)
    config = arch_config(shape, max_len)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (smoke: no figures)"
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    print(
        f"device: {gpu}, compute capability {capability}; torch {torch.__version__}; {str(dtype).removeprefix('torch.')}"
    )
    print(
        f"weight-only int8: {cuda_twin.weight_int8_missing(device, dtype) or 'available'}; "
        f"fp8: {cuda_twin.fp8_missing(device) or 'available'}"
        + (
            f" (row-wise scales: {cuda_twin.rowwise_scales(device, dtype)})"
            if not cuda_twin.fp8_missing(device)
            else ""
        )
    )

    cache = KVCache(config, max_len, dtype=dtype, device=device)
    hidden = torch.zeros(1, max_len, config.hidden_size, dtype=dtype, device=device)
    segment = full_model(config.num_layers)
    with torch.inference_mode():
        prompt = torch.randint(3, config.vocab_size, (1, args.context), device=device)
        decoder(prompt, 0, cache)

    contenders = {"plain": StaticSteps(decoder, cache, hidden, capture)}
    for lowering in lowerings:
        missing = {
            "weight-only": cuda_twin.weight_int8_missing(device, dtype),
            "fp8": cuda_twin.fp8_missing(device),
        }.get(lowering)
        if missing:
            print(f"{lowering}: skipped ({missing})")
            continue
        set_twin_lowering(decoder, lowering)
        start = time.perf_counter()
        twin = int8_twin(decoder)
        made = time.perf_counter() - start
        forms = ", ".join(
            form if dims == "*" else f"{dims[0]}x{dims[1]} {form}" for dims, form in twin.product_forms.items()
        )
        print(
            f"{lowering}: twin made in {made:.1f} s, {twin.product_bytes / 2**20:.1f} MiB of products; forms: {forms}"
        )
        contenders[lowering] = StaticSteps(twin, cache, hidden, capture)
    set_twin_lowering(decoder, None)

    def timed(steps, t: int) -> float:
        ids = torch.randint(3, config.vocab_size, (t,), device=device)
        if device.type == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            for _ in range(args.calls):
                steps.run(segment, args.context, ids)
            end.record()
            end.synchronize()
            return begin.elapsed_time(end) / args.calls
        begin_s = time.perf_counter()
        for _ in range(args.calls):
            steps.run(segment, args.context, ids)
        return (time.perf_counter() - begin_s) * 1e3 / args.calls

    rows = []
    with torch.inference_mode():
        for t in counts:
            names = list(contenders)
            for steps in contenders.values():  # capture (and warm) each graph before timing
                timed(steps, t)
            times: dict[str, list[float]] = {name: [] for name in names}
            for turn in range(args.turns):
                order = names[turn % len(names) :] + names[: turn % len(names)]
                for name in order:
                    times[name].append(timed(contenders[name], t))
            plain = statistics.median(times["plain"])
            for name in names[1:]:
                twin_ms = statistics.median(times[name])
                rows.append((name, t, plain, twin_ms, twin_ms / plain))

    print()
    print("| twin lowering | tokens | plain step ms | twin step ms | twin / plain |")
    print("|---|---|---|---|---|")
    for name, t, plain, twin_ms, ratio in rows:
        print(f"| {name} | {t} | {plain:.3f} | {twin_ms:.3f} | {ratio:.2f} |")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
