"""The auto build's time budget: bounds skip passes that cannot beat the incumbent, confirmation stops when sure,
and passes and options are data (one method table, one options class for build and tune).

Decision rules are tested where they are decided, with injected clocks and bounds (PassManager, Confirmer.race);
the real passes and the real CLI run on tiny random-weight models."""

import json

import click
import pytest
from click.testing import CliRunner

from speccompile.cli import main
from speccompile.passes.budget import Budget, geometric_bound
from speccompile.passes.confirm import Confirmer
from speccompile.passes.ir import DecoderIR
from speccompile.passes.pass_manager import BOUND_MARGIN, Pass, PassManager, PassResult
from speccompile.passes.pipeline import METHODS, BuildOptions, cli_fields
from speccompile.runtime.artifact.manifest import DraftPlan
from speccompile.runtime.decoding.speculative import Stats


class Clock:
    """A clock the test moves by hand."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


class AddPlan(Pass):
    """A tuning pass with a given bound that adds a plan of a given expected speedup, taking ``seconds``."""

    def __init__(self, name, bound, speedup, clock, seconds=1.0, least=0.0):
        self.name, self._bound, self.speedup, self.clock, self.seconds, self.least = (
            name,
            bound,
            speedup,
            clock,
            seconds,
            least,
        )
        self.adds = (name,)
        self.ran = False

    def bound(self, ir):
        return self._bound

    def least_seconds(self):
        return self.least

    def call(self, ir):
        self.ran = True
        self.clock.now += self.seconds
        before = dict(ir.plans)
        ir.add_plan(DraftPlan.of(name=self.name, lookup=["ngram"], measured={"expected_speedup": self.speedup}))
        return PassResult.after(ir, before)


@pytest.fixture
def ir(tiny_decoder):
    _, decoder = tiny_decoder("llama")
    return DecoderIR(decoder.config, {})


def test_pass_below_the_incumbent_is_skipped_and_recorded(ir):
    clock = Clock()
    budget = Budget(60.0, clock=clock)
    lookup = AddPlan("lookup", None, 1.29, clock)
    weak = AddPlan("weak", 1.08, 1.05, clock)  # its bound cannot beat lookup's 1.29x
    strong = AddPlan("strong", 1.6, 1.4, clock)
    slow = AddPlan("slow", 3.0, 2.0, clock, least=100.0)  # would beat it, but needs more time than is left
    ir = PassManager([lookup, weak, strong, slow], budget=budget)(ir)
    assert lookup.ran and strong.ran and not weak.ran and not slow.ran
    assert set(ir.plans) == {"lookup", "strong"}
    table = {row["pass"]: row for row in ir.tuning["passes"]}
    assert table["weak"]["skipped"] == "bound 1.08x < incumbent 1.29x"
    assert (
        table["strong"]["bound"] == 1.6 and table["strong"]["incumbent"] == 1.29 and table["strong"]["reached"] == 1.4
    )
    assert table["slow"]["skipped"].startswith("needs 100s, 58s left")
    # a bound within BOUND_MARGIN of the incumbent cannot win a confirmation: skipped too, and said so
    close = AddPlan("close", 1.3, 1.3, Clock())
    ir_close = PassManager([AddPlan("lookup", None, 1.29, Clock()), close], budget=Budget(60.0, clock=Clock()))(
        DecoderIR(ir.config, {})
    )
    assert not close.ran and ir_close.tuning["passes"][1]["skipped"] == "bound 1.30x < incumbent 1.29x + 5%"
    # without a budget (--method NAME), every pass runs in full
    clock2 = Clock()
    passes = [AddPlan("lookup", None, 1.29, clock2), AddPlan("weak", 1.08, 1.05, clock2)]
    PassManager(passes)(DecoderIR(ir.config, {}))
    assert all(p.ran for p in passes)


def test_plain_decoding_is_the_first_incumbent(ir):
    clock = Clock()
    useless = AddPlan("useless", 0.9, 0.8, clock)
    ir = PassManager([useless], budget=Budget(30.0, clock=clock))(ir)
    assert not useless.ran and ir.tuning["passes"][0]["skipped"] == "bound 0.90x < incumbent 1.00x"


def test_geometric_bound():
    flat = lambda t: 1.0  # noqa: E731 (a verify that costs one step whatever its length)
    assert geometric_bound(0.0, 0.1, flat, 8)[0] == pytest.approx(1 / 1.1)  # nothing accepted: draft cost is lost
    assert geometric_bound(1.0, 0.0, flat, 8) == (9.0, 8)  # free perfect drafts: k + 1 tokens per step
    steep = lambda t: 1.0 + 0.5 * (t - 1)  # noqa: E731
    assert geometric_bound(0.5, 0.2, steep, 8)[0] < geometric_bound(0.5, 0.2, flat, 8)[0]


def fake_decode(plain_seconds, plan_seconds, noise):
    """A decode whose duration the test sets: plain runs take ``plain_seconds``, a plan's ``plan_seconds[name]``,
    each times a factor from ``noise`` (cycled), with the same output (lossless)."""
    factors = iter(noise * 1000)

    def decode(prompt, new_tokens, plan):
        seconds = (plain_seconds if plan is None else plan_seconds[plan.name]) * next(factors)
        return list(range(new_tokens)), Stats(
            new_tokens=new_tokens, rounds=new_tokens // 2, accepted=new_tokens // 2, seconds=seconds
        )

    return decode


NOISE = [1.0, 1.06, 0.97, 1.03, 0.95, 1.01, 1.04]


def race(plan_seconds, max_turns=16, deadline=None, clock=None):
    plans = [DraftPlan.of(name=name, lookup=["ngram"]) for name in plan_seconds]
    confirmer = Confirmer(None, [[1, 2, 3], [4, 5, 6]], 8, decode=fake_decode(1.0, plan_seconds, NOISE))
    kwargs = {"clock": clock} if clock else {}
    return confirmer.race(plans, min_turns=3, max_turns=max_turns, deadline=deadline, **kwargs)


def test_confirmation_stops_early_on_a_clearly_faster_plan():
    figures, notes = race({"fast": 1 / 1.5})
    assert notes["confirmation_stopped"] == "sure" and notes["confirmation_turns"] <= 4
    lo, hi = figures["fast"]["confirmed_interval"]
    assert 1.0 < lo < 1.5 < hi and figures["fast"]["confirmed_speedup"] == pytest.approx(1.5, rel=0.1)


def test_confirmation_continues_on_a_near_tie():
    figures, notes = race({"tie": 1 / 1.01})
    assert notes["confirmation_stopped"] == "max turns" and notes["confirmation_turns"] == 16
    lo, hi = figures["tie"]["confirmed_interval"]
    assert lo < 1.0 < hi


def test_confirmation_drops_the_slower_plan_and_stops_at_the_deadline():
    figures, notes = race({"fast": 1 / 1.5, "slower": 1 / 1.2})
    assert figures["slower"]["confirmation_stopped"] == "slower than fast" and notes["confirmation_stopped"] == "sure"
    clock = Clock()
    figures, notes = race({"tie": 1 / 1.01}, deadline=0.0, clock=clock)  # the budget is spent: one turn, then stop
    assert notes == {"confirmation_turns": 1, "confirmation_stopped": "budget"}
    assert figures["tie"]["confirmation_turns"] == 1


def test_the_race_records_each_plan_against_the_fastest():
    """Every plan but the fastest carries its paired interval against the fastest: surely slower here."""
    figures, _ = race({"fast": 1 / 1.5, "slower": 1 / 1.2})
    versus = figures["slower"]["confirmed_vs_best"]
    assert versus["plan"] == "fast" and versus["interval"][1] < 1.0
    assert "confirmed_vs_best" not in figures["fast"]


def test_an_undecided_race_is_settled_by_the_estimate(ir):
    """When timed runs cannot tell the fastest plan from another priced by the same estimator, the higher expected
    speedup wins; a plan surely slower in the race, not faster than plain decoding, or priced by another
    estimator (whose bias would not cancel) never does."""
    from speccompile.passes.confirm import ChooseDefaultPlan

    def plans(interval, other_confirmed=1.62, other_method="precision"):
        return {
            "alone": DraftPlan.of(
                name="alone", measured={"method": "precision", "expected_speedup": 1.71, "confirmed_speedup": 1.63}
            ),
            "behind": DraftPlan.of(
                name="behind",
                measured={
                    "method": other_method,
                    "expected_speedup": 1.87,
                    "confirmed_speedup": other_confirmed,
                    "confirmed_vs_best": {"plan": "alone", "interval": interval},
                },
            ),
        }

    ir.plans = plans([0.93, 1.06])
    ir = ChooseDefaultPlan().run(ir)
    assert ir.default_plan == "behind" and ir.tuning["default_by_estimate"]["over"] == "alone"
    ir.plans, ir.tuning = plans([0.93, 0.99]), {}
    assert ChooseDefaultPlan().run(ir).default_plan == "alone"
    ir.plans, ir.tuning = plans([0.5, 1.2], other_confirmed=0.99), {}
    assert ChooseDefaultPlan().run(ir).default_plan == "alone"
    ir.plans, ir.tuning = plans([0.93, 1.06], other_method="lookahead"), {}  # priced by another estimator
    assert ChooseDefaultPlan().run(ir).default_plan == "alone"


def build_tiny(model_dir, out, *args) -> dict:
    """Build the tiny model with a small calibration; its manifest."""
    result = CliRunner().invoke(
        main,
        ["build", str(model_dir), "-o", str(out), "--max-draft", "3", "--calibration-tokens", "12", "--quiet", *args],
    )
    assert result.exit_code == 0, result.output
    return json.loads((out / "manifest.json").read_text())


def test_auto_build_records_its_budget_and_pass_table(tiny_model_dir, tmp_path):
    """A real auto build on a tiny model: every pass has a row (ran with its bound, or skipped with why), the plan
    kept was confirmed in turns, and inspect prints the table."""
    out = tmp_path / "auto"
    manifest = build_tiny(tiny_model_dir("llama"), out, "--time-budget", "40")
    rows = manifest["tuning"]["passes"]
    assert [r["pass"] for r in rows][:3] == ["lookup_autotune", "precision_tune", "exit_autotune"]
    assert [r["pass"] for r in rows][-3:] == ["lookahead_tune", "confirm_plans", "choose_default_plan"]
    assert {r["pass"] for r in rows} >= {"cosine_autotune", "adapter_autotune", "hybrid_autotune", "confirm_plans"}
    for row in rows:
        if "skipped" in row:
            assert row["skipped"].startswith(("bound", "needs")) and "modified" not in row
            if row["skipped"].startswith("bound"):
                assert row["bound"] < row["incumbent"] * (1 + BOUND_MARGIN)
        elif "bound" in row:
            assert row["bound"] >= row["incumbent"] * (1 + BOUND_MARGIN)
    precision = next(r for r in rows if r["pass"] == "precision_tune")
    if "skipped" not in precision:  # its phases, what its time estimate (least_seconds) is read against
        assert set(precision["phases"]) >= {"bound", "backend", "draft_rounds", "candidates"}
        assert sum(precision["phases"].values()) <= precision["seconds"] + 0.05
    budget = manifest["tuning"]["budget"]
    assert budget["seconds"] == 40 and not budget["default"] and budget["used"] < 40
    (plan,) = manifest["plans"].values()
    assert plan["measured"]["confirmation_turns"] >= 1 and len(plan["measured"]["confirmed_interval"]) == 2
    shown = CliRunner().invoke(main, ["inspect", str(out)]).output
    assert "time budget 40s" in shown
    forward = manifest["tuning"]["step_costs"]["forward"]  # the verify-cost curve the plans were priced with
    assert f"1 token {forward[0] * 1e3:.1f} ms; 2 tokens {forward[1] / forward[0]:.2f}x" in shown
    for row in rows:
        assert row["pass"] in shown
        if "skipped" in row:
            assert f"skipped: {row['skipped']}" in shown


def test_method_runs_its_pass_in_full(tiny_model_dir, tmp_path):
    manifest = build_tiny(tiny_model_dir("llama"), tmp_path / "exit", "--method", "early-exit")
    L = manifest["config"]["num_layers"]
    assert len(manifest["plans"]["early-exit"]["measured"]["per_exit_layer"]) == L - 1  # every exit scored
    assert "budget" not in manifest["tuning"] and "skipped" not in json.dumps(manifest["tuning"]["passes"])


@pytest.mark.parametrize("command", ["build", "tune"])
def test_options_are_written_once(command):
    """--method's choices are the method table; every options field marked for a command is one of its options, and
    the command's parameters are exactly those (plus its argument and --debug)."""
    cmd = main.commands[command]
    params = {p.name: p for p in cmd.params}
    assert list(params["method"].type.choices) == list(METHODS)
    assert params["method"].default == ("auto" if command == "build" else "bayes")
    fields = {f.name for f in cli_fields(command)}
    assert set(params) == fields | {"debug", "model" if command == "build" else "artifact"}
    assert isinstance(params["max_draft"].type, click.IntRange) and params["max_draft"].default == 8
    assert (
        BuildOptions().max_draft == 8 and BuildOptions().show_progress and params["show_progress"].opts == ["--quiet"]
    )


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_bounds_hold_on_real_tiny_models(family, tiny_decoder):
    """The bounds a skip decision rests on are not below what the passes then reach: each exit's bound against its
    scored estimate, and the layer-skip bound against the cosine pass's best plan."""
    import numpy as np

    from speccompile.passes.autotune import CosineAutotune, ExitLayerAutotune
    from speccompile.passes.tuning import TuningContext

    _, decoder = tiny_decoder(family)
    ir = DecoderIR(decoder.config, {})
    ir.attach_decoder(decoder)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, decoder.config.vocab_size, 8).tolist() for _ in range(6)]
    context = TuningContext.prepare(ir, prompts, 16, 4, show_progress=False)
    bounds = ExitLayerAutotune(context, show_progress=False).exit_bounds()
    for exit_layer, bound in bounds.items():
        assert bound >= context.score(DraftPlan.of(name="e", exit_layer=exit_layer)).expected_speedup
    cosine = CosineAutotune(context, show_progress=False)
    bound = cosine.bound(ir)
    assert bound >= cosine.run(ir).plans["layer-skip"].measured["expected_speedup"]


