"""Issue 14: --force never destroys what is not an artifact, one-line errors for every bad input, integrity
confined to the artifact, no debris after a kill. One test (or parametrised case) per reported fault."""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from speccompile.artifact_writer import atomic_folder
from speccompile.cli import friendly_errors, main
from speccompile.runtime import load
from speccompile.runtime.errors import ArtifactError, InputError, SpeccompileError

FAST_BUILD = ("--method", "cosine", "--max-draft", "2", "--calibration-tokens", "8", "--quiet")


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def assert_one_line_error(result, *needles):
    assert result.exit_code != 0, result.output
    assert not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit), result.exception
    lines = result.stderr.strip().splitlines()
    assert len(lines) >= 1 and lines[-1].startswith("error: "), result.stderr
    assert all(not line.startswith(("error:", "Traceback")) for line in lines[:-1]), result.stderr
    for needle in needles:
        assert needle in lines[-1], lines[-1]
    return lines[-1]


def debris(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if any(m in p.name for m in (".tmp-", ".old-", ".lock")))


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def artifact_copy(tiny_artifact, tmp_path):
    target = tmp_path / "artifact"
    shutil.copytree(tiny_artifact, target)
    return target


@pytest.fixture
def model_copy(tiny_model_dir, tmp_path):
    target = tmp_path / "model"
    shutil.copytree(tiny_model_dir("llama"), target)
    return target


def edit_manifest(root: Path, change) -> None:
    path = root / "manifest.json"
    data = json.loads(path.read_text())
    result = change(data)
    path.write_text(json.dumps(data if result is None else result))


# -- 1. --force never destroys what is not an artifact -----------------------------------------------------


def test_force_refuses_a_user_folder(tiny_model_dir, tmp_path):
    out = tmp_path / "some_user_folder"
    out.mkdir()
    (out / "thesis.tex").write_text("years of work")
    line = assert_one_line_error(
        invoke("build", tiny_model_dir("llama"), "-o", out, "--force", *FAST_BUILD),
        "not a speccompile artifact",
        "thesis.tex",
    )
    assert "loaded" not in line and (out / "thesis.tex").read_text() == "years of work"
    assert debris(tmp_path) == []


def test_force_refuses_the_source_model_and_a_folder_inside_it(model_copy):
    before = sorted(p.name for p in model_copy.iterdir())
    assert_one_line_error(invoke("build", model_copy, "-o", model_copy, "--force", *FAST_BUILD), "source model")
    assert_one_line_error(invoke("build", model_copy, "-o", model_copy / "artifact", *FAST_BUILD), "source model")
    assert sorted(p.name for p in model_copy.iterdir()) == before


@pytest.mark.parametrize("out", [".", "$PWD", ".."])
def test_force_refuses_the_working_folder(tiny_model_dir, tmp_path, monkeypatch, out):
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("keep")
    monkeypatch.chdir(work)
    out = str(work) if out == "$PWD" else out
    assert_one_line_error(invoke("build", tiny_model_dir("llama"), "-o", out, "--force", *FAST_BUILD), "working folder")
    assert (work / "notes.txt").read_text() == "keep" and debris(tmp_path) == [] and debris(work) == []


def test_force_refuses_a_file_and_an_artifact_holding_unlisted_files(tiny_model_dir, artifact_copy, tmp_path):
    a_file = tmp_path / "result.txt"
    a_file.write_text("mine")
    assert_one_line_error(invoke("build", tiny_model_dir("llama"), "-o", a_file, "--force", *FAST_BUILD), "is a file")
    assert a_file.read_text() == "mine" and debris(tmp_path) == []

    (artifact_copy / "study.db").write_text("a resumable optuna study")
    assert_one_line_error(
        invoke("build", tiny_model_dir("llama"), "-o", artifact_copy, "--force", *FAST_BUILD),
        "does not list",
        "study.db",
    )
    assert (artifact_copy / "study.db").is_file()


