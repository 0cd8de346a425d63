"""Backends behind a registry: a backend written outside speccompile (``tests/demo_backend.py``, one module plus
one registry line) is written by the build, checked and opened by ``load``, and decodes plainly and
speculatively with the output of the canonical decoder, with no other file touched; without the line, every
command refuses it in one line."""

from __future__ import annotations

import numpy as np
import pytest
from lossless import NEAR_TIE

from speccompile.build import BuildOptions, build
from speccompile.runtime import load
from speccompile.runtime.backends import BACKENDS
from speccompile.runtime.errors import SpeccompileError

PROMPTS = [[1, 40, 41, 42, 43, 40, 41, 42, 43, 40], [1, 100, 7, 250, 31], [1] + list(range(60, 80))]


def options(model_dir, out, backends=("demo",)) -> BuildOptions:
    return BuildOptions(
        model=str(model_dir),
        out=out,
        method="lookup",
        backends=backends,
        max_draft=4,
        calibration_tokens=16,
        confirm_prompts=2,
        confirm_tokens=16,
        show_progress=False,
    )


@pytest.fixture
def demo_backend(monkeypatch):
    monkeypatch.setitem(BACKENDS, "demo", "demo_backend:DemoDescriptor")


def greedy_gap(decoder, tokens: list[int]) -> float:
    import torch

    with torch.inference_mode():
        top = torch.sort(decoder(torch.tensor([tokens]))[0, -1]).values[-2:]
    return float(top[1] - top[0])


def same_or_near_tie(decoder, prompt: list[int], expected: list[int], got: list[int]) -> None:
    """``got`` is ``expected``, or first differs where the canonical decoder's own top-2 gap is a near-tie
    (docs/design.md section 6: two implementations may round a tie differently)."""
    if got == expected:
        return
    i = next((k for k, (a, b) in enumerate(zip(expected, got)) if a != b), min(len(expected), len(got)))
    assert greedy_gap(decoder, prompt + expected[:i]) < NEAR_TIE, f"differs at token {i}: not rounding"


def test_a_backend_added_outside_speccompile_builds_opens_and_decodes(
    demo_backend, tiny_model_dir, tiny_decoder, tmp_path
):
    _, decoder = tiny_decoder("llama")
    out = build(options(tiny_model_dir("llama"), tmp_path / "art"), log=lambda message: None)
    model = load(out)
    assert model.backend.name == "demo" and list(model.manifest.backends) == ["demo"]
    assert (out / "demo" / "weights.safetensors").is_file() and "demo/weights.safetensors" in model.manifest.files

    import torch

    with torch.inference_mode():
        reference = decoder(torch.tensor([PROMPTS[2]]))[0].numpy()
    model.backend.reserve(64)
    assert np.abs(model.backend.forward(PROMPTS[2], 0) - reference).max() < 1e-4

    torch_model = load(build(options(tiny_model_dir("llama"), tmp_path / "torch", ("torch",)), log=lambda m: None))
    drafted = 0
    for prompt in PROMPTS:
        canonical = torch_model.generate(prompt, max_new_tokens=24, speculate=False)
        plain = model.generate(prompt, max_new_tokens=24, speculate=False)
        same_or_near_tie(decoder, prompt, canonical.token_ids, plain.token_ids)
        for name in model.manifest.plans:
            spec = model.generate(prompt, max_new_tokens=24, plan=name)
            same_or_near_tie(decoder, prompt, plain.token_ids, spec.token_ids)
            drafted += spec.stats.drafted
    assert drafted > 0, "the plans never drafted: the comparison would not test speculation"


def test_a_backend_without_its_registry_line_is_refused_in_one_line(
    demo_backend, tiny_model_dir, tmp_path, monkeypatch
):
    out = build(options(tiny_model_dir("llama"), tmp_path / "art"), log=lambda message: None)
    monkeypatch.delitem(BACKENDS, "demo")
    with pytest.raises(SpeccompileError, match="backend 'demo' is not supported by this runtime") as found:
        load(out)
    assert "\n" not in str(found.value)
    with pytest.raises(SpeccompileError, match="unknown --backend 'demo'"):
        build(options(tiny_model_dir("llama"), tmp_path / "again"), log=lambda message: None)