def test_confirmation_races_only_plans_close_to_the_best():
    """A budgeted build times only the plans that could win: predicted faster than plain decoding and within
    10% of the best prediction (each plan in the race adds a decode to every turn)."""
    from speccompile.passes.confirm import race_candidates

    ranked = [
        DraftPlan.of(name=n, measured={"expected_speedup": e})
        for n, e in (("best", 1.30), ("close", 1.18), ("far", 1.10), ("slower", 0.95))
    ]
    assert [p.name for p in race_candidates(ranked, 3, 0.9)] == ["best", "close"]
    assert [p.name for p in race_candidates(ranked, 3, None)] == ["best", "close", "far"]
    slow = [
        DraftPlan.of(name="a", measured={"expected_speedup": 0.97}),
        DraftPlan.of(name="b", measured={"expected_speedup": 0.9}),
    ]
    assert [p.name for p in race_candidates(slow, 3, 0.9)] == ["a"]  # the best is always timed: it may still pay


def test_the_first_plan_is_made_when_calibration_used_up_the_budget(ir):
    """A slow calibration (a loaded machine) can leave no tuning time at all: the first pass still makes its
    plan (refcoder once shipped without one, every pass 'skipped: needs 0s, 0s left'); later ones are
    skipped for time before their bound is computed."""
    clock = Clock()
    budget = Budget(15.0, clock=clock)
    clock.now = 20.0  # calibration took longer than the whole budget
    first, second = AddPlan("lookup", None, 1.7, clock), AddPlan("exit", 2.0, 1.9, clock)
    ir = PassManager([first, second], budget=budget)(ir)
    assert first.ran and not second.ran and set(ir.plans) == {"lookup"}
    row = ir.tuning["passes"][1]
    assert row["skipped"] == "needs 0s, 0s left" and "bound" not in row


