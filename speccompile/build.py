"""`speccompile build`: source model -> DecoderIR -> passes -> artifact."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from speccompile.artifact import check_output, write_artifact
from speccompile.calibration import load_calibration
from speccompile.convert import arch_config, canonical_weights
from speccompile.loading import SourceModel, load_source
from speccompile.passes.autotune import CosineAutotune, ExitLayerAutotune
from speccompile.passes.base import PassManager
from speccompile.passes.confirm import ConfirmPlans
from speccompile.passes.ir import DecoderIR
from speccompile.passes.tuning import TuningContext
from speccompile.runtime.errors import SpeccompileError

METHODS = ("cosine", "early-exit")
CONVERSION_TOLERANCE = 1e-3  # fp32 logits; conversions that are right agree to ~1e-6


@dataclass
class BuildOptions:
    model: str | None
    out: Path
    method: str = "cosine"
    calibration: str | None = None
    max_draft: int = 8
    dtype: str = "float32"
    device: str = "cpu"
    force: bool = False
    trust_remote_code: bool = False
    calibration_tokens: int = 64
    confirm_prompts: int = 4
    confirm_tokens: int = 48
    show_progress: bool = True


def eos_ids(source: SourceModel) -> list[int]:
    ids: set[int] = set()
    generation = getattr(source.model, "generation_config", None)
    for value in (getattr(generation, "eos_token_id", None), source.model.config.eos_token_id,
                  source.tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return sorted(ids)


@torch.inference_mode()
def check_conversion(ir: DecoderIR, source: SourceModel) -> float:
    """Compare the canonical decoder's logits with transformers' on one input; refuse a bad conversion."""
    generator = torch.Generator().manual_seed(0)
    length = min(16, ir.config.max_position_embeddings)
    ids = torch.randint(0, ir.config.vocab_size, (1, length), generator=generator)
    reference = source.model.float()(ids).logits
    ours = ir.decoder()(ids.to(ir.device)).float().cpu()
    diff = float((reference - ours).abs().max())
    tolerance = CONVERSION_TOLERANCE if ir.dtype == "float32" else 5e-2 * float(reference.abs().max())
    if not diff <= tolerance:
        raise SpeccompileError(
            f"converted model disagrees with transformers (max |logit diff| {diff:.2e} > {tolerance:.0e}); "
            "this architecture variant is not handled correctly, please report it"
        )
    return diff


def calibration_prompts(texts: list[str], tokenizer, context: int, room: int) -> list[list[int]]:
    prompts = []
    for text in texts:
        ids = tokenizer(text)["input_ids"]
        if ids:
            prompts.append(ids[: max(1, context - room)])
    if not prompts:
        raise SpeccompileError("calibration text tokenized to nothing; pass --calibration with some text")
    return prompts


def build(options: BuildOptions, log: Callable[[str], None] = print) -> Path:
    if options.method not in METHODS:
        raise SpeccompileError(f"unknown --method '{options.method}'; choose one of {', '.join(METHODS)}")
    if options.max_draft < 1:
        raise SpeccompileError("--max-draft must be at least 1")
    check_output(Path(options.out), options.force)  # fail before the slow part
    texts = load_calibration(options.calibration)
    source = load_source(options.model, trust_remote_code=options.trust_remote_code)
    log(f"loaded {source.name} ({source.model.config.model_type}, "
        f"{sum(p.numel() for p in source.model.parameters()) / 1e6:.1f}M parameters) from {source.path}")

    config = arch_config(source.model)
    ir = DecoderIR(config, canonical_weights(source.model, config), dtype=options.dtype, device=options.device)
    diff = check_conversion(ir, source)
    log(f"canonical decoder matches transformers: max |logit diff| = {diff:.1e}")

    room = options.calibration_tokens + options.max_draft + 2
    prompts = calibration_prompts(texts, source.tokenizer, config.max_position_embeddings, room)
    context = TuningContext.prepare(ir, prompts, options.calibration_tokens, options.max_draft, options.show_progress)
    tune = CosineAutotune if options.method == "cosine" else ExitLayerAutotune
    passes = [tune(context, show_progress=options.show_progress),
              ConfirmPlans(prompts[: options.confirm_prompts], options.confirm_tokens, options.show_progress)]
    ir = PassManager(passes, log)(ir)
    ir.tuning.update(
        method=options.method, device=context.device, conversion_max_abs_diff=diff,
        calibration={"source": options.calibration or "built-in", "prompts": len(prompts),
                     "new_tokens": options.calibration_tokens},
        cost_model=context.cost.as_dict(),
    )
    source_record = {
        "model": source.name, "path": str(source.path.resolve()), "revision": source.revision,
        "architecture": type(source.model).__name__, "model_type": config.model_type,
    }
    tokens = {"eos_token_ids": eos_ids(source), "bos_token_id": source.tokenizer.bos_token_id,
              "pad_token_id": source.tokenizer.pad_token_id}
    return write_artifact(Path(options.out), ir, source.tokenizer, source_record, tokens, options.force)
