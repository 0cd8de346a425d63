"""The TensorRT path on CPU, as far as it runs without a GPU; the GPU parts are CUDA-marked.

- the manifest guard (another GPU, another TensorRT version: both named), the profile sizing, the refit
  name mapping from ``weights.bin`` and the missing-TensorRT error (TensorRT made unimportable in a
  subprocess) are plain functions and run here;
- the backend's device-buffer bookkeeping (KV staging with 2D copies, early-exit hidden states in
  place, chunked prefill, profile choice) runs here with the *same ONNX graphs* executed by ONNX Runtime
  over host buffers (``HostMemory`` / ``OrtHostEngines`` below: the five memory calls and ``run`` of
  ``runtime/backends/tensorrt/backend.py``), and must decode exactly like the ONNX backend;
- building real engines and decoding with them needs TensorRT and a GPU (``-m cuda``).
"""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from import_blocker import preamble

from speccompile.exporters.onnx_export import export_onnx
from speccompile.exporters.tensorrt import backend_record, engine_context, profile_shapes, step_tokens
from speccompile.runtime.artifact.manifest import DraftPlan
from speccompile.runtime.backends.onnx import OnnxBackend
from speccompile.runtime.backends.tensorrt.backend import TensorRTBackend, check_target, refit_weights
from speccompile.runtime.decoding.speculative import DecodeRequest, decode_all
from speccompile.runtime.errors import ArtifactError, InputError

PROMPT = [5, 17, 42, 9, 100, 3, 77, 12, 40, 41, 42, 43, 8, 9, 10, 11, 12, 13, 200]
SKIP = DraftPlan.of(
    name="layer-skip", skip_attn=[1], skip_mlp=[2], sources={"model": {"max_draft": 4, "threshold": 0.0}}
)
EXIT = DraftPlan.of(
    name="early-exit", exit_layer=3, head="final", sources={"model": {"max_draft": 3, "threshold": 0.0}}
)
H200 = {"gpu": "NVIDIA H200", "compute_capability": "9.0", "tensorrt_version": "10.13.3.9"}


# -- host stand-ins for the device: the same calls, on host memory and ONNX Runtime -----------------
class HostMemory:
    """``runtime/cuda_device.CudaMemory``'s calls over host memory (ctypes.memmove for every copy)."""

    index = 0
    stream_handle = 0

    def __init__(self, index: int = 0):
        self.blocks: list[np.ndarray] = []

    def alloc(self, nbytes: int) -> int:
        block = np.full(max(int(nbytes), 1), 0xAB, dtype=np.uint8)  # garbage, like fresh device memory
        self.blocks.append(block)
        return block.ctypes.data

    def copy_2d(self, dst, dpitch, src, spitch, width, height) -> None:
        assert width <= dpitch and width <= spitch or height <= 1
        for row in range(height):
            ctypes.memmove(dst + row * dpitch, src + row * spitch, width)

    def to_device(self, dst: int, array: np.ndarray) -> None:
        array = np.ascontiguousarray(array)
        ctypes.memmove(dst, array.ctypes.data, array.nbytes)

    def to_host(self, array: np.ndarray, src: int) -> np.ndarray:
        ctypes.memmove(array.ctypes.data, src, array.nbytes)
        return array


def _view(address: int, shape, dtype) -> np.ndarray:
    count = int(np.prod(shape))
    if count == 0:
        return np.zeros(shape, dtype)
    raw = (ctypes.c_uint8 * (count * np.dtype(dtype).itemsize)).from_address(address)
    return np.frombuffer(raw, dtype=dtype).reshape(shape)