def test_the_precision_pass_is_priced_from_what_calibration_timed(tiny_decoder):
    """The precision pass's time estimate grows with the reference pass (its scoring repeats it) and, on an
    exporting backend, with the first export (its quantized graphs), not only with the plain step: a
    Llama-3.2-1B-shaped build was told 29 s by the plain-step rule and spent 169 s, past its budget."""

    from speccompile.passes.precision_tune import EXPORT_FACTOR, PROFILE_PASSES, PrecisionTune

    context = tiny_context(tiny_decoder)
    quick = PrecisionTune(context, show_progress=False, quick=True)
    context.timings.update(reference_pass=10.0, runner_backend=20.0)
    base = quick.least_seconds()
    assert base >= PROFILE_PASSES * 10.0  # torch: no export to repeat
    context.timings["reference_pass"] = 30.0
    assert quick.least_seconds() == pytest.approx(base + PROFILE_PASSES * 20.0)

    class Exporting:  # the runner's name is what the estimate reads: ONNX Runtime exports its quantized graphs
        name = "onnx"

    context.runner = Exporting()
    assert quick.least_seconds() == pytest.approx(base + PROFILE_PASSES * 20.0 + EXPORT_FACTOR * 20.0)


def test_the_exit_agreements_are_priced_until_they_are_known(tiny_decoder):
    """The early-exit and adapter passes' time estimates include the shared-head agreements their bounds read
    (one head product per scored position and exit, priced per position by one timed product), until a bound
    has read them: a Llama-3.2-1B-shaped
    build's early-exit bound spent 51 s of the 32 it had left."""

    from speccompile.passes.autotune import ExitLayerAutotune
    from speccompile.passes.budget import agreement_seconds, exit_agreements

    context = tiny_context(tiny_decoder)
    exits = ExitLayerAutotune(context, show_progress=False, full=False)
    scoring = 0.5 * context.timings["reference_pass"]  # one exit scored, after the bound
    before = agreement_seconds(context)
    assert before > 0 and exits.least_seconds() > scoring
    assert context.signals["head_seconds_per_position"] > 0  # timed once, on a head product of the calibration
    context.signals["head_seconds_per_position"] *= 10  # a head ten times dearer: ten times the estimate
    assert agreement_seconds(context) == pytest.approx(10 * before)
    exit_agreements(context)
    assert agreement_seconds(context) == 0.0 and exits.least_seconds() == pytest.approx(scoring)