def test_force_replaces_an_artifact_and_modes_follow_the_umask(tiny_model_dir, artifact_copy, tmp_path):
    (artifact_copy / "weights" / "model.safetensors").write_bytes(b"damaged")  # a damaged artifact is still one
    previous = os.umask(0o022)
    try:
        result = invoke("build", tiny_model_dir("llama"), "-o", artifact_copy, "--force", *FAST_BUILD)
    finally:
        os.umask(previous)
    assert result.exit_code == 0, result.output
    load(artifact_copy)  # verifies every hash
    assert artifact_copy.stat().st_mode & 0o777 == 0o755  # was 0700 (tempfile.mkdtemp)
    assert (artifact_copy / "weights").stat().st_mode & 0o777 == 0o755
    assert (artifact_copy / "manifest.json").stat().st_mode & 0o777 == 0o644
    assert debris(tmp_path) == []


# -- 3. OUT is validated before anything is loaded or tuned ------------------------------------------------


def test_out_under_a_file_fails_before_loading(tiny_model_dir, tmp_path):
    (tmp_path / "plain.txt").write_text("x")
    started = time.perf_counter()
    result = invoke("build", tiny_model_dir("llama"), "-o", tmp_path / "plain.txt" / "out", *FAST_BUILD)
    assert_one_line_error(result, "is a file")
    assert "loaded" not in result.stderr and time.perf_counter() - started < 5


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write into read-only folders")
def test_out_in_a_read_only_folder_fails_before_loading(tiny_model_dir, tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    result = invoke("build", tiny_model_dir("llama"), "-o", locked / "out", *FAST_BUILD)
    assert_one_line_error(result, "not writable")
    assert "loaded" not in result.stderr


# -- 2. one-line errors instead of tracebacks: the source model --------------------------------------------


def _truncate(model: Path) -> None:
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])


@pytest.mark.parametrize(
    "damage, needles",
    [
        (lambda m: _truncate(m), ("truncated",)),
        (lambda m: (m / "model.safetensors").write_bytes(b""), ("empty",)),
        (lambda m: (m / "config.json").write_text('{"model_type": "llama",'), ("config.json", "not valid JSON")),
        (lambda m: (m / "config.json").write_text("[1, 2]"), ("config.json", "JSON object")),
        (
            lambda m: (m / "config.json").write_text(
                json.dumps({k: v for k, v in json.loads((m / "config.json").read_text()).items() if k != "model_type"})
            ),
            ("model_type",),
        ),
    ],
    ids=["truncated-weights", "empty-weights", "invalid-config", "config-is-a-list", "no-model-type"],
)
def test_damaged_source_model_is_one_short_line(model_copy, tmp_path, damage, needles):
    damage(model_copy)
    line = assert_one_line_error(invoke("build", model_copy, "-o", tmp_path / "out", *FAST_BUILD), *needles)
    assert len(line) < 300, line  # a config without model_type used to give a 3 KB line
    assert not (tmp_path / "out").exists() and debris(tmp_path) == []


def test_a_plain_file_as_model_is_named_as_a_file(model_copy, tmp_path):
    line = assert_one_line_error(invoke("build", model_copy / "config.json", "-o", tmp_path / "out"), "is a file")
    assert "cache" not in line


# -- 2 and 6. option values are checked when parsed ---------------------------------------------------------


@pytest.mark.parametrize(
    "args, needle",
    [
        (("--seed", "-1"), "--seed"),
        (("--temperature", "nan"), "--temperature"),
        (("--temperature", "inf"), "--temperature"),
        (("--top-p", "nan"), "--top-p"),
        (("--device", "banana"), "banana"),
        (("--prompt", "caf\udce9"), "UTF-8"),
    ],
)
def test_bad_generate_options_are_one_line(tiny_artifact, args, needle):
    prompt = () if "--prompt" in args else ("--prompt", "def f(x):")
    assert_one_line_error(invoke("generate", tiny_artifact, *prompt, "--max-new-tokens", "4", *args), needle)


