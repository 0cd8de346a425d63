"""`speccompile build`: source model -> DecoderIR -> passes -> artifact."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Callable

import torch

from speccompile.artifact_writer import check_output, output_lock, source_folder, write_artifact
from speccompile.calibration import load_calibration
from speccompile.convert import arch_config, canonical_weights, choose_path
from speccompile.loading import SourceModel, load_source
from speccompile.passes.adapter import DRAFT_HEADS_DIR
from speccompile.passes.budget import CONFIRM_SHARE, Budget, cap_seconds, default_seconds
from speccompile.passes.call_costs import CALL_COST_ROWS, time_call_costs
from speccompile.passes.call_costs import estimated_seconds as call_costs_seconds
from speccompile.passes.confirm import MIN_TURNS, ChooseDefaultPlan, ConfirmPlans
from speccompile.passes.ir import DecoderIR
from speccompile.passes.pass_manager import PassManager
from speccompile.passes.pipeline import METHODS, BuildOptions, PipelineInputs, TuneOptions, TuningOptions
from speccompile.passes.prefill_chunk_timing import needed_seconds as prefill_chunk_seconds
from speccompile.passes.prefill_chunk_timing import time_prefill_chunk
from speccompile.passes.tuning import TuningContext
from speccompile.runners import make_runner
from speccompile.runtime.backends import BACKENDS
from speccompile.runtime.errors import SpeccompileError

__all__ = ["BuildOptions", "TuneOptions", "TuningOptions", "build", "tune", "tune_ir"]
CONVERSION_TOLERANCE = 1e-3  # fp32 logits; conversions that are right agree to ~1e-6


def eos_ids(source: SourceModel) -> list[int]:
    ids: set[int] = set()
    generation = getattr(source.model, "generation_config", None)
    for value in (
        getattr(generation, "eos_token_id", None),
        source.model.config.eos_token_id,
        source.tokenizer.eos_token_id,
    ):
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


def tuning_backend(backends) -> str:
    """The backend a build tunes and confirms on: the first one listed (the one ``generate`` runs by
    default); build once per backend for the best plan on each."""
    return list(backends or ["torch"])[0]


TURN_STEPS = 3.0  # a confirmation turn costs about this many plain decodes of its tokens (plain, then the plans)
MIN_CONFIRM_TOKENS = 16
WRITE_BYTES_PER_SECOND = 250e6  # an artifact's files written and hashed (the tuning runner's export writes none)


def parameter_count(ir: DecoderIR) -> int:
    return int(sum(p.numel() for p in ir.decoder().parameters()))


def plan_budget(budget: Budget, context: TuningContext, backends, parameters: int) -> None:
    """Size a budgeted build once calibration has timed the model: the default total from the step time (at
    most the cap for the model's size), the confirmation's length (its ``MIN_TURNS`` turns within
    ``CONFIRM_SHARE`` of the budget: shorter turns on a big model), and the reserve for confirmation and for
    writing the artifact (an ONNX export's graphs cost about what the tuning runner's first export did; the
    weights' bytes then go to disk and are hashed)."""
    if budget.total is None:
        budget.total = default_seconds(context.cost.plain_step(), parameters)
    step = context.costs.plain_step()
    fits = int(CONFIRM_SHARE * budget.total / (MIN_TURNS * TURN_STEPS * step))
    context.confirm_tokens = max(min(context.confirm_tokens, fits), MIN_CONFIRM_TOKENS)
    turn = TURN_STEPS * context.confirm_tokens * step
    export = context.timings.get("runner_backend", 0.0) if "onnx" in backends else 0.0
    written = 4 * parameters * len(list(backends))  # about the fp32 bytes per backend, written then hashed
    budget.write_reserve = 1.5 * export + written / WRITE_BYTES_PER_SECOND + 1.0
    # what the build measures after confirming: the prompt chunks a lone request reads long prompts in and the
    # batched call costs a server prices drafts with. Confirmation ends that much earlier (fewer turns); the
    # tuning passes keep their time, since a pass skipped for want of it can lose the best plan (a SmolLM2 build
    # that kept it from them lost its precision plan: 1.11x instead of 1.82x). Without this share confirmation spent
    # the whole budget: default artifacts read every prompt in one call (slower from about 1K tokens) and servers
    # timed the call costs at every start.
    budget.measure_reserve = prefill_chunk_seconds(step, context.ir.config.max_position_embeddings) + (
        call_costs_seconds(step, CALL_COST_ROWS, context.max_draft + 1, draft=True)
    )
    budget.reserve = MIN_TURNS * turn + budget.write_reserve


def tune_ir(
    ir: DecoderIR,
    prompts: list[list[int]],
    options,
    log: Callable[[str], None] = print,
    backend: str = "torch",
    encode: Callable[[str], list[int]] | None = None,
    eos: frozenset[int] = frozenset(),
    budget: Budget | None = None,
    backends=("torch",),
):
    """Calibrate, autotune by ``options.method`` (``METHODS``, ``passes/pipeline.py``), confirm by timed runs on
    ``backend``, pick the default plan.

    Shared by ``build`` and ``tune``; returns the IR. ``encode`` (text -> token ids) lets the adapter pass train on
    the offline default corpus. Calibration and confirmation stop at ``eos``, as generation does: the text a model
    babbles after its end-of-sequence token is repetitive, so lookup drafts predicted it well and flattered lookup
    plans (measured: docs/history.md, 'Figures behind the code's constants'). A budgeted method (``auto``) runs
    under ``budget`` (started by the caller when the model was loaded; a new one otherwise).
    """
    method = METHODS[options.method]
    if method.budgeted and budget is None:
        budget = Budget(options.time_budget)
    parameters = parameter_count(ir)
    if budget is not None and budget.cap is None and not budget.user_set:  # (tune: no loading to count from)
        budget.cap = cap_seconds(parameters)
    with tempfile.TemporaryDirectory(prefix="speccompile-tune-") as workdir:
        for relative, source in ir.extra_files.items():  # resources of plans already in the IR
            (Path(workdir) / relative).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, Path(workdir) / relative)
        runner = make_runner(backend, ir, Path(workdir))
        context = TuningContext.prepare(
            ir,
            prompts,
            options.calibration_tokens,
            options.max_draft,
            options.show_progress,
            options.confirm_prompts,
            options.confirm_tokens or options.calibration_tokens,
            runner=runner,
            workdir=Path(workdir),
            eos=eos,
            trees=options.trees,
            budget=budget if method.budgeted else None,
        )
        if method.budgeted:
            plan_budget(budget, context, backends, parameters)
            why = "--time-budget" if budget.user_set else f"default: the step time, at most {budget.cap:.0f}s"
            log(
                f"calibration done in {sum(context.timings.values()):.1f}s ({len(context.references)} "
                f"continuations, {sum(len(r.targets) + 1 for r in context.references)} tokens); time budget "
                f"{budget.total:.0f}s ({why}), {budget.tuning_left():.0f}s left for tuning passes"
            )
        inputs = PipelineInputs(context, options, encode, generic=ir.config.decoder == "generic")
        passes = method.passes(inputs)
        passes += [
            ConfirmPlans(
                context, options.show_progress, top=method.confirm_top, sequential=True, close=method.confirm_close
            ),
            ChooseDefaultPlan(keep_only_default=method.keep_only_default),
        ]
        ir = PassManager(passes, log, budget if method.budgeted else None)(ir)
        seconds_left = budget.left() - budget.write_reserve if method.budgeted else None
        time_prefill_chunk(runner, ir, seconds_left, context.costs.plain_step(), log)
        seconds_left = budget.left() - budget.write_reserve if method.budgeted else None
        time_call_costs(runner, ir, seconds_left, context.costs.plain_step(), log)
        runner.release()  # the tuning sessions' packed weights are not kept while the artifact is written
        if ir.default_plan is None:
            log(
                f"warning: no draft plan beat plain decoding on {context.device} (best confirmed "
                f"{ir.tuning['best_confirmed_speedup']:.2f}x); the artifact decodes plainly by default"
            )
        ir.tuning.update(
            method=options.method,
            device=context.device,
            backend=backend,
            token_trees=context.trees,
            calibration={
                "source": options.calibration or "built-in",
                "prompts": len(prompts),
                "new_tokens": options.calibration_tokens,
                "continuations": len(context.references),
                "continuation_tokens": sum(len(r.targets) + 1 for r in context.references),
                "confirm_tokens": context.confirm_tokens,
                "seconds": context.timings,
            },
            cost_model=context.cost.as_dict(),
            step_costs=context.costs.as_dict(),
        )
        if budget is not None:
            ir.tuning["budget"] = budget.as_dict()
        bayes = next((p for p in passes if p.name == "bayes_autotune"), None)
        if bayes is not None and options.plot:
            from speccompile.plots import plot_search

            plot_search(options.plot, bayes.trace, ir)
            log(f"wrote {options.plot}")
        used_heads = {plan.draft_head_file for plan in ir.plans.values()}  # draft heads of plans auto dropped
        for relative in [r for r in ir.extra_files if r.startswith(DRAFT_HEADS_DIR + "/") and r not in used_heads]:
            del ir.extra_files[relative]
        # Plan resources (a datastore) live in the scratch folder: keep them until the artifact is written.
        if ir.extra_files:
            ir.scratch = tempfile.TemporaryDirectory(prefix="speccompile-resources-")
            keep = Path(ir.scratch.name)
            for relative, source in list(ir.extra_files.items()):
                (keep / relative).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(source, keep / relative)
                ir.extra_files[relative] = keep / relative
    return ir


def build(options: BuildOptions, log: Callable[[str], None] = print) -> Path:
    check_options(options)
    budget = Budget(options.time_budget) if METHODS[options.method].budgeted else None  # the whole command's
    out = check_output(Path(options.out), options.force, source=source_folder(options.model))  # before the slow part
    with output_lock(out):  # held for the whole build: a second build of the same OUT fails at once
        return _build_locked(options, log, budget)


def _build_locked(options: BuildOptions, log: Callable[[str], None], budget: Budget | None) -> Path:
    texts = load_calibration(options.calibration)
    source = load_source(options.model, trust_remote_code=options.trust_remote_code)
    path = choose_path(source.model)  # refuses, in one line, what cannot be drafted losslessly
    parameters = sum(p.numel() for p in source.model.parameters())
    if budget is not None and not budget.user_set:
        budget.cap = cap_seconds(parameters)  # what calibration is sized by, before the step time is known
    log(
        f"loaded {source.name} ({source.model.config.model_type}, {parameters / 1e6:.1f}M parameters) from "
        f"{source.path}" + (f" [{budget.progress()}]" if budget is not None else "")
    )
    if path.path == "generic":
        check_generic_options(options, source.model.config.model_type, path.why)
        ir = DecoderIR(path.decoder.config, {}, dtype="float32", device="cpu")
        ir.attach_decoder(path.decoder)
        diff = check_conversion(ir, source)  # the same modules, so this checks the hooks, in fp32 on CPU
        ir.dtype, ir.device = options.dtype, options.device
        path.decoder.to(
            device=options.device, dtype=getattr(torch, options.dtype)
        )  # the source model is not used again
    else:
        config = arch_config(source.model)
        ir = DecoderIR(config, canonical_weights(source.model, config), dtype=options.dtype, device=options.device)
        ir.tuning["onnx_export"] = onnx_export_options(options)
        diff = check_conversion(ir, source)
        source.model.to("meta")  # the canonical decoder holds the weights now (the same tensors): one copy
    config = ir.config
    ir.tuning["decoder_path"] = {"path": path.path, "why": path.why}
    log(f"decoder path: {path.path} ({path.why})")
    log(f"{path.path} decoder matches transformers: max |logit diff| = {diff:.1e}")
    if options.dtype != "float32":
        # A k-token verify and the one-token steps it replaces round differently in half precision by a few
        # units in the last place, and speculative output then leaves plain output on many prompts, at top-2 gaps
        # within a few ulps (measured: docs/history.md, 'Figures behind the code's constants'). Said once, here,
        # not discovered later.
        log(
            f"note: in {options.dtype} speculative output equals plain output up to near-ties of a few units in the "
            f"last place of {options.dtype}, which are common; build in float32 where token-identical output matters"
        )
    ir.tuning["conversion_max_abs_diff"] = diff
    ir.tuning["memory"] = {"fp32_weights_bytes": 4 * parameters}

    room = options.calibration_tokens + options.max_draft + 2
    prompts = calibration_prompts(texts, source.tokenizer, config.max_position_embeddings, room)
    ir = tune_ir(
        ir,
        prompts,
        options,
        log,
        backend=tuning_backend(options.backends),
        encode=lambda text: source.tokenizer(text)["input_ids"],
        eos=frozenset(eos_ids(source)),
        budget=budget,
        backends=options.backends,
    )
    source_record = {
        "model": source.name,
        "path": str(source.path.resolve()),
        "revision": source.revision,
        "architecture": type(source.model).__name__,
        "model_type": config.model_type,
    }
    tokens = {
        "eos_token_ids": eos_ids(source),
        "bos_token_id": source.tokenizer.bos_token_id,
        "pad_token_id": source.tokenizer.pad_token_id,
    }
    written = write_artifact(
        Path(options.out), ir, source.tokenizer, source_record, tokens, options.force, options.backends
    )
    if budget is not None:
        log(f"build took {budget.elapsed():.1f}s (budget {budget.total:.0f}s)")
    return written


def onnx_export_options(options: BuildOptions) -> dict:
    """How ``build`` exports ONNX graphs: fused for ONNX Runtime's CPU kernels on CPU (standard ONNX ops
    elsewhere), weight-only quantized with ``--quantize``."""
    portable = options.device != "cpu" or "tensorrt" in options.backends  # TensorRT parses standard ONNX only
    variant = "standard" if portable and not options.quantize else "fused"
    packed = {"packed_rows": True} if packed_rows(options) and variant == "fused" else {}
    return {"variant": variant, **({"quantize": options.quantize} if options.quantize else {}), **packed}


def packed_rows(options: BuildOptions) -> bool:
    """Whether the fused graphs take packed rows (``--packed-rows``), by default for quantized targets only: their
    rows share no call otherwise (int8 activations need every row to compute what it computes alone, which only
    packed rows give), and their packed one-token call is no dearer; for fp32 the older graphs already batch
    one-token rows, and single-stream decoding, what the build tunes and confirms, gains nothing from packing
    (measured: docs/history.md, 'Figures behind the code's constants')."""
    chosen = getattr(options, "packed_rows", None)
    return bool(options.quantize) if chosen is None else bool(chosen)


def onnx_export_of(manifest) -> dict:
    """The export options of an artifact's ONNX graphs, so that ``tune`` re-exports the same kind."""
    if "onnx" not in manifest.backends:
        return {}
    from speccompile.exporters.onnx_export import export_options

    return export_options(manifest.backends["onnx"])


def check_generic_options(options, model_type: str, why: str) -> None:
    """What the generic torch path cannot do, refused in one line before any tuning."""
    # tune keeps the artifact's backends
    others = [b for b in getattr(options, "backends", ("torch",)) if BACKENDS.descriptor(b).canonical_only]
    if others:
        raise SpeccompileError(
            f"'{model_type}' runs on the generic torch path ({why.split(':')[0]}); "
            f"--backend {','.join(others)} needs a canonical conversion: use --backend torch"
        )
    if options.method == "adapter":
        raise SpeccompileError(
            f"--method adapter needs a canonical family; '{model_type}' runs on the generic path: "
            "use --method auto, early-exit, cosine, bayes or lookup"
        )
    if getattr(options, "dtype", "float32") != "float32" and options.device == "cpu":
        raise SpeccompileError(
            f"--dtype {options.dtype} on CPU is not supported on the generic path; use --dtype float32"
        )


def check_options(options) -> None:
    if getattr(options, "quantize", None) and "onnx" not in getattr(options, "backends", ()):
        raise SpeccompileError(
            f"--quantize {options.quantize} quantizes the ONNX graphs; add --backend onnx (or torch,onnx)"
        )
    if options.method not in METHODS:
        raise SpeccompileError(f"unknown --method '{options.method}'; choose one of {', '.join(METHODS)}")
    if options.max_draft < 1:
        raise SpeccompileError("--max-draft must be at least 1")
    if options.exit_layer is not None and options.method != "adapter":
        raise SpeccompileError("--exit-layer chooses where the adapter is trained; use it with --method adapter")
    if options.adapter_tokens is not None and options.adapter_tokens < 1:
        raise SpeccompileError(f"--adapter-tokens must be at least 1, got {options.adapter_tokens}")
    if options.plot and options.method != "bayes":
        raise SpeccompileError("--plot draws the Bayesian search; use it with --method bayes")
    unknown = [b for b in getattr(options, "backends", ()) if b not in BACKENDS]
    if unknown or not getattr(options, "backends", ("torch",)):
        raise SpeccompileError(
            f"unknown --backend {','.join(unknown)!r}; choose from {', '.join(BACKENDS)} (comma-separated for several)"
        )
    for name in getattr(options, "backends", ()):  # before the slow part: e.g. TensorRT needs its packages and a GPU
        BACKENDS.descriptor(name).check_available()
    if options.plot and not str(options.plot).lower().endswith(".png"):
        raise SpeccompileError(f"--plot needs a .png file name, got '{options.plot}'")


def tune(options: TuneOptions, log: Callable[[str], None] = print) -> Path:
    """Retune an existing artifact (another device or calibration set) without the source model."""
    from speccompile.artifact_writer import check_rewritable, read_canonical_weights, rewrite_artifact
    from speccompile.runtime.artifact.tokenizer import TextTokenizer
    from speccompile.runtime.model import TOKENIZER_FILE, read_artifact

    check_options(options)
    root = Path(options.artifact)
    check_rewritable(root)  # fail before the slow part
    manifest = read_artifact(root)
    generic = manifest.config.decoder == "generic"
    ir = DecoderIR(
        manifest.config,
        {} if generic else read_canonical_weights(root, manifest),
        dtype=manifest.dtype,
        device=options.device,
        plans=dict(manifest.plans),
        default_plan=manifest.default_plan,
        tuning={key: manifest.tuning.get(key) for key in ("conversion_max_abs_diff", "decoder_path")},
    )
    ir.tuning["onnx_export"] = onnx_export_of(manifest)
    if generic:
        from speccompile.runtime.backends.torch.hf_decoder import HF_FOLDER, HFDecoder

        check_generic_options(options, manifest.config.model_type, "the artifact's decoder path")
        ir.attach_decoder(HFDecoder.from_folder(root / HF_FOLDER, getattr(torch, manifest.dtype), options.device))
    for plan in ir.plans.values():  # figures measured elsewhere are re-measured here
        for key in [k for k in plan.measured if k.startswith("confirmed_") or k == "plain_tokens_per_s"]:
            del plan.measured[key]
    tokenizer = TextTokenizer(root / TOKENIZER_FILE)
    room = options.calibration_tokens + options.max_draft + 2
    texts = load_calibration(options.calibration)
    prompts = [
        ids[: max(1, manifest.config.max_position_embeddings - room)] for ids in map(tokenizer.encode, texts) if ids
    ]
    scales = manifest.backends.get("torch", {}).get("int8_scales_file")
    if scales and not generic:  # the int8 twin's smoothing carries over, and the retuning runs the same twin
        from safetensors.torch import load_file

        from speccompile.runtime.backends.torch.int8_twin import set_input_scales

        ir.extra_files[scales] = root / scales
        set_input_scales(ir.decoder(), load_file(str(root / scales)))
    for plan in ir.plans.values():  # resources of kept plans (a datastore) carry over
        if plan.option("retrieval", "datastore"):
            ir.extra_files[plan.option("retrieval", "datastore")] = root / plan.option("retrieval", "datastore")
        if plan.draft_head_file:
            ir.extra_files[plan.draft_head_file] = root / plan.draft_head_file
    ir = tune_ir(
        ir,
        prompts,
        options,
        log,
        backend=tuning_backend(manifest.backends),
        encode=tokenizer.encode,
        eos=manifest.eos_ids,
    )

    def update(m):
        m.plans = ir.plans
        m.default_plan = ir.default_plan
        m.tuning = {**m.tuning, **ir.tuning, "retuned": True}

    return rewrite_artifact(root, ir, update)