def test_the_layer_skip_bound_is_priced_from_the_reference_pass(tiny_decoder):
    """The layer-skip bound profiles its probes (a quarter of the sequences each) before the pass may be skipped:
    its time estimate counts them, so it grows with the reference pass."""

    from speccompile.passes.autotune import CosineAutotune

    context = tiny_context(tiny_decoder)
    cosine = CosineAutotune(context, show_progress=False, full=False)
    context.timings["reference_pass"] = 4.0
    needs = cosine.least_seconds()
    assert needs > 0 and needs % 1.0 == 0  # whole probes of a quarter pass each
    context.timings["reference_pass"] = 8.0
    assert cosine.least_seconds() == pytest.approx(2 * needs)


def test_scoring_on_torch_releases_the_onnx_sessions(tiny_decoder, tmp_path):
    """A draft scored on the torch decoder reads its weights again: ONNX Runtime's sessions (their packed copy
    of the same weights) are released first, and the next backend opens them again from the same export."""

    context = tiny_context(tiny_decoder, onnx_in=tmp_path)
    runner, decoder = context.runner, context.ir.decoder()
    opened = runner.backend({})
    assert runner._backend is opened
    context.profile(DraftPlan.of(name="e", exit_layer=1))
    assert runner._backend is None
    again = runner.plain_backend()
    again.reserve(8)
    assert again is not opened and again.forward([1, 2, 3], 0).shape[-1] == decoder.config.vocab_size