def test_cuda_without_a_gpu_is_one_line(tiny_artifact, tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    assert_one_line_error(invoke("generate", tiny_artifact, "--prompt", "x", "--device", "cuda"), "CUDA")
    assert_one_line_error(invoke("build", "-o", tmp_path / "out", "--device", "cuda:0"), "CUDA")


def test_non_utf8_prompt_from_a_real_shell_is_one_line(tiny_artifact):
    """argv bytes that are not UTF-8, as a shell passes them (click decodes them with surrogates)."""
    result = subprocess.run(
        [sys.executable, "-m", "speccompile.cli", "generate", str(tiny_artifact), "--prompt", b"caf\xe9"],
        capture_output=True,
        text=True,
        env={**os.environ, "LC_ALL": "C.UTF-8"},
    )
    assert result.returncode == 2 and result.stderr.startswith("error: ") and "UTF-8" in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(temperature=math.nan),
        dict(temperature=math.inf),
        dict(top_p=math.nan),
        dict(seed=-1),
        dict(top_k=-1),
        dict(max_new_tokens=0),
    ],
)
def test_bad_generation_arguments_from_python(tiny_artifact, kwargs):
    model = load(tiny_artifact)
    with pytest.raises(InputError):
        model.generate("def f(x):", **{"max_new_tokens": 4, **kwargs})


# -- 2 and 7. calibration and prompts files ---------------------------------------------------------------


def test_non_utf8_calibration_file_names_kind_and_line(tiny_model_dir, tmp_path):
    bad = tmp_path / "calib.txt"
    bad.write_bytes(b"def f():\n    pass\n\n# caf\xe9\n")
    assert_one_line_error(
        invoke("build", tiny_model_dir("llama"), "-o", tmp_path / "out", "--calibration", bad, *FAST_BUILD),
        "calibration file",
        "calib.txt:4",
        "UTF-8",
    )
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "content, needles",
    [
        (b'{"prompt": "a"}\n{"prompt": "caf\xe9"}\n', ("prompts file", "prompts.jsonl:2", "UTF-8")),
        (b'{"prompt": "a"}\n\n{"prompt": \n', ("prompts file", "prompts.jsonl:3", "not valid JSON")),
    ],
)
def test_bad_bench_prompts_file_names_kind_and_line(tiny_artifact, tmp_path, content, needles):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_bytes(content)
    line = assert_one_line_error(
        invoke("bench", tiny_artifact, "--prompts", prompts, "--no-transformers", "--quiet"), *needles
    )
    assert "calibration" not in line


# -- 2. damaged manifests ------------------------------------------------------------------------------------


def _drop_sha(data):
    next(iter(data["files"].values())).pop("sha256")


@pytest.mark.parametrize(
    "change, needle",
    [
        (lambda d: [d], "JSON object"),
        (lambda d: "manifest", "JSON object"),
        (lambda d: d.update(files=list(d["files"])), "files"),
        (lambda d: d.update(backends={}), "no backends"),
        (_drop_sha, "sha256"),
        (
            lambda d: (
                next(iter(d["plans"].values()))
                .setdefault("sources", {})
                .setdefault("model", {})
                .update(max_draft="six")
            ),
            "max_draft",
        ),
        (lambda d: d["config"].update(num_layers=None), "num_layers"),
        (
            lambda d: next(iter(d["plans"].values()))["measured"].update(confirmed_speedup="fast"),
            "measured.confirmed_speedup",
        ),
    ],
    ids=[
        "list",
        "string",
        "files-list",
        "no-backends",
        "no-sha256",
        "plan-field-type",
        "config-field-type",
        "measured-field-type",
    ],
)
def test_damaged_manifest_is_one_line(artifact_copy, change, needle):
    edit_manifest(artifact_copy, change)
    assert_one_line_error(invoke("inspect", artifact_copy), needle)
    assert_one_line_error(invoke("generate", artifact_copy, "--prompt", "x", "--max-new-tokens", "2"), needle)


# -- 4. integrity is confined to the artifact, and covers every file the runtime opens ----------------------


def _zeroed_weights_outside(artifact: Path) -> Path:
    """A valid safetensors file with every weight zeroed, next to (outside) the artifact."""
    from safetensors.torch import load_file, save_file

    weights = {k: v * 0 for k, v in load_file(str(artifact / "weights" / "model.safetensors")).items()}
    outside = artifact.parent / "evil.safetensors"
    save_file(weights, str(outside))
    return outside


def test_dotdot_file_entry_is_refused(artifact_copy):
    outside = _zeroed_weights_outside(artifact_copy)

    def point_outside(d):
        d["files"]["../evil.safetensors"] = {"sha256": sha256(outside), "bytes": outside.stat().st_size}
        d["backends"]["torch"]["weights"] = "../evil.safetensors"

    edit_manifest(artifact_copy, point_outside)
    assert_one_line_error(invoke("generate", artifact_copy, "--prompt", "x", "--max-new-tokens", "4"), "../evil")


