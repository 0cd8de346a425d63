"""Batched call costs timed by the build (``passes/call_costs.py``), stored in the manifest and reused by a server on
the same machine (``runtime/decoding/load.call_costs``); timed at start elsewhere; malformed ones refused."""

from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner

from speccompile.build import BuildOptions, build
from speccompile.cli import main
from speccompile.passes.call_costs import CALL_COST_ROWS, estimated_seconds
from speccompile.runtime import load
from speccompile.runtime.decoding.load import CallCosts, call_costs, longest_draft
from speccompile.runtime.errors import ArtifactError
from speccompile.runtime.machine import cpu_description, machine_key
from speccompile.server.scheduler import Scheduler


@pytest.fixture(scope="module", params=["torch", "onnx"])
def lookup_artifact(request, tiny_model_dir, tmp_path_factory):
    """A lookup-plan build of the tiny Llama (a default plan whatever the random weights: lookups cost nothing)."""
    out = tmp_path_factory.mktemp("call-costs") / request.param
    options = BuildOptions(
        model=str(tiny_model_dir("llama")),
        out=out,
        method="lookup",
        backends=(request.param,),
        max_draft=4,
        calibration_tokens=16,
        confirm_prompts=2,
        confirm_tokens=16,
        show_progress=False,
    )
    lines: list[str] = []
    return build(options, log=lines.append), lines


def test_build_times_call_costs_and_a_server_here_reuses_them(lookup_artifact):
    root, lines = lookup_artifact
    manifest = json.loads((root / "manifest.json").read_text())
    if manifest["default_plan"] is None:
        assert "call_costs" not in manifest["tuning"]
        pytest.skip("no plan beat plain decoding on this machine: nothing to price")
    stored = manifest["tuning"]["call_costs"]
    costs = CallCosts.from_dict(stored)
    assert sorted(costs.batched) == [1, 2, 4, 8, CALL_COST_ROWS]
    assert any(line.startswith("batched call costs:") for line in lines)
    model = load(root)
    assert stored["machine"] == machine_key(model.backend)
    scheduler = Scheduler(model, max_batch=8, max_queue=0)
    try:
        assert scheduler.costs.source == "manifest"
        assert scheduler.costs.batched == costs.batched
    finally:
        scheduler.close()
    # more rows than the build timed: timed now, on this backend
    width = longest_draft(model.draft_plan()) + 1
    wider = call_costs(model.backend, stored, max_rows=CALL_COST_ROWS + 1, max_width=width)
    assert wider.source == "timed" and max(wider.batched) == CALL_COST_ROWS + 1
    result = CliRunner().invoke(main, ["inspect", str(root)])
    assert result.exit_code == 0, result.output
    assert "batched call costs (ms), one-token rows: 1 " in result.output
    assert cpu_description() in result.output


def test_costs_of_another_machine_are_timed_again(lookup_artifact):
    root, _ = lookup_artifact
    model = load(root)
    stored = dict(CallCosts({1: 1.0, 16: 2.0}, {1: 1.0, 8: 1.5}, machine="onnx on cpu: another CPU").as_dict())
    costs = call_costs(model.backend, stored, max_rows=2, max_width=2)
    assert costs.source == "timed" and costs.machine == machine_key(model.backend)
    assert costs.batched[1] != 1.0  # this machine's own timing of a one-row call, not the other machine's


@pytest.mark.parametrize(
    "damage, message",
    [
        ([0.1, 0.2], "malformed"),
        ({"batched": [1, 2], "alone": {"1": 0.1}}, "malformed"),
        ({"batched": {"1": 0.1}}, "alone is missing"),
        ({"batched": {"one": 0.1}, "alone": {"1": 0.1}}, "malformed"),
        ({"batched": {"1": -0.1}, "alone": {"1": 0.1}}, "positive times"),
        ({"batched": {"0": 0.1}, "alone": {"1": 0.1}}, "positive times"),
        ({"batched": {"1": "nan"}, "alone": {"1": 0.1}}, "positive times"),
    ],
)
def test_damaged_call_costs_are_one_line_errors(lookup_artifact, tmp_path, damage, message):
    root, _ = lookup_artifact
    with pytest.raises(ArtifactError, match=message):
        CallCosts.from_dict(damage, "the manifest's tuning.call_costs")
    copy = tmp_path / "damaged"
    shutil.copytree(root, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["tuning"]["call_costs"] = damage
    (copy / "manifest.json").write_text(json.dumps(manifest))
    result = CliRunner().invoke(main, ["inspect", str(copy)])
    assert result.exit_code != 0
    assert "tuning.call_costs" in result.output and message in result.output
    assert len(result.output.strip().splitlines()) == 1
    with pytest.raises(ArtifactError, match="tuning.call_costs"):
        load(copy)  # loading refuses what inspect refuses


def test_estimate_grows_with_rows_and_width():
    assert estimated_seconds(0.01, 16, 5) > estimated_seconds(0.01, 4, 5) > estimated_seconds(0.01, 4, 2) > 0


def test_the_build_stores_the_default_plans_draft_step_curve(tiny_decoder, capsys):
    """Beside the verifier's calls, the build times the default plan's draft step at the same row counts when its
    backend has that plan's draft graphs, and a server on this machine reuses it without timing it again;
    ``inspect`` shows it. A lookup-only plan has no draft step to time."""
    from types import SimpleNamespace

    from speccompile.passes.call_costs import time_call_costs
    from speccompile.runtime.artifact.manifest import DraftPlan
    from speccompile.runtime.backends.torch.backend import TorchBackend
    from speccompile.runtime.decoding.load import draft_step_segment
    from speccompile.runtime.drafting.plan import read_plan

    _, decoder = tiny_decoder("llama")
    skip = DraftPlan.of("skip", skip_attn=[1], sources={"model": {"max_draft": 3}})
    backend = TorchBackend(decoder)
    runner = SimpleNamespace(plain_backend=lambda: backend)
    ir = SimpleNamespace(plans={"skip": skip}, default_plan="skip", tuning={}, config=decoder.config)
    lines: list[str] = []
    time_call_costs(runner, ir, None, 0.001, lines.append)
    stored = ir.tuning["call_costs"]
    segment = draft_step_segment(read_plan(skip, decoder.config.num_layers))
    assert stored["draft"]["segment"] == segment.describe()
    assert sorted(int(n) for n in stored["draft"]["batched"]) == CallCosts.row_counts(CALL_COST_ROWS)
    assert "a draft step of 1 / 16 rows" in lines[-1]
    reused = call_costs(backend, stored, max_rows=8, max_width=4, draft=segment)
    assert reused.source == "manifest" and reused.draft == CallCosts.from_dict(stored).draft
    from speccompile.cli import echo_call_costs

    echo_call_costs({"call_costs": stored})
    assert f"draft step ({segment.describe()}), one-token rows: 1 " in capsys.readouterr().out
    lookup = DraftPlan.of("lookup", lookup=["ngram"])
    ir = SimpleNamespace(plans={"lookup": lookup}, default_plan="lookup", tuning={}, config=decoder.config)
    time_call_costs(runner, ir, None, 0.001, lines.append)
    assert "draft" not in ir.tuning["call_costs"]
