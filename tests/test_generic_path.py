"""The generic torch path (runtime/backends/torch/hf_decoder.py): families without a canonical conversion run through
their own transformers modules, losslessly, from the decoder up to a built artifact."""

import json

import numpy as np
import pytest
import torch
from lossless import assert_same_greedy, exact_marginals, next_token_logits, run, sample_third_tokens
from lossless import chi_square_pvalue as gof
from tiny_models import GENERIC_FAMILIES, make_model

from speccompile.build import BuildOptions, build
from speccompile.convert import UnsupportedModelError, choose_path
from speccompile.runtime.artifact.manifest import DraftPlan
from speccompile.runtime.backends.torch.backend import TorchBackend
from speccompile.runtime.errors import SpeccompileError
from speccompile.runtime.sampling import SamplingParams

PROMPTS = [[1, 40, 41, 42, 43, 40, 41, 42], [1, 100, 7, 250, 31], [1] + list(range(60, 90))]
PLANS = [
    DraftPlan.of(name="early-exit", exit_layer=2, sources={"model": {"max_draft": 4}}),
    DraftPlan.of(
        name="block-skip", skip_attn=[1, 2], skip_mlp=[1, 2], sources={"model": {"max_draft": 3, "threshold": 0.3}}
    ),
    DraftPlan.of(name="ngram", lookup=["ngram"], lookup_max_draft=6, sources={"ngram": {"min": 1, "max": 3}}),
    DraftPlan.of(
        name="hybrid",
        exit_layer=2,
        lookup=["ngram"],
        lookup_max_draft=5,
        sources={"model": {"max_draft": 3}, "ngram": {"min": 2, "max": 3}},
    ),
]


@pytest.fixture(scope="module")
def generic_model(tmp_path_factory):
    """family -> (transformers model, its generic decoder)."""
    from transformers import AutoModelForCausalLM

    made = {}

    def get(family):
        if family not in made:
            folder = make_model(family, tmp_path_factory.mktemp("generic") / family)
            model = AutoModelForCausalLM.from_pretrained(folder).eval()
            path = choose_path(model)
            assert path.path == "generic", path.why
            made[family] = (model, path.decoder, folder)
        return made[family]

    return get


