"""How often a quantized copy of a model picks the model's own greedy token (what acceptance a
precision self-draft can reach, and which products can take int4), without building anything.

    python benchmarks/experiments/quant_agreement.py [MODEL_DIR] [--prompts FILE] [--new-tokens 64]

The model's greedy continuation of every prompt is computed once; then each configuration's products are
fake-quantized (quantized and de-quantized in fp32) and the copy is run teacher-forced over those
continuations: the printed figure is the share of continuation positions where its argmax equals the
model's (the first drafted token of a round sees exactly this; later ones see the draft's own KV as well, so
a real loop accepts somewhat less: ``benchmarks/experiments/precision_draft.py``). Weight grids are symmetric or
asymmetric blocks along the input dimension, as ``MatMulNBits`` stores them; "block activations" quantizes each
product's input to int8 per block of the same size, as ONNX Runtime's accuracy level 4 does; "row" is int8
per output channel with the input quantized per row (``DynamicQuantizeMatMul``, torch's dynamic int8). The head
is untied from the embedding first, so only the head product is quantized.

Default MODEL_DIR: ``artifacts/smollm2-135m-instruct`` (``benchmarks/smollm2.py`` makes it): a Q4_1 GGUF's
weights (its embedding / head Q8_0), so grids near those flatter the copy; refcoder (``models/refcoder``) was
trained in fp32.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

BENCHMARKS = Path(__file__).resolve().parent.parent  # benchmarks/ (this script is in benchmarks/experiments/)
GROUPS = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
    "head": ("lm_head",),
}


def _blocks(x: torch.Tensor, block: int) -> tuple[torch.Tensor, int]:
    width = x.shape[-1]
    padded = F.pad(x, (0, -(-width // block) * block - width))
    return padded.reshape(*x.shape[:-1], padded.shape[-1] // block, block), width


def block_weights(w: torch.Tensor, bits: int, block: int, symmetric: bool) -> torch.Tensor:
    wb, width = _blocks(w, block)
    if symmetric:
        qmax = 2 ** (bits - 1) - 1
        scale = (wb.abs().amax(-1, keepdim=True) / qmax).clamp(min=1e-12)
        deq = (wb / scale).round().clamp(-qmax - 1, qmax) * scale
    else:
        levels = 2**bits - 1
        low, high = wb.amin(-1, keepdim=True).clamp(max=0), wb.amax(-1, keepdim=True).clamp(min=0)
        scale = ((high - low) / levels).clamp(min=1e-12)
        zero = (-low / scale).round()
        deq = ((wb / scale).round() + zero).clamp(0, levels).sub(zero) * scale
    return deq.reshape(*w.shape[:-1], -1)[..., :width]


def block_activations(x: torch.Tensor, block: int) -> torch.Tensor:
    xb, width = _blocks(x, block)
    scale = (xb.abs().amax(-1, keepdim=True) / 127).clamp(min=1e-12)
    return ((xb / scale).round() * scale).reshape(*x.shape[:-1], -1)[..., :width]


def channel_weights(w: torch.Tensor) -> torch.Tensor:
    scale = (w.abs().amax(1, keepdim=True) / 127).clamp(min=1e-12)
    return (w / scale).round().clamp(-127, 127) * scale


def row_activations(x: torch.Tensor) -> torch.Tensor:
    low, high = x.amin(-1, keepdim=True).clamp(max=0), x.amax(-1, keepdim=True).clamp(min=0)
    scale = ((high - low) / 255).clamp(min=1e-12)
    zero = (-low / scale).round()
    return ((x / scale).round() + zero).clamp(0, 255).sub(zero) * scale


def grid(bits: int, block: int, symmetric: bool, activations: bool):
    return (
        lambda w: block_weights(w, bits, block, symmetric),
        (lambda x: block_activations(x, block)) if activations else None,
    )


ROW = (channel_weights, row_activations)


def configurations() -> dict[str, dict]:
    i4, i4a, i8 = grid(4, 128, True, False), grid(4, 32, False, False), grid(8, 128, True, False)
    every = lambda g: dict.fromkeys(GROUPS, g)  # noqa: E731
    out = {
        "int8 b128s, weights only": every(i8),
        "int8 b32 asym, weights only": every(grid(8, 32, False, False)),
        "int4 b128s, weights only": every(i4),
        "int4 b32 asym, weights only": every(i4a),
    }
    for group in ("qkv", "o", "gate_up", "down", "head"):
        out[f"int4 b128s on {group} alone"] = {group: i4}
    out["int4 b128s on qkv/o/gate_up, int8 b128s elsewhere"] = {**every(i8), "qkv": i4, "o": i4, "gate_up": i4}
    out["int8 b128s, block activations (ORT MatMulNBits, accuracy 4)"] = every(grid(8, 128, True, True))
    out["int8 b32s, block activations"] = every(grid(8, 32, True, True))
    out["int8 b32 asym, block activations"] = every(grid(8, 32, False, True))
    out["int4 b128s, block activations"] = every(grid(4, 128, True, True))
    out["int8 row everywhere (per-row activations)"] = every(ROW)
    out["int8 row, down projections int8 b128s block activations"] = {**every(ROW), "down": grid(8, 128, True, True)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default=str(BENCHMARKS.parent / "artifacts" / "smollm2-135m-instruct"))
    parser.add_argument("--prompts", default=str(BENCHMARKS / "data" / "smollm2_prompts.jsonl"))
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    if not Path(args.model).is_dir():
        raise SystemExit(f"no model folder at {args.model}; run python benchmarks/smollm2.py first, or pass one")
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    if model.lm_head.weight is model.get_input_embeddings().weight:  # untie: quantize the head product only
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    prompts = [json.loads(line)["prompt"] for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    with torch.inference_mode():
        sequences = []
        for prompt in prompts:
            ids = tokenizer(prompt, return_tensors="pt").input_ids
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=args.new_tokens,
                do_sample=False,
                pad_token_id=tokenizer.eos_token_id,
            )
            sequences.append((out, ids.shape[1]))
        reference = [model(s).logits[0].argmax(-1) for s, _ in sequences]
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    originals = {n: m.weight.detach().clone() for n, m in linears.items()}

    def group_of(name: str) -> str | None:
        return next((g for g, parts in GROUPS.items() if any(name.endswith(p) for p in parts)), None)

    print(f"{args.model}: {len(prompts)} prompts, {args.new_tokens} new tokens, teacher-forced greedy agreement")
    for label, rule in configurations().items():
        for name, linear in linears.items():
            weights, acts = rule.get(group_of(name), (None, None))
            with torch.no_grad():
                linear.weight.copy_(weights(originals[name]) if weights else originals[name])
            linear.forward = (lambda m, a: lambda x: F.linear(a(x) if a else x, m.weight, m.bias))(linear, acts)
        agree = total = 0
        with torch.inference_mode():
            for (s, start), ref in zip(sequences, reference):
                got = model(s).logits[0].argmax(-1)
                agree += int((got[start - 1 : -1] == ref[start - 1 : -1]).sum())
                total += len(got) - start
        print(f"  {label:62s} {agree / total:.3f}", flush=True)


if __name__ == "__main__":
    main()
