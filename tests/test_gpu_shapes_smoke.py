"""The GPU check's scripts on the CPU: ``benchmarks/gpu_shapes.py --smoke`` and ``benchmarks/gpu_check.sh``'s gate.

Why: the GPU machine this project borrows gives one short run; a script that breaks there (a wrong argument, a
row never written, a path that only runs at batch 16) costs the lease. ``--smoke`` runs every code path of the
GPU run (the random-weight model built by the runtime's decoder, costs in turns at batch 1 and 16, the oracle
drafter's rounds through the device round and the batch round, the acceptance measurement of the real plans and
the expected speedups priced from it) on a tiny model, with CUDA graphs' static steps through
``graphs.eager_capture``. The oracle rows are a real lossless check: at every acceptance, a = 0 (every proposal
wrong) to a = 0.95, the output must be plain decoding's, token for token. Nothing here is timed; the figures
smoke prints mean nothing.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_shapes.py"
ITEMS = {"step", "verify-2", "verify-4", "verify-8", "verify-16", "exit-1", "exit-2", "precision-int8"}
ACCEPTANCES = {0.0, 0.5, 0.8, 0.95}
PLANS = {"lookup", "exit-1/4", "exit-1/2", "precision", "precision+lookup"}


def shapes(*args: str) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", *args], capture_output=True, text=True, timeout=240, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """(acceptance JSON, rows, stdout) of a smoke run priced with a smoke acceptance measurement."""
    folder = tmp_path_factory.mktemp("gpu_shapes")
    shapes("--measure-acceptance", "--json", str(folder / "acceptance.json"))
    done = shapes("--acceptance", str(folder / "acceptance.json"), "--json", str(folder / "rows.json"))
    acceptance = json.loads((folder / "acceptance.json").read_text())
    return acceptance, json.loads((folder / "rows.json").read_text())["rows"], done.stdout


def test_every_cost_item_at_both_batch_sizes(smoke):
    """A plain step, the four verifies, both early exits and the precision draft at batch 1 and 16: timed, or (a
    draft the backend refuses) with the backend's reason in the row; no phase failed or was skipped."""
    _, rows, _ = smoke
    assert not [r for r in rows if r["kind"] in ("error", "skipped")]
    assert [r["kind"] for r in rows].count("shape") == 1
    costs = [r for r in rows if r["kind"] == "cost"]
    for batch in (1, 16):
        found = {r["item"]: r for r in costs if r["batch"] == batch}
        assert set(found) == ITEMS, f"batch {batch}: {sorted(found)}"
        for name, row in found.items():
            assert (row["ms"] is not None and row["ms"] > 0) or row.get("unsupported"), row
        assert found["step"]["vs_step"] == 1.0
        assert found["verify-16"]["tokens"] == 17 and found["exit-1"]["exit_layer"] == 1


def test_oracle_rounds_decode_exactly_plain(smoke):
    """Plain decoding and the oracle at every acceptance, at batch 1 (the device round) and 16 (the batch round):
    the output equals plain's everywhere; a = 0 accepts nothing (every proposal is wrong, one token a round) and
    a = 0.95 accepts most (several tokens a round), so the oracle drafts what it is asked to."""
    _, rows, _ = smoke
    rounds = [r for r in rows if r["kind"] == "round"]
    for batch in (1, 16):
        mine = [r for r in rounds if r["batch"] == batch]
        assert [r["engine"] for r in mine].count("plain") == 1
        oracle = {r["acceptance"]: r for r in mine if r["engine"] == "oracle"}
        assert set(oracle) == ACCEPTANCES
        for a, row in oracle.items():
            assert row["equal_to_plain"] is True, row
            assert row["tokens_per_s"] > 0 and row["host_ms_per_round"] is not None
        assert oracle[0.0]["mean_accepted"] == 1.0
        assert oracle[0.95]["mean_accepted"] > 3.0
        assert oracle[0.5]["mean_accepted"] < oracle[0.95]["mean_accepted"]
    assert next(r for r in rounds if r["batch"] == 1 and r["acceptance"] == 0.8)["path"] == "device round"


def test_expected_speedups_from_measured_acceptance(smoke):
    """Each real plan's acceptance, measured by ``--measure-acceptance``, priced at both batch sizes, labelled as
    costs measured on the GPU with acceptance from a real model."""
    acceptance, rows, stdout = smoke
    assert set(acceptance["plans"]) == PLANS
    for name, plan in acceptance["plans"].items():
        assert plan.get("unsupported") or plan["mean_accepted"] >= 1.0, (name, plan)
    assert acceptance["plans"]["exit-1/4"]["model_tokens"] > 0
    expected = [r for r in rows if r["kind"] == "expected"]
    assert {(r["plan"], r["batch"]) for r in expected} == {(p, b) for p in PLANS for b in (1, 16)}
    for row in expected:
        assert row["label"].startswith("costs measured on the GPU, acceptance from a real model")
        assert (row["expected_speedup"] or 0) > 0 or row.get("reason"), row
    assert (
        "costs measured on the GPU, acceptance from a real model (SmolLM2-135M on CPU; its fp32 weights sit" in stdout
    )


def test_budget_skips_and_says_so(tmp_path):
    """A budget too small for the model: nothing runs, a ``skipped`` row says why, and the run still succeeds."""
    done = shapes("--budget", "0.01", "--json", str(tmp_path / "rows.json"))
    rows = json.loads((tmp_path / "rows.json").read_text())["rows"]
    assert [r["kind"] for r in rows] == ["skipped"] and "budget" in rows[0]["reason"]
    assert "skipped" in done.stdout


def test_results_gathers_one_json(smoke, tmp_path):
    """``gpu_bench.py results`` (gpu_check.sh's last step) puts the steps and every gpu_shapes row into one JSON."""
    _, rows, _ = smoke
    (tmp_path / "shapes.json").write_text(json.dumps({"rows": rows}))
    (tmp_path / "steps.jsonl").write_text('{"step": "setup", "status": "ok", "seconds": 3, "note": ""}\n{"half')
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_bench.py"), "results", "--out", str(tmp_path / "out.json")]
        + [
            "--shapes",
            str(tmp_path / "shapes.json"),
            str(tmp_path / "absent.json"),
            "--steps",
            str(tmp_path / "steps.jsonl"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    gathered = json.loads((tmp_path / "out.json").read_text())["rows"]
    assert gathered[0] == {"kind": "step", "step": "setup", "status": "ok", "seconds": 3, "note": ""}
    assert gathered[1:] == rows
    assert "setup" in done.stdout and "rounds:" in done.stdout


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="a machine with nvidia-smi may have a GPU")
def test_gpu_check_without_a_gpu_stops_at_its_gate(tmp_path):
    """Without a GPU the check prints what it would do and exits 0 at once, having installed and written nothing."""
    env = {**os.environ, "GPU_CHECK_SCRATCH": str(tmp_path / "scratch")}
    done = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), str(tmp_path / "work")],
        capture_output=True,
        text=True,
        timeout=30,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    assert "no NVIDIA GPU here" in done.stdout and "gpu_shapes.py --shape 1b" in done.stdout
    assert not (tmp_path / "work").exists() and not (tmp_path / "scratch").exists()