class OrtHostEngines:
    """``TensorRTEngines.run`` with ONNX Runtime: reads inputs from, and writes outputs to, the bound
    addresses; records the profile each call chose and refuses shapes outside it."""

    def __init__(self, root: Path, record: dict):
        import onnxruntime as ort

        self.record, self.calls = record, []
        self.sessions = {
            key: ort.InferenceSession(str(root / g["file"]), providers=["CPUExecutionProvider"])
            for key, g in record["graphs"].items()
        }

    def run(self, key, profile, shapes, addresses) -> None:
        self.calls.append((key, profile, {n: tuple(s) for n, s in shapes.items()}))
        name_profile = ("step", "prefill")[profile]
        limit = self.record["profiles"][name_profile]["max_tokens"]
        session = self.sessions[key]
        feeds = {}
        for spec in session.get_inputs():
            shape = shapes[spec.name]
            assert shape[1] <= limit or spec.name.startswith("past_"), (key, spec.name, shape, name_profile)
            dtype = np.int64 if "int64" in spec.type else (np.float16 if "float16" in spec.type else np.float32)
            feeds[spec.name] = _view(addresses[spec.name], shape, dtype).copy()
        names = [o.name for o in session.get_outputs()]
        for name, value in zip(names, session.run(names, feeds)):
            value = np.ascontiguousarray(value)
            ctypes.memmove(addresses[name], value.ctypes.data, value.nbytes)

    def with_memory(self, memory):
        return self


@pytest.fixture(scope="module")
def exported(tiny_decoder, tmp_path_factory):
    """Standard ONNX graphs of the tiny Llama for a layer-skip and an early-exit plan, and one for an
    early exit alone (no verify engine: prefix + suffix)."""
    _, decoder = tiny_decoder("llama")
    root = tmp_path_factory.mktemp("trt")
    both = export_onnx(decoder, {"layer-skip": SKIP, "early-exit": EXIT}, root / "both" / "onnx")
    exit_only = export_onnx(decoder, {"early-exit": EXIT}, root / "exit" / "onnx")
    return decoder, root, both, exit_only


def _host_backend(root: Path, onnx_record: dict, config, plans, context=None, prefill=16):
    context = context or engine_context(config)
    step = step_tokens(plans, context)
    record = backend_record(onnx_record, dict(H200), {}, context, step, prefill)
    engines = OrtHostEngines(root, record)
    return TensorRTBackend(root, record, config, engines=engines, memory=HostMemory()), engines


# -- plain functions -----------------------------------------------------------------------------------
def test_manifest_guard_names_both_gpus_and_versions():
    check_target(H200, dict(H200))
    with pytest.raises(ArtifactError) as gpu:
        check_target(H200, {"gpu": "Orin (nvgpu)", "compute_capability": "8.7", "tensorrt_version": "10.13.3.9"})
    message = str(gpu.value)
    assert "NVIDIA H200" in message and "Orin (nvgpu)" in message and "9.0" in message and "8.7" in message
    assert "\n" not in message and "--backend tensorrt" in message
    with pytest.raises(ArtifactError) as version:
        check_target(H200, dict(H200, tensorrt_version="10.3.0.30"))
    assert "10.13.3.9" in str(version.value) and "10.3.0.30" in str(version.value)


def test_profiles_are_sized_from_the_context_and_the_plans(exported):
    decoder, _, both, _ = exported
    config = decoder.config
    context = engine_context(config)
    assert context == min(config.max_position_embeddings, 4096)
    assert engine_context(config, cap=64) == 64
    lookup = (
        DraftPlan.of(
            name="hybrid", skip_attn=[1], lookup="ngram", lookup_max_draft=12, sources={"model": {"max_draft": 6}}
        )
        if "lookup" in DraftPlan.__dataclass_fields__
        else SKIP
    )
    assert step_tokens({"s": SKIP}, context) == 8  # 4 drafts + 1, raised to the minimum of 8
    assert step_tokens({"s": lookup}, context) == (19 if lookup is not SKIP else 8)
    assert step_tokens({"s": lookup}, 6) == 6  # never past the context
    step, prefill = profile_shapes(both["graphs"]["verify"], context=64, step=8, prefill=16)
    kv, hd = config.num_kv_heads, config.head_dim
    assert step["input_ids"] == [[1, 1], [1, 1], [1, 8]]
    assert prefill["input_ids"] == [[1, 1], [1, 16], [1, 16]]
    assert step["past_key_values.0.key"] == [[1, kv, 0, hd], [1, kv, 63, hd], [1, kv, 63, hd]]
    assert prefill["past_key_values.0.key"][0] == [1, kv, 0, hd] and prefill["past_key_values.0.key"][1][2] == 0
    assert set(step) == {spec["name"] for spec in both["graphs"]["verify"]["inputs"]}
    suffix, _ = profile_shapes(both["graphs"]["suffix.3"], context=64, step=8, prefill=16, decodes_one=False)
    assert suffix["hidden"] == [[1, 1, config.hidden_size], [1, 4, config.hidden_size], [1, 8, config.hidden_size]]
    assert "past_key_values.2.key" not in suffix and "past_key_values.3.key" in suffix  # suffix runs block 3 only
    head, _ = profile_shapes(both["graphs"]["head"], context=64, step=8, prefill=16)
    assert set(head) == {"hidden"}