def tiny_context(tiny_decoder, onnx_in=None):
    """A tuning context of the tiny llama on three random prompts (8 tokens each, 8 more decoded): on the torch
    runner, or with ``onnx_in`` (a folder) on ONNX Runtime's."""
    import numpy as np

    from speccompile.convert import arch_config, canonical_weights
    from speccompile.passes.tuning import TuningContext
    from speccompile.runners import make_runner

    hf, _ = tiny_decoder("llama")
    config = arch_config(hf)
    ir = DecoderIR(config, canonical_weights(hf, config))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, config.vocab_size, 8).tolist() for _ in range(3)]
    runner = make_runner("onnx", ir, onnx_in) if onnx_in is not None else None
    return TuningContext.prepare(ir, prompts, 8, 4, show_progress=False, runner=runner, workdir=onnx_in)


def test_the_measurements_after_confirmation_take_their_time_from_it_not_from_the_passes():
    """The prompt-chunk and call-cost timings after confirmation get a share of the budget (without it default
    builds stored neither), taken from confirmation's deadline: a tuning pass skipped for want of time can lose the
    best plan (a packed SmolLM2 build lost its precision plan that way)."""
    from types import SimpleNamespace

    from speccompile.build import TURN_STEPS, plan_budget
    from speccompile.passes.confirm import MIN_TURNS

    step = SimpleNamespace(plain_step=lambda: 0.02)
    config = SimpleNamespace(max_position_embeddings=8192)
    context = SimpleNamespace(
        cost=step, costs=step, confirm_tokens=48, timings={}, max_draft=8, ir=SimpleNamespace(config=config)
    )
    budget = Budget(total=80.0, clock=Clock())
    plan_budget(budget, context, ["onnx"], 135_000_000)
    assert budget.measure_reserve > 1.0  # SmolLM2-sized: a few seconds of timings
    turns = MIN_TURNS * TURN_STEPS * context.confirm_tokens * 0.02
    assert budget.reserve == pytest.approx(turns + budget.write_reserve)  # the passes' time is untouched
    measure, with_measurements = budget.measure_reserve, budget.final_deadline()
    budget.measure_reserve = 0.0
    assert budget.final_deadline() - with_measurements == pytest.approx(measure, abs=0.01)  # confirmation's share
