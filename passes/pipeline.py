"""Passes and options as data: the pipeline of every ``--method``, and the options of ``build`` and ``tune``.

``METHODS`` is the one table of tuning methods: the CLI's ``--method`` choices and help, ``check_options``
and ``tune_ir`` all read it. Each entry names its passes (built lazily: this module imports no torch, so
``speccompile --help`` stays fast), whether the build's time budget steers it (``auto``: passes ordered by
expected value per second, skipped when their bound cannot beat the incumbent, ``passes/budget.py``), and
how its plans are confirmed and kept.

``TuningOptions`` / ``BuildOptions`` / ``TuneOptions`` are the options; a field's ``metadata["cli"]`` is its
command-line option (flags, help, default shown), from which ``speccompile/cli.py`` generates the click
options of both commands, so an option is written once.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Callable

# -- the methods -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Method:
    name: str
    help: str
    passes: Callable  # (PipelineInputs) -> list[Pass]
    budgeted: bool = False  # the build's time budget orders and skips its passes
    confirm_top: int | None = None  # confirm only the plans of highest expected speedup
    confirm_close: float | None = None  # ... and of those only the ones predicted this close to the best
    keep_only_default: bool = False


@dataclass
class PipelineInputs:
    context: object  # TuningContext
    options: object  # TuningOptions
    encode: Callable | None = None
    generic: bool = False  # the generic torch path: no draft heads (adapter, draft vocabulary)

    @property
    def progress(self) -> bool:
        return self.options.show_progress


def _auto(i: PipelineInputs) -> list:
    """Cheap first (lookup and retrieval), then passes whose bound can still beat the incumbent: precision
    self-drafts (int8, alone and behind lookup), early exit, layer skip, the exit adapter, reduced draft vocabularies,
    hybrids of lookup with each model plan; lookahead (alone and behind lookup) with the time left."""
    from .adapter import AdapterAutotune, DraftVocabTune
    from .autotune import CosineAutotune, ExitLayerAutotune
    from .lookahead_tune import LookaheadTune
    from .lookup_autotune import HybridAutotune, LookupAutotune
    from .precision_tune import PrecisionTune

    c, o, progress = i.context, i.options, i.progress
    # The precision draft right after lookup: the model draft that can beat lookup where others do not
    # (measured: docs/history.md, 'Figures behind the code's constants')
    passes = [LookupAutotune(c, retrieval=o.retrieval, show_progress=progress)]
    if not i.generic:  # the generic path has no precision draft (its model is transformers' own)
        passes.append(PrecisionTune(c, show_progress=progress, quick=True))
    passes += [
        ExitLayerAutotune(c, show_progress=progress, full=False),
        CosineAutotune(c, show_progress=progress, full=False),
    ]
    # Lookahead last: it runs the model to tune (seconds), and adds little behind lookup on the models measured
    lookahead = LookaheadTune(c, prompts=2, new_tokens=24, quick=True)
    if i.generic:  # no draft heads on the generic path
        return passes + [HybridAutotune(c, ("layer-skip", "early-exit"), show_progress=progress), lookahead]
    return passes + [
        AdapterAutotune(c, i.encode, tokens=o.adapter_tokens, show_progress=progress),
        DraftVocabTune(c, ("layer-skip", "early-exit")),
        HybridAutotune(c, ("layer-skip", "early-exit", "adapter"), show_progress=progress),
        lookahead,
    ]


def _cosine(i: PipelineInputs) -> list:
    from .autotune import CosineAutotune

    return [CosineAutotune(i.context, show_progress=i.progress)]


def _early_exit(i: PipelineInputs) -> list:
    from .autotune import ExitLayerAutotune

    return [ExitLayerAutotune(i.context, show_progress=i.progress)]


def _bayes(i: PipelineInputs) -> list:
    from .bayes_autotune import BayesAutotune

    o = i.options
    return _cosine(i) + [
        BayesAutotune(
            i.context, trials=o.trials, time_budget=o.time_budget, study_path=o.study, show_progress=i.progress
        )
    ]


def _lookup(i: PipelineInputs) -> list:
    from .lookup_autotune import LookupAutotune

    return [LookupAutotune(i.context, retrieval=i.options.retrieval, show_progress=i.progress)]


def _lookahead(i: PipelineInputs) -> list:
    from .lookahead_tune import LookaheadTune

    return _lookup(i) + [LookaheadTune(i.context)]


def _precision(i: PipelineInputs) -> list:
    from .precision_tune import PrecisionTune

    return _lookup(i) + [PrecisionTune(i.context, show_progress=i.progress)]


def _adapter(i: PipelineInputs) -> list:
    from .adapter import AdapterAutotune

    o = i.options
    return [
        AdapterAutotune(
            i.context,
            i.encode,
            exit_layer=o.exit_layer,
            tokens=o.adapter_tokens,
            time_budget=o.time_budget,
            show_progress=i.progress,
        )
    ]


METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        Method(
            "auto",
            "lookup and retrieval (chains and token trees) first, then, within the time budget, only the passes whose bound can beat "
            "the best plan so far (early exit, layer skip, precision self-drafts, exit adapter, reduced draft vocabularies, "
            "hybrids of lookup with each model draft, lookahead); keeps the fastest by timed runs on the backend (plain decoding if none pays)",
            _auto,
            budgeted=True,
            confirm_top=3,
            confirm_close=0.9,
            keep_only_default=True,
        ),
        Method("cosine", "skip the sublayers whose input and output are most alike", _cosine),
        Method("early-exit", "draft with the first E blocks and verify only the rest", _early_exit),
        Method("bayes", "Bayesian search over skipped sublayers, seeded with the cosine plans (keeps both)", _bayes),
        Method(
            "lookup",
            "model-free drafts (n-gram lookup over prompt and output, retrieval from the calibration text)",
            _lookup,
        ),
        Method(
            "lookahead",
            "the lookup plans, then lookahead decoding (a Jacobi window of guesses refined inside each "
            "verify call and the n-grams it produced; no draft model) alone and behind the best lookup plan, then "
            "LogitSpec and Token Recycling (the verifier's earlier top tokens), tuned by running them",
            _lookahead,
        ),
        Method(
            "precision",
            "the lookup plans, then the model drafting for itself with int8 / int4 products (ONNX Runtime: int8 "
            "and int4; torch: int8), alone and behind the best lookup plan, timed in rounds and scored in the real loop",
            _precision,
        ),
        Method(
            "adapter",
            "early exit through a small trained adapter (the model stays frozen) and a reduced draft vocabulary",
            _adapter,
        ),
    )
}


def method_help() -> str:
    return "; ".join(f"{m.name}: {m.help}" for m in METHODS.values()) + "."


# -- the options -------------------------------------------------------------------------------------


def option(default, *flags: str, commands: tuple[str, ...] = ("build", "tune"), **cli) -> object:
    """A dataclass field that is also a command-line option of ``commands`` (click keyword arguments in ``cli``;
    ``type`` may name one of the CLI's own parameter types, ``"device"``, ``"seconds"``, ``"exit_layer"``)."""
    return field(default=default, metadata={"cli": {"flags": flags, "commands": commands, **cli}})


@dataclass
class TuningOptions:
    method: str = option("auto", "--method", choices=tuple(METHODS), show_default=True, help=method_help())
    retrieval: bool = option(
        True,
        "--retrieval/--no-retrieval",
        show_default=True,
        help="Let lookup plans draft from a datastore of the calibration text and the model's "
        "continuations of it (stored in the artifact; kept only if it pays).",
    )
    trees: bool = option(
        True,
        "--trees/--no-trees",
        show_default=True,
        help="Let plans draft token trees (several continuations verified in one call) where the backend "
        "verifies them and the objective expects them to pay; --no-trees keeps chains only.",
    )
    calibration: str | None = option(
        None,
        "--calibration",
        type="path",
        help="Calibration text: .jsonl with a 'text' or 'prompt' field per line, or plain "
        "text split on blank lines. Default: a small built-in set.",
    )
    max_draft: int = option(
        8,
        "--max-draft",
        type=("int", 1, 32),
        show_default=True,
        help="Most tokens drafted per round; the tuner picks the best value up to this.",
    )
    calibration_tokens: int = option(
        64,
        "--calibration-tokens",
        type=("int", 4, 1024),
        show_default=True,
        help="Tokens the full model generates after each calibration prompt (what drafts are scored on).",
    )
    trials: int = option(
        200,
        "--trials",
        type=("int", 1, None),
        show_default=True,
        help="Bayesian search: total trials in the study (a resumed study runs only the rest).",
    )
    time_budget: float | None = option(
        None,
        "--time-budget",
        type="seconds",
        help="auto: seconds for the whole build, loading the model to the written "
        "artifact (default: 2500 plain decode steps of the model, timed here, at "
        "least 15 s and at most 50 s + 0.25 s per million parameters: 84 s for "
        "SmolLM2-135M); bayes: seconds of search; adapter: seconds for its pass (default 300).",
    )
    study: str | None = option(
        None,
        "--study",
        type="path",
        help="Bayesian search: SQLite file for the optuna study; rerun with it to continue.",
    )
    plot: str | None = option(
        None, "--plot", type="path", help="Bayesian search: write the search trace and chosen skip pattern to this PNG."
    )
    exit_layer: int | None = option(
        None,
        "--exit-layer",
        type="exit_layer",
        metavar="E|auto",
        help="Adapter: train it on the hidden state after block E (auto: try a few, keep the best).",
    )
    adapter_tokens: int | None = option(
        None,
        "--adapter-tokens",
        type=("int", 1, None),
        help="Adapter: teacher-forced training tokens (calibration, the model's "
        "continuations, then Python standard library sources) [default: 64 per "
        "hidden unit, at most 32768, fewer in a short auto budget].",
    )
    device: str = option(
        "cpu", "--device", type="device", show_default=True, help="Device to tune and time on (cpu, cuda, cuda:1)."
    )
    show_progress: bool = option(True, "--quiet", is_flag=True, invert=True, help="No progress bars.")
    confirm_prompts: int = 4
    confirm_tokens: int | None = None  # None: calibration_tokens, the length the estimates were made on


@dataclass
class BuildOptions(TuningOptions):
    model: str | None = None
    out: Path = option(
        Path("artifact"),
        "-o",
        "--out",
        commands=("build",),
        type="out_path",
        required=True,
        help="Artifact folder to write.",
    )
    backends: tuple[str, ...] = option(
        ("torch",),
        "--backend",
        commands=("build",),
        type="backends",
        show_default=True,
        help="Backends to write, comma-separated: torch (safetensors), onnx (graphs + one "
        "shared weights file, runs with numpy + onnxruntime + tokenizers only), or "
        "torch,onnx. Plans are tuned and confirmed on the first.",
    )
    dtype: str = option(
        "float32", "--dtype", commands=("build",), choices=("float32", "float16", "bfloat16"), show_default=True
    )
    quantize: str | None = option(
        None,
        "--quantize",
        commands=("build",),
        choices=("int8", "int4"),
        help="Weight-only quantize the ONNX graphs' linear layers and head (ONNX Runtime "
        "MatMulNBits, blocks of 32); the quantized model is then the one drafts are "
        "verified against.",
    )
    packed_rows: bool | None = option(
        None,
        "--packed-rows/--no-packed-rows",
        commands=("build",),
        help="Export ONNX graphs that run every row of a batched round in one call (GroupQueryAttention's "
        "query_seqlens, onnxruntime >= 1.32): verifies and prompt chunks share the batch's call under load. "
        "Default: on for --quantize targets (whose rows share no call otherwise), off for fp32.",
    )
    force: bool = option(
        False, "--force", commands=("build",), is_flag=True, help="Replace the output folder if it exists."
    )
    trust_remote_code: bool = option(
        False,
        "--trust-remote-code",
        commands=("build",),
        is_flag=True,
        help="Allow model code from the model folder (off by default).",
    )


@dataclass
class TuneOptions(TuningOptions):
    artifact: Path = Path("artifact")


def cli_fields(command: str) -> list:
    """The fields of ``command``'s options class that are command-line options, in declaration order."""
    cls = BuildOptions if command == "build" else TuneOptions
    return [f for f in fields(cls) if "cli" in f.metadata and command in f.metadata["cli"]["commands"]]


COMMAND_DEFAULTS = {"tune": {"method": "bayes"}}  # tune's --method defaults to the long search


def from_cli(command: str, values: dict, **extra):
    """The options object of ``command`` from click's parsed values (keyed by field name)."""
    cls = BuildOptions if command == "build" else TuneOptions
    kwargs = dict(extra)
    for f in cli_fields(command):
        value = values[f.name]
        kwargs[f.name] = (not value) if f.metadata["cli"].get("invert") else value
    return cls(**kwargs)