def test_tensorrt_export_graphs_model_plans_and_sizes_steps_for_every_plan(tiny_decoder, tmp_path, monkeypatch):
    """``write_backend_files`` with ``tensorrt`` and no ONNX backend exports the standard graphs itself: graphs
    for the plans with a model part only (as the ONNX backend's export), while the engines' step profile covers
    every plan's verify, a lookup-only plan's too. (The filter once read an attribute no plan had, so every
    plan reached the export.)"""
    import speccompile.exporters.tensorrt as trt_export
    from speccompile.artifact_writer import write_backend_files
    from speccompile.convert import canonical_weights
    from speccompile.passes.ir import DecoderIR

    hf, decoder = tiny_decoder("llama")
    lookup = DraftPlan.of(name="lookup", lookup=["ngram"], lookup_max_draft=20)
    seen = {}

    def engines_here(root, onnx_record, plans, config, device="cuda", log=None):  # no TensorRT on this machine
        seen["graphs_for"] = set(onnx_record["plans"])
        seen["step"] = step_tokens(plans, engine_context(config))
        return {"engines": {}}

    monkeypatch.setattr(trt_export, "build_engines", engines_here)
    ir = DecoderIR(decoder.config, canonical_weights(hf, decoder.config), plans={"layer-skip": SKIP, "lookup": lookup})
    write_backend_files(tmp_path, ir, ["tensorrt"])
    assert seen["graphs_for"] == {"layer-skip"}
    assert seen["step"] == 21  # the lookup plan's 20 drafts and its input token