def test_unlisted_weights_path_outside_is_refused(artifact_copy):
    outside = _zeroed_weights_outside(artifact_copy)
    edit_manifest(artifact_copy, lambda d: d["backends"]["torch"].update(weights=str(outside)))
    with pytest.raises(ArtifactError, match="evil"):
        load(artifact_copy)


def test_weights_not_listed_in_files_are_refused(artifact_copy):
    shutil.copy(artifact_copy / "weights" / "model.safetensors", artifact_copy / "weights" / "other.safetensors")
    edit_manifest(artifact_copy, lambda d: d["backends"]["torch"].update(weights="weights/other.safetensors"))
    with pytest.raises(ArtifactError, match="not listed"):
        load(artifact_copy)


def test_symlink_leaving_the_artifact_is_refused(artifact_copy, tmp_path):
    inside = artifact_copy / "weights" / "model.safetensors"
    outside = tmp_path / "elsewhere.safetensors"
    shutil.move(inside, outside)
    inside.symlink_to(outside)  # same bytes, so the sha256 matches: only the location is wrong
    assert_one_line_error(
        invoke("generate", artifact_copy, "--prompt", "x", "--max-new-tokens", "2"), "outside the artifact"
    )


def test_inspect_reports_unlisted_files(artifact_copy):
    (artifact_copy / "weights" / "extra.bin").write_bytes(b"\0" * 8)
    result = invoke("inspect", artifact_copy)
    assert result.exit_code == 0 and "weights/extra.bin" in result.stderr and "not in its manifest" in result.stderr


# -- 5. debris and races ----------------------------------------------------------------------------------


def test_next_build_removes_what_a_kill_left(tiny_model_dir, tmp_path):
    out = tmp_path / "out"
    (tmp_path / ".out.tmp-4242-deadbeef" / "weights").mkdir(parents=True)  # SIGKILL during the final write
    (tmp_path / ".out.old-4242-deadbeef").mkdir()
    (tmp_path / ".out.old-4243-cafecafe").write_text("a file replaced with --force")
    (tmp_path / ".other.tmp-1-aaaa").mkdir()  # another OUT's: not ours to remove
    result = invoke("build", tiny_model_dir("llama"), "-o", out, *FAST_BUILD)
    assert result.exit_code == 0, result.output
    assert debris(tmp_path) == [".other.tmp-1-aaaa"]


def test_sigterm_during_build_exits_143_and_leaves_nothing(tiny_model_dir, tmp_path):
    out = tmp_path / "out"
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "speccompile.cli",
            "build",
            str(tiny_model_dir("llama")),
            "-o",
            str(out),
            "--method",
            "bayes",
            "--trials",
            "100000",
            "--time-budget",
            "120",
            "--calibration-tokens",
            "8",
            "--quiet",
        ],
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    try:
        lines = []
        for line in process.stderr:  # wait until the build is under way (the lock is held)
            lines.append(line)
            if line.startswith("pass "):
                break
        assert (tmp_path / ".out.lock").exists(), lines
        process.send_signal(signal.SIGTERM)
        rest = process.communicate(timeout=60)[1]
    finally:
        process.kill()
    assert process.returncode == 143, rest
    assert rest.strip().splitlines()[-1].startswith("terminated"), rest
    assert not out.exists() and debris(tmp_path) == []


def test_a_second_build_of_a_locked_out_fails_clearly(tiny_model_dir, tmp_path):
    out = tmp_path / "out"
    with open(tmp_path / ".out.lock", "w") as held:  # what a running build holds
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        result = invoke("build", tiny_model_dir("llama"), "-o", out, *FAST_BUILD)
    assert_one_line_error(result, "another speccompile build")
    assert not out.exists()


