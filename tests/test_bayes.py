"""Bayesian search: resumable study, degenerate plans handled, chosen plan lossless, plot and errors."""

import json
import shutil

import optuna
import pytest
from click.testing import CliRunner
from lossless import assert_same_greedy, run

from speccompile.cli import main
from speccompile.passes.bayes_autotune import STUDY_NAME, BayesAutotune
from speccompile.passes.ir import DecoderIR
from speccompile.passes.tuning import TuningContext
from speccompile.runtime import load
from speccompile.runtime.artifact.manifest import DraftPlan

TUNE = ["--calibration-tokens", "16", "--max-draft", "4", "--quiet"]


@pytest.fixture
def artifact(tiny_artifact, tmp_path):
    target = tmp_path / "artifact"
    shutil.copytree(tiny_artifact, target)
    return target


def tune(*args):
    result = CliRunner().invoke(main, ["tune", *map(str, args), *TUNE])
    assert result.exit_code == 0, result.output
    return result


def study_trials(path):
    trials = optuna.load_study(study_name=STUDY_NAME, storage=f"sqlite:///{path}").trials
    return [t for t in trials if t.state == optuna.trial.TrialState.COMPLETE]


def test_bayes_tune_resumes_study_and_keeps_plan_lossless(artifact, tmp_path):
    study = tmp_path / "study.db"
    plot = tmp_path / "trace.png"
    tune(artifact, "--method", "bayes", "--trials", "6", "--study", study, "--plot", plot)
    first = [(t.number, t.params, t.value) for t in study_trials(study)]
    assert len(first) == 6 and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert any(t.user_attrs.get("seed", "").startswith("cosine-") for t in study_trials(study))

    tune(artifact, "--method", "bayes", "--trials", "10", "--study", study)
    resumed = study_trials(study)
    assert len(resumed) == 10, "the resumed study should run only the 4 missing trials"
    assert [(t.number, t.params, t.value) for t in resumed[:6]] == first

    manifest = json.loads((artifact / "manifest.json").read_text())
    bayes = manifest["plans"]["bayes"]
    for key in ("expected_speedup", "confirmed_speedup", "prediction_error", "trials"):
        assert key in bayes["measured"]
    assert bayes["kind"] == "layer_skip" and bayes["params"], "a plan that skips nothing is never chosen"
    cosine = manifest["plans"]["layer-skip"]["measured"]
    assert bayes["measured"]["confirmed_speedup"] >= cosine["confirmed_speedup"], "timed together, bayes >= cosine"
    best = max(bayes["measured"]["confirmed_speedup"], cosine["confirmed_speedup"])
    # the faster plan is the default, unless neither beat plain decoding in its confirmation
    assert manifest["default_plan"] in (("bayes", "layer-skip") if best > 1.0 else (None,))

    model = load(artifact)
    plan = model.plan("bayes")
    decoder = model.backend.decoder
    for prompt in ([5, 6, 7], [40, 41, 42, 43, 44, 45, 46, 47], list(range(100, 130))):
        plain, _ = run(model.backend, prompt, 40)
        spec, _ = run(model.backend, prompt, 40, plan)
        assert_same_greedy(decoder, prompt, plain, spec)


def test_degenerate_plans_are_handled(tiny_decoder):
    _, decoder = tiny_decoder("llama")
    L = decoder.config.num_layers
    ir = DecoderIR(decoder.config, {})
    ir._decoder = decoder
    context = TuningContext.prepare(ir, [[5, 6, 7, 8], [9, 10, 11]], 12, 3, show_progress=False)
    everything = context.score(DraftPlan.of(name="all", skip_attn=list(range(L)), skip_mlp=list(range(L))))
    assert 0.0 <= everything.acceptance_rate <= 1.0 and everything.expected_speedup > 0.0
    search = BayesAutotune(context, trials=2, show_progress=False)
    nothing = optuna.trial.FixedTrial({f"{k}_{i}": 0 for k in ("attn", "mlp") for i in range(L)})
    assert search.objective(nothing) == 0.0


def test_study_of_another_model_is_refused(artifact, tmp_path, tiny_model_dir):
    study = tmp_path / "study.db"
    tune(artifact, "--method", "bayes", "--trials", "2", "--study", study)
    other = tmp_path / "gpt2"
    build = CliRunner().invoke(
        main,
        [
            "build",
            str(tiny_model_dir("gpt2")),
            "-o",
            str(other),
            "--method",
            "bayes",
            "--trials",
            "2",
            "--study",
            str(study),
            *TUNE,
        ],
    )
    assert build.exit_code != 0 and "belongs to another model" in build.stderr
    assert not other.exists()


def test_plot_needs_bayes(artifact, tmp_path):
    result = CliRunner().invoke(main, ["tune", str(artifact), "--method", "cosine", "--plot", str(tmp_path / "x.png")])
    assert result.exit_code != 0 and result.stderr.startswith("error: --plot draws the Bayesian search")