def test_refit_names_map_to_weights_bin(exported):
    decoder, root, both, _ = exported
    blob = np.fromfile(root / "both" / both["weights"], dtype=np.uint8)
    names = list(both["graphs"]["verify"]["initializers"]) + ["onnx::Constant_7"]
    arrays, missing = refit_weights(names, both, blob)
    assert missing == ["onnx::Constant_7"]
    state = decoder.state_dict()
    assert set(arrays) == set(names[:-1])
    for name, array in arrays.items():
        np.testing.assert_array_equal(array, state[name].float().numpy())
    assert arrays["embed.weight"].base is not None  # a view of the file, not a copy
    with pytest.raises(ArtifactError, match="truncated"):
        refit_weights(names, both, blob[: blob.size // 2])


BLOCKER = (
    preamble("tensorrt", "cuda")
    + """
sys.argv = ['speccompile'] + sys.argv[1:]
from speccompile.cli import main
main()
"""
)


def test_backend_tensorrt_without_tensorrt_is_one_line(tiny_model_dir, exported, tmp_path):
    """``build --backend tensorrt`` and opening a TensorRT backend, with TensorRT and cuda-python
    unimportable: one line naming the install, nothing written."""
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            BLOCKER,
            "build",
            str(tiny_model_dir("llama")),
            "-o",
            str(tmp_path / "out"),
            "--backend",
            "tensorrt",
            "--quiet",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr
    assert "pip install tensorrt" in lines[0]
    assert not (tmp_path / "out").exists()
    decoder, root, both, _ = exported
    record = backend_record(both, dict(H200), {}, 64, 8, 16)
    (tmp_path / "record.json").write_text(json.dumps({"record": record, "config": decoder.config.__dict__}))
    opener = (
        BLOCKER.split("sys.argv")[0]
        + f"""
import json
from speccompile.runtime.errors import BackendUnavailableError
from speccompile.runtime.artifact.manifest import ArchConfig
from speccompile.runtime.backends.tensorrt.backend import TensorRTBackend
data = json.load(open({str(tmp_path / "record.json")!r}))
try:
    TensorRTBackend({str(root / "both")!r}, data["record"], ArchConfig(**data["config"]))
except BackendUnavailableError as exc:
    print(exc)
"""
    )
    opened = subprocess.run([sys.executable, "-c", opener], capture_output=True, text=True, timeout=120)
    assert opened.returncode == 0 and "pip install tensorrt" in opened.stdout, opened.stderr
    assert len(opened.stdout.strip().splitlines()) == 1


# -- the backend's bookkeeping on host buffers ---------------------------------------------------------
@pytest.mark.parametrize("which", ["both", "exit"])
def test_backend_decodes_like_the_onnx_backend(exported, which):
    """Greedy plain and speculative tokens equal ONNX Runtime's on the same graphs: KV staging by 2D
    copies, rollback, early-exit hidden states in place and chunked prompts all line up."""
    decoder, root, both, exit_only = exported
    folder, record = (root / "both", both) if which == "both" else (root / "exit", exit_only)
    plans = {"layer-skip": SKIP, "early-exit": EXIT} if which == "both" else {"early-exit": EXIT}
    backend, engines = _host_backend(folder, record, decoder.config, plans)
    reference = OnnxBackend(folder, record, decoder.config, threads=1)
    for plan in [None, *plans.values()]:
        ours, stats = decode_all(backend, DecodeRequest(PROMPT, 24), plan)
        theirs, _ = decode_all(reference, DecodeRequest(PROMPT, 24), plan)
        assert ours == theirs, plan
        if plan is not None:
            assert stats.rounds > 0 and stats.accepted > 0
    keys = {key for key, _, _ in engines.calls}
    assert ("verify" in keys) == (which == "both")  # early exits alone: prefix + suffix, no verify engine
    prefill_calls = [shapes for _, profile, shapes in engines.calls if profile == 1]  # 19 tokens: 16 + 3
    assert prefill_calls and all(s.get("input_ids", s.get("hidden"))[1] == 16 for s in prefill_calls)


def test_a_draft_head_plan_is_refused_in_one_line_before_any_work(exported):
    """The engines have no draft heads: a plan with an exit adapter is refused before an engine runs."""
    decoder, root, both, _ = exported
    backend, engines = _host_backend(root / "both", both, decoder.config, {"layer-skip": SKIP, "early-exit": EXIT})
    adapter = DraftPlan.of(name="adapter", exit_layer=3, head="adapter:3", draft_head_file="draft_heads/a.safetensors")
    with pytest.raises(ArtifactError) as exc:
        decode_all(backend, DecodeRequest(PROMPT, 8), adapter, root)
    message = str(exc.value)
    assert "'adapter'" in message and "draft heads" in message and "\n" not in message
    assert not engines.calls


def test_chunked_prompt_logits_and_limits(exported):
    decoder, root, both, _ = exported
    backend, engines = _host_backend(root / "both", both, decoder.config, {"s": SKIP}, context=32, prefill=8)
    backend.reserve(30)
    logits = backend.forward(PROMPT, 0)
    with torch.inference_mode():
        expected = decoder(torch.tensor([PROMPT]))[0].numpy()
    np.testing.assert_allclose(logits, expected, rtol=1e-4, atol=1e-4)
    assert [shapes["input_ids"] for _, _, shapes in engines.calls] == [(1, 8), (1, 8), (1, 3)]
    assert [shapes["past_key_values.0.key"][2] for _, _, shapes in engines.calls] == [0, 8, 16]
    with pytest.raises(InputError, match="cover 32 positions"):
        backend.reserve(33)
    replica = backend.replica()
    replica.reserve(30)
    np.testing.assert_allclose(replica.forward(PROMPT[:5], 0), expected[:5], rtol=1e-4, atol=1e-4)


# -- on a GPU with TensorRT ----------------------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_tensorrt_artifact_decodes_losslessly(tiny_model_dir, tmp_path):
    """Build a real TensorRT artifact, refit at load, greedy speculative == greedy plain, and the guard
    refuses a manifest that names another GPU."""
    pytest.importorskip("tensorrt")
    pytest.importorskip("cuda.bindings")
    from speccompile.build import BuildOptions, build
    from speccompile.runtime import load

    out = tmp_path / "trt"
    build(
        BuildOptions(
            model=str(tiny_model_dir("llama")),
            out=out,
            method="cosine",
            max_draft=4,
            calibration_tokens=16,
            confirm_prompts=2,
            confirm_tokens=16,
            backends=("torch", "tensorrt"),
            device="cuda",
            show_progress=False,
        ),
        log=lambda m: None,
    )
    model = load(out, backend="tensorrt", device="cuda")
    plain = model.generate(PROMPT, max_new_tokens=32, speculate=False).token_ids
    for name in model.manifest.plans:
        assert model.generate(PROMPT, max_new_tokens=32, plan=name).token_ids == plain
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["backends"]["tensorrt"]["weight_stripped"] is True
    manifest["backends"]["tensorrt"]["target"]["gpu"] = "Some Other GPU"
    (out / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="Some Other GPU"):
        load(out, backend="tensorrt", device="cuda", verify=False)


def test_adding_engines_to_an_artifact_needs_onnx_graphs_and_tensorrt(tiny_artifact, tiny_decoder, tmp_path):
    """``python -m speccompile.exporters.tensorrt ARTIFACT`` (the torch-free edge route): a torch-only artifact
    is refused for lacking ONNX graphs, an ONNX artifact without TensorRT names the install; one line each,
    the manifest untouched."""
    import shutil

    from speccompile.exporters.onnx_export import export_onnx_weights
    from speccompile.exporters.tensorrt import main
    from speccompile.runtime.artifact.manifest import file_record, read_manifest, write_manifest

    assert main([str(tiny_artifact)]) == 1  # torch only: no ONNX graphs to build from
    art = tmp_path / "with-onnx"
    shutil.copytree(tiny_artifact, art)
    manifest = read_manifest(art)
    _, decoder = tiny_decoder("llama")
    manifest.backends["onnx"] = export_onnx_weights(manifest.config, decoder.state_dict(), {}, art / "onnx")
    for path in (art / "onnx").iterdir():
        manifest.files[f"onnx/{path.name}"] = file_record(art, f"onnx/{path.name}")
    write_manifest(art, manifest)
    before = (art / "manifest.json").read_bytes()
    script = (
        BLOCKER.split("sys.argv")[0]
        + f"from speccompile.exporters.tensorrt import main\nsys.exit(main([{str(art)!r}]))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert len(result.stderr.strip().splitlines()) == 1 and "pip install tensorrt" in result.stderr, result.stderr
    assert (art / "manifest.json").read_bytes() == before and not (art / "tensorrt").exists()


def test_cuda_binding_without_a_gpu_is_one_line():
    """The CUDA binding's calls go through cuda-python's argument checks and fail here only for want of a
    driver, as one line naming the problem and the fix."""
    pytest.importorskip("cuda.bindings")
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the no-GPU error cannot happen")
    from speccompile.runtime.backends.tensorrt.cuda import CudaMemory
    from speccompile.runtime.errors import BackendUnavailableError

    with pytest.raises(BackendUnavailableError) as error:
        CudaMemory(0)
    message = str(error.value)
    assert "\n" not in message and "could not select GPU 0" in message and "--backend onnx" in message