def test_out_appearing_during_a_build_is_not_replaced_without_force(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(SpeccompileError, match="appeared"):
        with atomic_folder(out) as tmp:
            (tmp / "new.txt").write_text("second build")
            out.mkdir()  # the first build finished meanwhile
            (out / "first.txt").write_text("first build")
    assert [p.name for p in out.iterdir()] == ["first.txt"] and debris(tmp_path) == []


def test_tune_through_a_symlink_rewrites_the_real_artifact(artifact_copy, tmp_path):
    link = tmp_path / "current"
    link.symlink_to(artifact_copy)
    result = invoke("tune", link, "--method", "cosine", "--max-draft", "2", "--calibration-tokens", "8", "--quiet")
    assert result.exit_code == 0, result.output
    assert link.is_symlink() and link.resolve() == artifact_copy.resolve()
    assert json.loads((artifact_copy / "manifest.json").read_text())["tuning"]["retuned"] is True
    assert debris(tmp_path) == []
    load(link)


def test_tune_refuses_early_to_drop_unlisted_files(artifact_copy):
    (artifact_copy / "notes.md").write_text("mine")
    started = time.perf_counter()
    result = invoke("tune", artifact_copy, "--method", "cosine", "--calibration-tokens", "8", "--quiet")
    assert_one_line_error(result, "does not list", "notes.md")
    assert (artifact_copy / "notes.md").is_file() and time.perf_counter() - started < 5


# -- the error boundary ------------------------------------------------------------------------------------


def test_unexpected_errors_are_one_line_with_a_debug_hint():
    @click.command()
    @friendly_errors
    def broken():
        raise RuntimeError("something nobody expected\nsecond line")

    result = CliRunner().invoke(broken, [])
    line = assert_one_line_error(result, "RuntimeError", "something nobody expected", "--debug")
    assert "second line" in line  # folded onto the one line
    debug = CliRunner().invoke(broken, ["--debug"])
    assert isinstance(debug.exception, RuntimeError)  # the traceback, for a bug report


# -- manifests that do not fit their weights, unbounded quotes, deep values, tiny temperatures ------


GEOMETRY_EDITS = [  # (config change, words the error must hold)
    ({"num_layers": 5}, ["num_layers", "5"]),
    ({"num_layers": 3}, ["layers [3] outside 0..2"]),  # the plan's reference to block 3, checked first
    ({"hidden_size": 32}, ["hidden_size"]),
    ({"vocab_size": 300}, ["vocab_size"]),
    ({"rotary_dim": 8}, ["rotary_dim"]),
    ({"num_heads": 2}, ["num_heads"]),
    ({"num_kv_heads": 1}, ["num_kv_heads"]),
    ({"head_dim": 32}, ["head_dim"]),
    ({"intermediate_size": 64}, ["intermediate_size"]),
    ({"num_experts": 2, "experts_per_token": 1}, ["num_experts"]),
    ({"tie_word_embeddings": True}, ["lm_head"]),
    ({"qk_norm": True}, ["q_norm"]),
    ({"norm": "layer"}, ["norm", "bias"]),
    ({"mlp": "plain"}, ["gate"]),
    ({"positions": "learned"}, ["pos_embed"]),
    ({"num_heads": 3}, ["num_heads", "num_kv_heads"]),  # not a multiple: refused by the schema's rules
    ({"activation": "swish"}, ["activation", "swish"]),
]


@pytest.mark.parametrize("change, words", GEOMETRY_EDITS, ids=[",".join(c) for c, _ in GEOMETRY_EDITS])
def test_a_config_that_does_not_fit_the_weights_is_one_line(artifact_copy, change, words):
    """The manifest's geometry is checked against the safetensors header before the backend opens: the
    runtime's own error naming the field, never the crash handler's "this is a bug" line."""
    edit_manifest(artifact_copy, lambda d: d["config"].update(change))
    with pytest.raises(ArtifactError) as refused:
        load(artifact_copy)
    assert type(refused.value).__name__ == "ArtifactError", refused.value  # a check, not the boundary's net
    line = assert_one_line_error(invoke("generate", artifact_copy, "--prompt", "x", "--max-new-tokens", "2"), *words)
    assert "this is a bug" not in line


@pytest.fixture(scope="module")
def artifact_of_each_path(tiny_model_dir, tiny_artifact, tmp_path_factory):
    """kind -> a built artifact: the tiny Llama for torch (canonical) and ONNX Runtime, the tiny OLMo on the generic
    torch path (its geometry lives in the model's own config.json, not in a tensor table)."""
    from speccompile.build import BuildOptions, build

    root = tmp_path_factory.mktemp("paths")
    quick = dict(method="cosine", max_draft=2, calibration_tokens=8, confirm_prompts=1, confirm_tokens=8)
    made = {"torch": tiny_artifact}
    for kind, family, backend in (("onnx", "llama", "onnx"), ("generic", "olmo", "torch")):
        options = BuildOptions(
            model=str(tiny_model_dir(family)), out=root / kind, backends=(backend,), show_progress=False, **quick
        )
        made[kind] = build(options, log=lambda message: None)
    return made


@pytest.mark.parametrize("kind", ["torch", "onnx", "generic"])
@pytest.mark.parametrize("change", [{"num_layers": 5}, {"hidden_size": 32}], ids=lambda c: next(iter(c)))
def test_inspect_reports_a_manifest_that_does_not_fit_its_weights_as_damaged(
    artifact_of_each_path, tmp_path, kind, change
):
    """inspect runs load's consistency check: a manifest edited to another geometry is a one-line error and a
    non-zero exit, not a summary of a model that is not there (the generic path's config.json included)."""
    copy = tmp_path / kind
    shutil.copytree(artifact_of_each_path[kind], copy)
    edit_manifest(copy, lambda d: d["config"].update(change))
    field = next(iter(change))
    for args in (("inspect", copy), ("inspect", copy, "--json")):
        assert_one_line_error(invoke(*args), field, "rebuild the artifact")
    with pytest.raises(ArtifactError, match=field):
        load(copy)


@pytest.mark.parametrize("where", ["files", "weights", "plan-name", "default-plan", "config-string"])
def test_an_over_long_value_is_quoted_by_a_bounded_prefix(artifact_copy, where):
    long = "weights/" + "a" * 1_000_000

    def change(d):
        if where == "files":
            d["files"][long] = {"sha256": "0" * 64, "bytes": 1}
        elif where == "weights":
            d["files"][long] = d["files"]["weights/model.safetensors"]
            d["backends"]["torch"]["weights"] = long
        elif where == "plan-name":
            d["plans"][long] = next(iter(d["plans"].values()))
        elif where == "default-plan":
            d["default_plan"] = long
        else:
            d["config"]["model_type"] = long

    edit_manifest(artifact_copy, change)
    for command in (("inspect", artifact_copy), ("generate", artifact_copy, "--prompt", "x", "--max-new-tokens", "2")):
        result = invoke(*command)
        assert_one_line_error(result)
        assert len(result.stderr) < 1000, len(result.stderr)
    with pytest.raises(ArtifactError) as refused:
        load(artifact_copy)
    assert len(str(refused.value)) <= 600 and "characters" in str(refused.value)


@pytest.mark.parametrize("depth", [40, 600, 950, 100_000])
def test_a_recursion_deep_value_in_a_plan_is_one_line(artifact_copy, depth):
    text = (artifact_copy / "manifest.json").read_text()
    deep = "[" * depth + "]" * depth
    (artifact_copy / "manifest.json").write_text(text.replace('"measured": {', f'"measured": {{"deep": {deep}, ', 1))
    with pytest.raises(ArtifactError, match="nested"):
        load(artifact_copy)
    assert_one_line_error(invoke("generate", artifact_copy, "--prompt", "x", "--max-new-tokens", "2"), "nested")


@pytest.mark.parametrize("temperature", ["1e-40", "1e-300", "5e-324"])
def test_a_tiny_temperature_decodes_like_greedy_in_the_cli(tiny_artifact, temperature):
    """softmax(logits / T) with T too small for the division to fit a float: the same tokens as greedy, no
    overflow warning, in the CLI (the server's test is in test_hostile_bodies.py: the same rule)."""
    args = ("generate", tiny_artifact, "--prompt", "class Point:", "--max-new-tokens", "12", "--json", "--no-speculate")
    greedy = invoke(*args)
    tiny = invoke(*args, "--temperature", temperature, "--seed", "5")
    assert tiny.exit_code == 0 and "Warning" not in tiny.stderr, tiny.stderr
    last = lambda result: json.loads(result.stdout.strip().splitlines()[-1])["token_ids"]  # noqa: E731
    assert last(tiny) == last(greedy)
    model = load(tiny_artifact)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sampled = model.generate("class Point:", max_new_tokens=12, temperature=float(temperature), seed=1)
    assert sampled.token_ids == last(greedy)
