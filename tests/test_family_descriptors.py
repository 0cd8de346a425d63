"""Model families as data: each family is one descriptor (``speccompile/families``) found by ``model_type``.
A family written outside speccompile (``tests/demo_family.py``, one module plus one registry line) converts,
builds and decodes like the transformers model's own greedy decoding, with no other file touched; every
registered descriptor handles exactly the model types it claims; unknown types are refused in one line."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from tiny_models import CONFIGS, make_tokenizer
from tiny_models import FAMILIES as TINY_FAMILIES
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from speccompile.build import BuildOptions, build
from speccompile.convert import UnsupportedModelError, arch_config, check_supported, choose_path, layout_for
from speccompile.families import FAMILIES, Family, Layout, family_for
from speccompile.runtime import load

PROMPTS = [[1, 40, 41, 42, 43, 40, 41, 42], [1, 100, 7, 250, 31], [1] + list(range(60, 80))]


class DemoLlamaConfig(LlamaConfig):
    model_type = "demo_llama"


class DemoLlamaForCausalLM(LlamaForCausalLM):
    """Stands in for a transformers model speccompile has no descriptor for."""

    config_class = DemoLlamaConfig


@pytest.fixture(scope="module")
def demo_model_dir(tmp_path_factory):
    """A saved tiny ``demo_llama`` (with tokenizer). Registering with transformers is process-wide and harmless:
    the type exists nowhere else."""
    AutoConfig.register("demo_llama", DemoLlamaConfig)
    AutoModelForCausalLM.register(DemoLlamaConfig, DemoLlamaForCausalLM)
    torch.manual_seed(0)
    model = DemoLlamaForCausalLM(DemoLlamaConfig(**CONFIGS["llama"])).eval()
    folder = tmp_path_factory.mktemp("demo_family") / "demo_llama"
    model.save_pretrained(folder, safe_serialization=True)
    make_tokenizer(folder)
    return folder


@pytest.fixture
def demo_family(monkeypatch):
    """The demonstration family, registered the way a new family is: one line in ``FAMILIES``."""
    monkeypatch.setitem(FAMILIES, "demo_llama", "demo_family:DemoLlama")


def test_a_family_without_a_descriptor_is_not_converted(demo_model_dir):
    model = AutoModelForCausalLM.from_pretrained(demo_model_dir, attn_implementation="eager").eval()
    path = choose_path(model)
    assert path.path == "generic" and "no canonical conversion for 'demo_llama'" in path.why


def test_a_family_added_outside_speccompile_builds_and_decodes_like_transformers(demo_model_dir, demo_family, tmp_path):
    hf = AutoModelForCausalLM.from_pretrained(demo_model_dir, attn_implementation="eager").eval()
    assert choose_path(hf).path == "canonical"
    assert arch_config(hf).model_type == "demo_llama"
    logs: list[str] = []
    out = build(
        BuildOptions(
            model=str(demo_model_dir),
            out=tmp_path / "art",
            method="cosine",
            max_draft=4,
            calibration_tokens=16,
            confirm_prompts=2,
            confirm_tokens=16,
            show_progress=False,
        ),
        log=logs.append,
    )
    assert any(line.startswith("decoder path: canonical") for line in logs), logs
    model = load(out)
    assert model.manifest.config.model_type == "demo_llama" and model.manifest.plans
    drafted = 0
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        reference = hf.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
        expected = reference[0, len(prompt) :].tolist()
        plain = model.generate(prompt, max_new_tokens=24, speculate=False).token_ids
        assert plain and plain == expected[: len(plain)]
        for name in model.manifest.plans:
            result = model.generate(prompt, max_new_tokens=24, plan=name)
            assert result.token_ids == plain, name
            drafted += result.stats.drafted
    assert drafted > 0, "the plans never drafted: the comparison would not test speculation"


def test_every_family_handles_exactly_the_model_types_it_claims():
    classes = {model_type: FAMILIES.load(model_type) for model_type in FAMILIES}
    for model_type, cls in classes.items():
        assert issubclass(cls, Family) and model_type in cls.model_types, (model_type, cls.__name__)
    for cls in set(classes.values()):
        registered = {model_type for model_type, other in classes.items() if other is cls}
        assert set(cls.model_types) == registered, cls.__name__
    # every family has a tiny model, so the parity, losslessness and export tests cover it
    assert set(FAMILIES) == set(TINY_FAMILIES)
    for model_type in FAMILIES:
        config = AutoConfig.for_model(model_type, **CONFIGS[model_type])
        assert isinstance(family_for(model_type).layout(config), Layout)


@pytest.mark.parametrize("model_type", ["bloom", "demo_llama", "not_a_model"])
def test_unknown_model_types_are_refused_in_one_line(model_type):
    message = rf"architecture '{model_type}' is not supported; supported model types: llama, mistral, .*falcon"
    model = SimpleNamespace(config=SimpleNamespace(model_type=model_type))
    for call in (
        lambda: check_supported(model_type),
        lambda: family_for(model_type),
        lambda: layout_for(model.config),
        lambda: arch_config(model),
    ):
        with pytest.raises(UnsupportedModelError, match=message) as exc:
            call()
        assert "\n" not in str(exc.value)
