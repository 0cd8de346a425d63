"""The `speccompile` command line: build, generate, bench, inspect."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import sys
from contextlib import contextmanager
from functools import wraps
from pathlib import Path

import click

from speccompile.passes.pipeline import COMMAND_DEFAULTS, cli_fields, from_cli
from speccompile.runtime.errors import SpeccompileError
from speccompile.server.limits import (
    DEFAULT_HOST,
    DEFAULT_MAX_BATCH,
    DEFAULT_MAX_QUEUE,
    DEFAULT_PORT,
    DEFAULT_PREFILL_CHUNK,
    DEFAULT_REPLICA_CPUS,
    DEFAULT_SCALE_DOWN_AFTER_S,
    MAX_BATCH_BOUNDS,
)


class Terminated(BaseException):
    """SIGTERM (timeouts, ``kill``, CI cancellation) as an exception, so that ``finally`` blocks remove
    temp folders and release the output lock exactly as for Ctrl-C. A BaseException: handlers written
    for ``Exception`` must not swallow it."""


@contextmanager
def _sigterm_raises():
    if sys.platform == "win32" or signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None):
        yield  # someone (a test runner, a server) already handles SIGTERM: leave it to them
        return

    def handler(signum, frame):
        raise Terminated()

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _one_line(text: str, limit: int = 400) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def friendly_errors(command):
    """The CLI's one error boundary (every command goes through it).

    A problem the user can fix (SpeccompileError, an OS error on a file) prints one ``error:`` line and
    exits 1; Ctrl-C exits 130 and SIGTERM 143, after temp files are removed. Anything else is a bug: one
    line naming the exception plus a hint to rerun with ``--debug`` (or SPECCOMPILE_DEBUG=1), which
    shows the traceback instead. Adds the ``--debug`` option to the command."""

    @click.option("--debug", is_flag=True, help="On an unexpected error, show the full traceback.")
    @wraps(command)
    def wrapper(*args, debug=False, **kwargs):
        debug = debug or os.environ.get("SPECCOMPILE_DEBUG", "") not in ("", "0")
        try:
            with _sigterm_raises():
                return command(*args, **kwargs)
        except (click.exceptions.Exit, click.ClickException, click.Abort):
            raise
        except SpeccompileError as exc:
            if debug:
                raise
            click.echo(f"error: {_one_line(exc)}", err=True)
            sys.exit(1)
        except KeyboardInterrupt:
            click.echo("interrupted; nothing was written", err=True)
            sys.exit(130)
        except Terminated:
            click.echo("terminated (SIGTERM); nothing was written", err=True)
            sys.exit(143)
        except OSError as exc:
            if debug:
                raise
            where = f" ({exc.filename})" if exc.filename else ""
            click.echo(
                f"error: {_one_line(exc.strerror or exc)}{where}; check the path, its permissions and the free "
                "disk space",
                err=True,
            )
            sys.exit(1)
        except Exception as exc:
            if debug:
                raise
            click.echo(
                f"error: unexpected {type(exc).__name__}: {_one_line(exc, 200)}; this is a bug: rerun with "
                "--debug for the traceback and please report it",
                err=True,
            )
            sys.exit(1)

    return wrapper


class FiniteFloat(click.FloatRange):
    """A float range that also refuses nan and inf (click's ranges let nan through: it compares false)."""

    name = "finite float"

    def convert(self, value, param, ctx):
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return number


class DeviceType(click.ParamType):
    """``cpu``, ``cuda`` or ``cuda:N``; with ``check_torch`` also that PyTorch sees that GPU (build and tune
    need torch anyway; generate's backend checks its own device when it opens)."""

    name = "device"
    PATTERN = re.compile(r"cpu|cuda(:\d+)?")

    def __init__(self, check_torch: bool = False):
        self.check_torch = check_torch

    def convert(self, value, param, ctx):
        value = str(value).strip().lower()
        if not self.PATTERN.fullmatch(value):
            self.fail(f"unknown device {value!r}; use cpu, cuda or cuda:N", param, ctx)
        if self.check_torch and value != "cpu":
            import torch

            index = int(value.partition(":")[2] or 0)
            if not torch.cuda.is_available():
                self.fail(
                    f"{value!r} needs a CUDA GPU, but PyTorch sees none (torch {torch.__version__}); use --device cpu",
                    param,
                    ctx,
                )
            if index >= torch.cuda.device_count():
                self.fail(
                    f"{value!r}: PyTorch sees only {torch.cuda.device_count()} GPU(s); use cuda:0.."
                    f"{torch.cuda.device_count() - 1}",
                    param,
                    ctx,
                )
        return value


def utf8_text(ctx, param, value):
    """Refuse text that is not valid UTF-8 (argv bytes click could only decode with surrogates)."""
    if value is not None:
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise click.BadParameter("is not valid UTF-8 text; pass UTF-8 (check the terminal's locale)") from None
    return value


class SpeccompileGroup(click.Group):
    """Prints a subcommand's usage error (bad option value, unknown option or command) as one
    ``error:`` line, exit code 2, like every other error."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except click.UsageError as exc:
            where = exc.ctx.command_path if exc.ctx is not None else ctx.command_path
            click.echo(f"error: {_one_line(exc.format_message())} (see '{where} --help')", err=True)
            ctx.exit(exc.exit_code)


def exit_layer_value(ctx, param, value):
    """--exit-layer: a block number, or auto (None)."""
    if value is None or value.strip().lower() == "auto":
        return None
    try:
        layer = int(value)
    except ValueError:
        raise click.BadParameter(f"{value!r} is neither a block number nor auto") from None
    if layer < 1:
        raise click.BadParameter(f"{layer} is not a block number >= 1")
    return layer


def backends_value(ctx, param, value):
    """--backend: a comma-separated list."""
    return tuple(b.strip() for b in value.split(",") if b.strip())


def _click_option(f, command: str):
    """The click option of one options field (``passes/pipeline.py``'s ``option`` metadata)."""
    spec = dict(f.metadata["cli"])
    flags, kind = spec.pop("flags"), spec.pop("type", None)
    spec.pop("commands")
    invert = spec.pop("invert", False)
    default = COMMAND_DEFAULTS.get(command, {}).get(f.name, f.default)
    if "choices" in spec:
        spec["type"] = click.Choice(list(spec.pop("choices")))
    elif isinstance(kind, tuple):  # ("int", low, high)
        spec["type"] = click.IntRange(kind[1], kind[2])
    elif kind is not None:
        spec.update(
            {
                "path": {"type": click.Path()},
                "out_path": {"type": click.Path(path_type=Path)},
                "seconds": {"type": FiniteFloat(min=1)},
                "device": {"type": DeviceType(check_torch=True)},
                "exit_layer": {"callback": exit_layer_value},
                "backends": {"callback": backends_value},
            }[kind]
        )
        if kind == "backends":
            default = ",".join(default)
    if spec.get("required"):
        default = None
    if invert:  # --quiet sets show_progress False: the flag's own default is off
        default = False
    return click.option(*flags, f.name, default=default, **spec)


def tuning_options(command_name: str):
    """Every options field of ``build`` or ``tune`` as a click option, written once (``passes/pipeline.py``)."""

    def decorate(command):
        for f in reversed(cli_fields(command_name)):
            command = _click_option(f, command_name)(command)
        return command

    return decorate


@click.group(cls=SpeccompileGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="speccompile")
def main():
    """Compile a Hugging Face causal LM into a self-speculative model: it drafts tokens with a cheap
    subgraph of itself (early exit or skipped sublayers) and verifies them with the full model, so the
    output is exactly the full model's greedy output, only faster."""


@main.command()
@click.argument("model", required=False)
@tuning_options("build")
@friendly_errors
def build(model, **values):
    """Build a self-speculative artifact from MODEL (a local folder, a cached hub id, or nothing for the
    bundled reference model)."""
    from speccompile.build import build as run_build
    from speccompile.build_memory import describe_peak, peak_resident_bytes
    from speccompile.runtime import read_artifact

    path = run_build(from_cli("build", values, model=model), log=lambda message: click.echo(message, err=True))
    report_plans(path, "wrote")
    weights = (read_artifact(path).tuning.get("memory") or {}).get("fp32_weights_bytes")
    click.echo(f"wrote {path}: peak resident memory of the build {describe_peak(peak_resident_bytes(), weights)}")


def report_plans(path: Path, verb: str) -> None:
    from speccompile.runtime import read_artifact
    from speccompile.runtime.drafting import describe

    manifest = read_artifact(path)
    for name, plan in manifest.plans.items():
        m = plan.measured
        default = ", default" if name == manifest.default_plan else ""
        click.echo(
            f"{verb} {path}: plan '{name}' ({describe(plan)}{default}), expected speedup "
            f"{m.get('expected_speedup', 0):.2f}x, confirmed {(m.get('confirmed_speedup') or 0):.2f}x, "
            f"mean accepted {m.get('confirmed_mean_accepted', 0):.2f} tokens/round"
        )
    if manifest.default_plan is None:
        click.echo(
            f"{verb} {path}: no plan beat plain decoding, so the artifact decodes plainly by default "
            "(pass --plan NAME to try one anyway)"
        )


@main.command()
@click.argument("artifact", type=click.Path(path_type=Path))
@tuning_options("tune")
@friendly_errors
def tune(artifact, **values):
    """Retune an existing ARTIFACT's draft plans for another device or calibration set, without rebuilding.
    Plans of the same name are replaced; the manifest is rewritten atomically."""
    from speccompile.build import tune as run_tune

    options = from_cli("tune", values, artifact=artifact)
    report_plans(run_tune(options, log=lambda message: click.echo(message, err=True)), "tuned")


@main.command()
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--prompt", required=True, callback=utf8_text, help="Text to continue.")
@click.option("--max-new-tokens", type=click.IntRange(1), default=128, show_default=True)
@click.option("--temperature", type=FiniteFloat(0), default=0.0, show_default=True, help="0 = greedy.")
@click.option("--top-k", type=click.IntRange(0), default=0, show_default=True, help="0 = no top-k cut.")
@click.option("--top-p", type=FiniteFloat(0, 1, min_open=True), default=1.0, show_default=True)
@click.option("--seed", type=click.IntRange(0), default=None, help="Seed for sampling (a non-negative integer).")
@click.option("--no-speculate", is_flag=True, help="Plain decoding with the full model (the reference).")
@click.option("--plan", default=None, help="Draft plan to use (default: the manifest's default plan).")
@click.option("--backend", default=None, help="Backend to run (default: the artifact's first).")
@click.option("--device", type=DeviceType(), default="cpu", show_default=True, help="cpu, cuda or cuda:N.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object with text, token_ids and stats.")
@friendly_errors
def generate(
    artifact, prompt, max_new_tokens, temperature, top_k, top_p, seed, no_speculate, plan, backend, device, as_json
):
    """Continue PROMPT with the artifact, speculatively unless --no-speculate."""
    from speccompile.runtime import load

    model = load(artifact, backend=backend, device=device)
    kwargs = dict(
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        speculate=not no_speculate,
        plan=plan,
    )
    plain_note = model.plain_reason if not no_speculate and (plan is None or model.refused) else None
    if as_json:
        result = model.generate(prompt, **kwargs)
        click.echo(json.dumps({**result.as_dict(), "plain_reason": plain_note}))
        return
    stream = model.stream(prompt, **kwargs)
    for chunk in stream:
        click.echo(chunk.text, nl=False)
    click.echo()
    s = stream.result.stats
    accepted = f", mean accepted {s.mean_accepted:.2f} tokens/round" if s.mean_accepted is not None else ""
    if s.tree_rounds:
        accepted += f", {s.tree_rounds} token-tree rounds, {s.drafted_per_round:.1f} drafted tokens per round"
    if s.mean_accepted is not None and len(s.per_source) > 1:
        accepted += (
            " ("
            + ", ".join(f"{k}: {v['accepted']}/{v['drafted']} accepted" for k, v in s.source_report().items())
            + ")"
        )
    click.echo(f"[{s.new_tokens} tokens, {s.tokens_per_s:.1f} tokens/s{accepted}, stop: {s.stop_reason}]", err=True)
    if plain_note:
        click.echo(f"[plain decoding: {plain_note}]", err=True)


@main.command()
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option(
    "--prompts",
    type=click.Path(),
    default=None,
    help="Prompts (.jsonl with 'prompt' or 'text', or plain text split on blank lines). Default: the "
    "source model's prompts.jsonl if it has one, else a built-in set.",
)
@click.option("--max-new-tokens", type=click.IntRange(1), default=128, show_default=True)
@click.option("--plan", default=None, help="Draft plan to bench (default: the manifest's default plan).")
@click.option(
    "--backend",
    default=None,
    help="Runtime backend to bench (torch or onnx; default: the artifact's "
    "first). With onnx, optimum's ORTModelForCausalLM (exported by optimum from the same source model) is "
    "added as a baseline.",
)
@click.option("--no-transformers", is_flag=True, help="Skip the transformers (and optimum) baselines.")
@click.option("--json", "as_json", is_flag=True, help="Print the figures as one JSON object.")
@click.option("--quiet", is_flag=True, help="No progress bars.")
@friendly_errors
def bench(artifact, prompts, max_new_tokens, plan, backend, no_transformers, as_json, quiet):
    """Time plain vs speculative decoding of the same prompts (and transformers generate()), and check
    the outputs are identical."""
    from speccompile.bench import dumps, format_report, run_bench

    report = run_bench(
        str(artifact), prompts, max_new_tokens, plan, not no_transformers, progress=not quiet, backend=backend
    )
    click.echo(dumps(report) if as_json else format_report(report))


def echo_pass_table(tuning: dict) -> None:
    """The tuning passes: each one's bound against the incumbent when it started, its time, and what it added
    (with the best expected speedup it reached) or why it was skipped."""
    rows = tuning.get("passes") or []
    if not rows:
        return
    budget = tuning.get("budget")
    calibration = (tuning.get("calibration") or {}).get("seconds") or {}
    head = f"  tuning      {tuning.get('method', '?')}"
    if budget:
        head += (
            f", time budget {budget['seconds']:.0f}s ({'default' if budget['default'] else '--time-budget'}), "
            f"{budget['used']:.0f}s used before the write"
        )
    if calibration:
        head += f"; calibration {sum(calibration.values()):.1f}s"
    click.echo(head)
    click.echo(f"      {'pass':<20} {'bound':>7} {'incumbent':>9} {'seconds':>8}  result")
    for row in rows:
        bound = f"{row['bound']:.2f}x" if row.get("bound") is not None else "-"
        if row.get("skipped") and "modified" not in row:
            result = f"skipped: {row['skipped']}"
        else:
            result = ("added " + ", ".join(row["added"])) if row.get("added") else "no new plan"
            if row.get("reached") is not None:
                result += f" ({row['reached']:.2f}x)"
            if row.get("confirmation_stopped"):
                result = f"{row['confirmation_turns']} turns, stopped: {row['confirmation_stopped']}"
            if row.get("skipped"):
                result += f"; {row['skipped']}"
        click.echo(
            f"      {row['pass']:<20} {bound:>7} {row.get('incumbent', 0):>8.2f}x {row['seconds']:>8.1f}  {result}"
        )


def echo_verify_costs(tuning: dict) -> None:
    """The verify-cost curve the cost model priced every plan with: what a k-token forward costs against a
    one-token step on the backend the plans were tuned on (``benchmarks/verify_curve.py`` compares engines)."""
    costs = tuning.get("step_costs") or {}
    forward = costs.get("forward") or []
    if len(forward) < 2 or not forward[0]:
        return
    shown = [k for k in (2, 4, 8, 16) if k <= len(forward)]
    click.echo(
        f"  verify cost on {costs.get('backend', '?')}: 1 token {forward[0] * 1e3:.1f} ms; "
        + ", ".join(f"{k} tokens {forward[k - 1] / forward[0]:.2f}x" for k in shown)
    )


def echo_call_costs(tuning: dict) -> None:
    """The batched call costs the build timed for serve's load policy (``passes/call_costs.py``): a call of n
    one-token rows, and one row of w tokens, in ms, and the machine they describe."""
    stored = tuning.get("call_costs")
    if not stored:
        return
    from speccompile.runtime.decoding.load import CallCosts

    costs = CallCosts.from_dict(stored, "the manifest's tuning.call_costs")
    rows = ", ".join(f"{n} {seconds * 1e3:.1f}" for n, seconds in sorted(costs.batched.items()))
    widths = ", ".join(f"{w} {seconds * 1e3:.1f}" for w, seconds in sorted(costs.alone.items()) if w > 1)
    click.echo(f"  batched call costs (ms), one-token rows: {rows}; one row of w tokens: {widths}")
    if costs.draft:
        drafts = ", ".join(f"{n} {seconds * 1e3:.1f}" for n, seconds in sorted(costs.draft.items()))
        click.echo(f"    draft step ({costs.draft_segment}), one-token rows: {drafts}")
    click.echo(f"    timed on {costs.machine or 'an unnamed machine'}")


@main.command()
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the whole manifest.")
@friendly_errors
def inspect(artifact, as_json):
    """Summarise an artifact: source, geometry, draft plans and their measured figures."""
    from speccompile.runtime import read_artifact
    from speccompile.runtime.drafting import read_plans

    manifest = read_artifact(artifact)
    warn_unlisted_files(artifact, manifest)
    if as_json:
        click.echo(json.dumps(manifest.to_dict(), indent=2))
        return
    echo_artifact(artifact, manifest)
    echo_precision(manifest)
    echo_pass_table(manifest.tuning)
    echo_verify_costs(manifest.tuning)
    echo_call_costs(manifest.tuning)
    for name, plan in read_plans(manifest.plans, manifest.config.num_layers).items():
        echo_plan(name, plan, manifest)
    if manifest.default_plan is None:
        click.echo(
            f"  no default plan: none beat plain decoding (best confirmed "
            f"{manifest.tuning.get('best_confirmed_speedup', 0):.2f}x); generate decodes plainly unless --plan is given"
        )


def warn_unlisted_files(artifact: Path, manifest) -> None:
    """Files in the artifact that its manifest does not list: nothing checks or reads them, so say so, on
    stderr, so that ``--json`` output stays one JSON document."""
    from speccompile.runtime.artifact.manifest import unlisted_files

    unlisted = unlisted_files(artifact, manifest)
    if unlisted:
        shown = ", ".join(unlisted[:5]) + (f" and {len(unlisted) - 5} more" if len(unlisted) > 5 else "")
        click.echo(
            f"warning: {len(unlisted)} file(s) in the artifact are not in its manifest, so not verified and "
            f"never read by the runtime: {shown}",
            err=True,
        )


def echo_artifact(artifact: Path, manifest) -> None:
    """What the artifact is: its source model, geometry, decoder path, backends, files and the build's memory."""
    c = manifest.config
    src = manifest.source
    click.echo(f"artifact {artifact} (schema {manifest.schema_version}, speccompile {manifest.toolkit_version})")
    click.echo(f"  source      {src.get('model')} ({src.get('architecture')}) from {src.get('path')}")
    click.echo(
        f"  geometry    {c.num_layers} blocks, hidden {c.hidden_size}, {c.num_heads} heads "
        f"({c.num_kv_heads} kv, head_dim {c.head_dim}), vocab {c.vocab_size}, context "
        f"{c.max_position_embeddings}, {manifest.dtype}"
    )
    path = manifest.tuning.get("decoder_path") or {"path": c.decoder, "why": "built before decoder paths were recorded"}
    click.echo(f"  decoder     {path['path']}: {path['why']}")
    click.echo(
        f"  backends    {', '.join(manifest.backends)}; tuned on {manifest.tuning.get('device', '?')} "
        f"by {manifest.tuning.get('method', '?')}"
    )
    total = sum(f["bytes"] for f in manifest.files.values())
    click.echo(f"  files       {len(manifest.files)} ({total / 1e6:.1f} MB), sha256 verified")
    memory = manifest.tuning.get("memory") or {}
    if memory.get("peak_resident_bytes"):
        from speccompile.build_memory import describe_peak

        peak = describe_peak(memory["peak_resident_bytes"], memory.get("fp32_weights_bytes"))
        click.echo(f"  memory      the build's peak resident memory {peak}")


def echo_precision(manifest) -> None:
    """The precision self-drafts' weights: ONNX's stored quantized copy, or torch's int8 twin made at load and
    its SmoothQuant scales; and, from a GGUF source, why their acceptance is not a 16-bit model's."""
    extra = manifest.backends.get("onnx", {}).get("precision_draft_bytes")
    scales = manifest.backends.get("torch", {}).get("int8_scales_file")
    if extra:
        click.echo(
            f"  precision   {extra / 1e6:.1f} MB of weights.bin are the precision self-drafts' quantized weights"
        )
    if scales:
        size = manifest.files.get(scales, {}).get("bytes", 0)
        click.echo(
            f"  precision   torch's int8 twin is quantized at load (about a quarter of the fp32 weights' bytes in "
            f"memory); its SmoothQuant scales: {scales} ({size / 1e3:.0f} kB)"
        )
    if extra or scales:
        if str(manifest.source.get("path", "")).lower().endswith(".gguf"):
            click.echo(
                "              the source is a GGUF: its fp32 weights are de-quantized from its own block grid, so a "
                "precision draft's acceptance here is not a 16-bit-trained model's (benchmarks/quant_agreement.py)"
            )


def echo_plan(name: str, plan, manifest) -> None:
    """One draft plan: what it drafts with, then its measured figures, its draft sources' settings, and why it
    was chosen."""
    m = plan.measured
    default = " (default)" if name == manifest.default_plan else ""
    model, ngram = plan.model, plan.options("ngram")
    click.echo(
        f"  plan {name}{default}: {plan.describe()}; max draft {model.max_draft}, threshold "
        f"{model.threshold:.2f}{', adaptive' if model.adaptive else ''}"
    )
    if plan.skip_attn or plan.skip_mlp:
        click.echo(f"      skip attention {plan.skip_attn}, skip MLP {plan.skip_mlp}")
    echo_plan_figures(m)
    echo_plan_sources(plan, ngram, m)
    echo_plan_choice(name, m, manifest.tuning)


def echo_plan_figures(m: dict) -> None:
    """A plan's tuning figures: acceptance and speedup, expected and confirmed against plain decoding, and
    its adapter's training."""
    if m:
        click.echo(
            f"      acceptance {m.get('acceptance_rate', 0):.2f}, mean accepted "
            f"{m.get('mean_accepted', 0):.2f} (confirmed {m.get('confirmed_mean_accepted', 0):.2f}), "
            f"expected speedup {m.get('expected_speedup', 0):.2f}x (confirmed "
            f"{(m.get('confirmed_speedup') or 0):.2f}x, prediction error "
            f"{100 * m.get('prediction_error', 0):+.0f}%), tuned by {m.get('method', '?')} in "
            f"{m.get('tuning_seconds', 0):.0f}s" + (f" over {m['trials']} trials" if "trials" in m else "")
        )
    interval = m.get("confirmed_interval")
    if interval and None not in interval:
        click.echo(
            f"      confirmed in {m.get('confirmation_turns')} turns against plain decoding: 95% interval "
            f"{interval[0]:.2f}x..{interval[1]:.2f}x ({m.get('confirmation_stopped')})"
        )
    if m.get("adapter"):
        a = m["adapter"]
        click.echo(
            f"      adapter after block {a['exit_layer']}: {a['parameters']} parameters, trained on {a['tokens']} "
            f"tokens in {a['train_seconds']:.0f}s ({a['loss']} loss {a['first_loss']} -> {a['final_loss']}, "
            f"{a['stopped_by']}; exit agreement {a['exit_agreement_before']:.2f} -> "
            f"{a['exit_agreement_after']:.2f} on the calibration continuations"
            + (
                f", {a['held_out_agreement_before']:.2f} -> {a['held_out_agreement_after']:.2f} on "
                f"{a['held_out_tokens']} held-out tokens)"
                if a.get("held_out_tokens")
                else ")"
            )
        )


def echo_plan_sources(plan, ngram, m: dict) -> None:
    """How a plan's drafts are made beyond the model: a reduced draft vocabulary, lookahead's Jacobi window,
    token recycling, n-gram or datastore lookup."""
    if plan.draft_vocab is not None:
        ratio = (
            f", head {m['head_cost_ratio']:.1f}x cheaper (timed {m.get('head_cost_ratio_timed', 0):.1f}x)"
            if "head_cost_ratio" in m
            else ""
        )
        click.echo(f"      draft vocabulary: the {plan.draft_vocab} most frequent tokens{ratio}")
    if "lookahead" in plan.lookup:
        lookahead = plan.options("lookahead")
        click.echo(f"      lookahead: a window of {lookahead.window} Jacobi guesses, pooled {lookahead.ngram}-grams")
    if "recycling" in plan.lookup:
        click.echo(
            "      token recycling: each verify row's top tokens become the successors drafted after its input token"
        )
    if [source for source in plan.lookup if source not in ("lookahead", "recycling")]:
        datastore = plan.options("retrieval").datastore if "retrieval" in plan.lookup else None
        click.echo(
            f"      lookup {'+'.join(plan.lookup)}: n-gram sizes {ngram.max}..{ngram.min}, up to "
            f"{plan.lookup_max_draft} tokens"
            + (f" (1 after a match of <= {ngram.short})" if ngram.drafts_after_short_match else "")
            + (f", datastore {datastore}" if datastore else "")
        )


def echo_plan_choice(name: str, m: dict, tuning: dict) -> None:
    """What a plan was weighed on: token trees priced against chains, its rounds by draft source, the plans it
    beat, and whether it is the default only by its expected speedup."""
    if m.get("trees"):
        t = m["trees"]
        click.echo(
            "      token trees priced on this backend: "
            + "; ".join(
                f"best {kind} {t[kind]['mean_accepted']:.2f} tokens/round from {t[kind]['drafted_per_round']:.1f} drafted, "
                f"expected {t[kind]['expected_speedup']:.2f}x"
                for kind in ("chain", "tree")
            )
            + f" ({t['tree']['plan']})"
        )
    for key, what in (
        ("round_mix", "rounds by source (calibration)"),
        ("confirmed_round_mix", "rounds by source (confirmation)"),
    ):
        if m.get(key):
            click.echo(f"      {what}: " + ", ".join(f"{k} {100 * v:.0f}%" for k, v in m[key].items()))
    if m.get("chosen_over"):
        click.echo(
            "      chosen over: " + ", ".join(f"{k} {v:.2f}x" for k, v in m["chosen_over"].items() if v is not None)
        )
    by_estimate = tuning.get("default_by_estimate") or {}
    if by_estimate.get("chosen") == name:
        click.echo(f"      default by its expected speedup: timed runs could not tell it from {by_estimate['over']}")


@main.command()
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option(
    "--host", default=DEFAULT_HOST, show_default=True, help="Address to listen on (0.0.0.0: every interface)."
)
@click.option("--port", type=click.IntRange(0, 65535), default=DEFAULT_PORT, show_default=True)
@click.option("--backend", default=None, help="Backend to run (torch or onnx; default: the artifact's first).")
@click.option("--device", default="cpu", show_default=True)
@click.option(
    "--max-batch",
    type=click.IntRange(*MAX_BATCH_BOUNDS),
    default=DEFAULT_MAX_BATCH,
    show_default=True,
    help="Requests decoded together in one batch (continuous batching: each round reads the weights once for "
    "all of them, and speculation is sized to the load).",
)
@click.option(
    "--slots", type=click.IntRange(*MAX_BATCH_BOUNDS), default=None, hidden=True, help="Old name of --max-batch."
)
@click.option(
    "--max-queue",
    type=click.IntRange(0),
    default=DEFAULT_MAX_QUEUE,
    show_default=True,
    help="Requests that may wait for a place in the batch; beyond them the server answers 429 with Retry-After.",
)
@click.option(
    "--prefill-chunk",
    type=click.IntRange(1),
    default=DEFAULT_PREFILL_CHUNK,
    show_default=True,
    help="Prompt tokens read per round beside the running requests (smaller: steadier latency for them).",
)
@click.option(
    "--token-budget",
    type=click.IntRange(1),
    default=None,
    help="Tokens per round in all: the running requests' steps and verifies first, prompt chunks in what is "
    "left (default: no cap beyond --prefill-chunk).",
)
@click.option(
    "--kv-budget",
    type=FiniteFloat(min=1),
    default=None,
    metavar="MB",
    help="Admit fewer requests at once when their KV caches would exceed MB megabytes (default: no limit).",
)
@click.option(
    "--keep-prompts",
    type=click.IntRange(0),
    default=None,
    metavar="N",
    help="Prompts whose KV is kept for later prompts that begin alike (a system prompt, a conversation's earlier "
    "turns), one cache slot each (default: --max-batch; 0: none).",
)
@click.option("--plan", default=None, help="Draft plan to use (default: the manifest's default plan).")
@click.option(
    "--api-key",
    envvar="SPECCOMPILE_API_KEY",
    default=None,
    help="Require 'Authorization: Bearer KEY' on /v1/* (also read from SPECCOMPILE_API_KEY).",
)
@click.option(
    "--ray",
    "ray_address",
    is_flag=False,
    flag_value="local",
    default=None,
    metavar="[ADDRESS]",
    help="Serve on a Ray Serve cluster: the one at ADDRESS (its head's host:port), or a new local one when no "
    "address is given. Put it after ARTIFACT. See docs/ray.md.",
)
@click.option(
    "--replicas",
    type=click.IntRange(1),
    default=None,
    help="With --ray: replicas of the server, each with its own copy of the weights (default 1).",
)
@click.option(
    "--autoscale",
    default=None,
    metavar="MIN:MAX",
    help="With --ray: autoscale between MIN and MAX replicas on the requests in flight.",
)
@click.option(
    "--scale-down-after",
    type=FiniteFloat(min=0),
    default=DEFAULT_SCALE_DOWN_AFTER_S,
    show_default=True,
    help="With --autoscale: seconds of low load before a replica is removed.",
)
@click.option(
    "--replica-cpus",
    type=FiniteFloat(min=0),
    default=DEFAULT_REPLICA_CPUS,
    show_default=True,
    help="With --ray: CPUs Ray reserves for each replica (with 1 CPU per node: one replica per node).",
)
@friendly_errors
def serve(
    artifact,
    host,
    port,
    backend,
    device,
    max_batch,
    slots,
    max_queue,
    prefill_chunk,
    token_budget,
    kv_budget,
    keep_prompts,
    plan,
    api_key,
    ray_address,
    replicas,
    autoscale,
    scale_down_after,
    replica_cpus,
):
    """Serve ARTIFACT over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models,
    /health, /metrics) until interrupted; with --ray, as replicas on a Ray Serve cluster behind one endpoint."""
    if ray_address is None and (replicas is not None or autoscale is not None):
        raise click.UsageError("--replicas and --autoscale need --ray [ADDRESS]")
    if replicas is not None and autoscale is not None:
        raise click.UsageError("pass --replicas N or --autoscale MIN:MAX, not both")
    try:
        from speccompile.server import create_app, run_server
    except ImportError as exc:
        raise SpeccompileError(
            f"the server needs FastAPI, uvicorn and prometheus-client ({exc.name} is missing); "
            "install them with pip install 'speccompile[serve]'"
        ) from None
    max_batch = slots or max_batch
    if ray_address is not None:
        return _serve_on_ray(
            ray_address,
            host,
            port,
            artifact=str(artifact),
            max_batch=max_batch,
            max_queue=max_queue,
            prefill_chunk=prefill_chunk,
            token_budget=token_budget,
            kv_budget_bytes=None if kv_budget is None else int(kv_budget * 1e6),
            keep_prompts=keep_prompts,
            plan=plan,
            api_key=api_key,
            backend=backend,
            device=device,
            replicas=replicas,
            autoscale=autoscale,
            scale_down_after_s=scale_down_after,
            replica_cpus=replica_cpus,
        )
    app = create_app(
        artifact,
        max_batch=max_batch,
        max_queue=max_queue,
        prefill_chunk=prefill_chunk,
        token_budget=token_budget,
        kv_budget_bytes=None if kv_budget is None else int(kv_budget * 1e6),
        keep_prompts=keep_prompts,
        plan=plan,
        api_key=api_key,
        backend=backend,
        device=device,
    )
    costs = app.state.speccompile.scheduler.costs
    pricing = ""
    if costs is not None:
        pricing = "; drafts priced with call costs " + (
            "from the build (timed on this machine)" if costs.source == "manifest" else "timed at start"
        )
    run_server(
        app,
        host=host,
        port=port,
        announce=lambda url: click.echo(
            f"serving {artifact} on {url}/v1, up to {max_batch} requests in a batch, queue {max_queue}{pricing}",
            err=True,
        ),
    )


def _serve_on_ray(address, host, port, **options):
    """``serve --ray``: the options as the Ray application's arguments (a one-line error when Ray Serve is
    missing or one is bad), then serve on the cluster until interrupted."""
    try:
        from speccompile.server import ray_serve
    except ImportError as exc:
        raise SpeccompileError(
            f"serving on Ray needs Ray Serve ({exc.name} is missing); install it with pip install 'speccompile[ray]'"
        ) from None
    if options["autoscale"] is not None:
        try:
            ray_serve.parse_autoscale(options["autoscale"])
        except SpeccompileError as exc:
            raise click.BadParameter(str(exc), param_hint="'--autoscale'") from None
    args = ray_serve.ServeArgs.parse({key: value for key, value in options.items() if value is not None})
    try:
        ray_serve.serve_on_ray(
            args,
            address=None if address == "local" else address,
            host=host,
            port=port,
            announce=lambda line: click.echo(line, err=True),
        )
    except KeyboardInterrupt:  # serve_on_ray said in one line what it removed or stopped
        sys.exit(130)
    except Terminated:
        sys.exit(143)


if __name__ == "__main__":
    main()