@pytest.mark.parametrize("family", GENERIC_FAMILIES)
def test_generic_logits_match_transformers(generic_model, family):
    model, decoder, _ = generic_model(family)
    ids = torch.randint(3, 300, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        reference = model(ids).logits
        assert float((decoder(ids) - reference).abs().max()) <= 1e-4
        # Pieces compose to the whole: blocks 0..1, then 2..L-1 from the kept hidden state, then the head.
        h = decoder.run_blocks(decoder.embed_tokens(ids, 0), 0, None, 0, 2)
        pieces = decoder.head(decoder.run_blocks(h, 0, None, 2))
        assert float((pieces - reference).abs().max()) <= 1e-4


@pytest.mark.parametrize("family", GENERIC_FAMILIES)
def test_generic_speculative_greedy_equals_plain(generic_model, family):
    _, decoder, _ = generic_model(family)
    backend = TorchBackend(decoder)
    ties = 0
    for prompt in PROMPTS:
        plain, _ = run(backend, prompt, 40)
        for plan in PLANS:
            spec, stats = run(backend, prompt, 40, plan)
            ties += assert_same_greedy(decoder, prompt, plain, spec)
            assert stats.rounds > 0
    assert ties <= 1


def test_generic_paths_drafts_accept_tokens(generic_model):
    """The model's early exit and the lookup both get tokens accepted (the plans do draft, not just verify)."""
    _, decoder, _ = generic_model("olmo")
    backend = TorchBackend(decoder)
    _, exit_stats = run(backend, PROMPTS[2], 40, PLANS[0])
    _, lookup_stats = run(backend, PROMPTS[0], 40, PLANS[2])
    assert exit_stats.drafted > 0 and lookup_stats.accepted > 0


def test_dynamic_cache_family_drafts_without_prefix_reuse(generic_model):
    """BLOOM sizes its mask from the cache length: it gets a cut-back dynamic cache and its verifier
    recomputes the prefix blocks (still lossless: see the greedy test)."""
    _, decoder, _ = generic_model("bloom")
    assert decoder.cache_kind == "dynamic" and not decoder.prefix_reuse
    _, decoder, _ = generic_model("olmo")
    assert decoder.cache_kind == "static" and decoder.prefix_reuse


def test_generic_whole_block_plans_only(generic_model):
    _, decoder, _ = generic_model("olmo")
    with pytest.raises(SpeccompileError, match="whole blocks"):
        decoder.run_blocks(decoder.embed_tokens(torch.tensor([[1, 2]]), 0), 0, None, skip_attn={1}, skip_mlp=set())


VOCAB = 12
SAMPLES = 1000


@pytest.mark.parametrize("family", ["olmo", "stablelm", "gemma2", "starcoder2", "bloom"])
def test_generic_speculative_sampling_matches_target(family, tmp_path):
    from transformers import AutoModelForCausalLM

    folder = make_model(family, tmp_path / family, seed=4, vocab_size=VOCAB, initializer_range=0.15)
    decoder = choose_path(AutoModelForCausalLM.from_pretrained(folder).eval()).decoder
    backend = TorchBackend(decoder)
    # Every block but the first skipped: a draft far enough from the target for the negative control.
    plan = DraftPlan.of(
        name="skip", skip_attn=[1, 2, 3], skip_mlp=[1, 2, 3], sources={"model": {"max_draft": 2, "adaptive": False}}
    )
    params, prompt = SamplingParams(temperature=1.0), [1, 5, 7, 3]
    _, target3 = exact_marginals(next_token_logits(decoder), params, prompt, VOCAB)
    _, draft3 = exact_marginals(next_token_logits(decoder, plan), params, prompt, VOCAB)
    assert 0.5 * np.abs(target3 - draft3).sum() > 0.1, "draft too close to the target for the control to mean anything"
    spec3, accepted = sample_third_tokens(backend, prompt, plan, params, SAMPLES)
    assert 0 < accepted < 2 * SAMPLES
    assert gof(spec3, target3) > 1e-3
    assert gof(spec3, draft3) < 1e-3  # negative control


@pytest.mark.parametrize("family", GENERIC_FAMILIES)
def test_the_geometry_read_from_config_json_is_what_the_loaded_decoder_reports(generic_model, family):
    """inspect checks a generic artifact's manifest against its model's config.json without loading the weights;
    that must agree with the loaded decoder everywhere, or a good artifact would be refused."""
    from speccompile.runtime.backends.torch.hf_decoder import folder_geometry
    from speccompile.runtime.backends.weights_check import GEOMETRY

    _, decoder, folder = generic_model(family)
    stated = folder_geometry(folder)
    assert {name: getattr(decoder.config, name) for name in GEOMETRY if stated[name] is not None} == {
        name: value for name, value in stated.items() if value is not None
    }
    assert stated["num_layers"] is not None and stated["hidden_size"] is not None


def test_generic_build_writes_a_torch_artifact_that_generates_losslessly(generic_model, tmp_path):
    from speccompile.runtime import load

    _, _, folder = generic_model("olmo")
    out = tmp_path / "art"
    build(
        BuildOptions(
            model=str(folder),
            out=out,
            method="early-exit",
            max_draft=4,
            calibration_tokens=12,
            confirm_prompts=1,
            confirm_tokens=8,
            show_progress=False,
        ),
        log=lambda message: None,
    )
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["config"]["decoder"] == "generic"
    assert manifest["tuning"]["decoder_path"]["path"] == "generic"
    assert (out / "weights" / "config.json").is_file() and "early-exit" in manifest["plans"]
    model = load(out)
    plain = model.generate("def add(a, b):", max_new_tokens=24, speculate=False)
    spec = model.generate("def add(a, b):", max_new_tokens=24, plan="early-exit")
    assert spec.token_ids == plain.token_ids


def test_generic_build_refuses_what_it_cannot_do(generic_model, tmp_path):
    _, _, folder = generic_model("olmo")
    with pytest.raises(SpeccompileError, match="generic torch path.*use --backend torch"):
        build(
            BuildOptions(model=str(folder), out=tmp_path / "a", backends=("torch", "onnx"), show_progress=False),
            log=lambda message: None,
        )
    with pytest.raises(SpeccompileError, match="--method adapter needs a canonical family"):
        build(
            BuildOptions(model=str(folder), out=tmp_path / "b", method="adapter", show_progress=False),
            log=lambda message: None,
        )
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_recurrent_model_is_refused_with_its_reason():
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("mamba", hidden_size=32, num_hidden_layers=2, vocab_size=64, state_size=4)
    with pytest.raises(UnsupportedModelError, match="recurrent or state-space layers.*cannot be drafted losslessly"):
        choose_path(AutoModelForCausalLM.from_config(config))


def test_length_dependent_rope_scaling_is_refused_before_loading(tmp_path):
    folder = make_model("olmo", tmp_path / "olmo")
    config = json.loads((folder / "config.json").read_text())
    config["rope_scaling"] = {"type": "dynamic", "factor": 2.0}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(SpeccompileError, match="rope scaling 'dynamic' changes the rotary frequencies.*static type"):
        build(BuildOptions(model=str(folder), out=tmp_path / "art", show_progress=False), log=lambda message: None)
