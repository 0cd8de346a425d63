"""``benchmarks/long_context.py --smoke``: the long-input benchmark end to end on the bundled refcoder.

Why: the full run (SmolLM2 at 256 to 7K tokens, both backends) takes long enough that a script broken in a path
only it takes (an input shorter than asked, a question without a function, a backend's row never written) would
cost the run. The smoke run builds refcoder for both backends and decodes both tasks plainly and speculatively;
its rows are a real lossless check (every speculative output equals the plain one). Nothing here is timed: the
figures smoke prints mean nothing.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "long_context.py"
sys.path.insert(0, str(ROOT / "benchmarks"))

import long_context  # noqa: E402


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("long") / "long.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--json", str(out)], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done, json.loads(out.read_text())


def test_smoke_writes_every_row_lossless(smoke):
    done, report = smoke
    rows = {(r["backend"], r["task"], r["length"]): r for r in report["rows"]}
    expected = {(b, t, n) for b in ("torch", "onnx") for t in ("continue", "qa") for n in long_context.SMOKE_LENGTHS}
    assert set(rows) == expected
    for (backend, task, length), row in rows.items():
        assert row["identical"] == row["inputs"] == 1, (backend, task, length)
        if task == "continue":
            assert row["prompt_tokens"] == length
        else:  # the question's tokens and the cut code's re-tokenization move the length a little
            assert abs(row["prompt_tokens"] - length) <= 16
        assert row["ttft_plain_s"] > 0 and row["ttft_speculative_s"] > 0
        assert row["request_speedup"] is not None and row["mean_accepted"] >= 1
    assert all(info["plan"] for info in report["backends"].values())  # smoke speculates even without a default
    assert all(r["speculative"]["rounds"] > 0 for r in report["requests"])
    table = [line for line in done.stdout.splitlines() if line.startswith("| torch") or line.startswith("| onnx")]
    assert len(table) == len(expected)
    assert "first token" in done.stderr  # progress goes to stderr


def test_inputs_come_from_the_standard_library():
    sources = dict(long_context.stdlib_sources())
    assert len(sources) >= 8 and "argparse.py" in sources
    name = long_context.first_function(sources["argparse.py"])
    assert name and f"\ndef {name}(" in sources["argparse.py"]
    assert long_context.first_function("class A:\n    def go(self):\n        pass\n") == "go"
    assert long_context.first_function("x = 1\n") is None


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--lengths", "1k"], "--lengths takes comma-separated whole numbers"),
        (["--lengths", "8"], "at least 16 tokens"),
        (["--tasks", "summarize"], "--tasks takes continue, qa or both"),
        (["--backends", "tensorrt"], "--backends takes torch, onnx or both"),
        (["--max-new-tokens", "1"], "--max-new-tokens must be at least 2"),
    ],
)
def test_bad_options_are_refused_in_one_line(argv, message):
    done = subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and message in done.stderr and not done.stdout


def test_artifact_option_names_a_folder_per_backend(tmp_path):
    both = long_context.artifacts_from(str(tmp_path), ["torch", "onnx"], build=None)
    assert both == {"torch": tmp_path, "onnx": tmp_path}
    pairs = long_context.artifacts_from(f"torch={tmp_path}/t,onnx={tmp_path}/o", ["torch", "onnx"], build=None)
    assert pairs == {"torch": tmp_path / "t", "onnx": tmp_path / "o"}
    with pytest.raises(SystemExit, match="BACKEND=FOLDER for each of torch,onnx"):
        long_context.artifacts_from(f"torch={tmp_path}", ["torch", "onnx"], build=None)


def test_an_artifact_that_does_not_load_is_refused_in_one_line(tmp_path):
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--artifact", str(tmp_path / "none"), "--backends", "onnx", "--lengths", "256"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 1 and last.startswith("onnx: ") and "does not exist" in last and not done.stdout
