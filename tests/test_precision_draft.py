"""Precision self-drafts (``runtime/drafting/kinds/precision.py``): the model's own graph with weight-only int8 /
int4 products drafts, the full-precision model verifies.

- on ONNX Runtime's fused graphs, greedy speculative == plain on every canonical family, for the whole
  model, an int4 early exit, an int8 layer skip and an int8 draft behind n-gram lookup, and the drafts are accepted (a tiny random model's int8 draft
  agrees with it most of the time);
- the quantized weights go into the same ``weights.bin`` once, next to the full ones, and only the draft
  graph reads them;
- on torch, an int8 draft runs through the decoder's int8 twin (``runtime/backends/torch/int8_twin.py``): greedy
  speculative == plain on every canonical family for the whole model, an int8 early exit, an int8 layer skip
  and a hybrid behind n-gram lookup; the twin shares every tensor but its products' weights; sampling keeps
  the full model's distribution (chi-square, with a negative control);
- where no kernel runs the scheme (int4 on torch; the standard ONNX graphs) the plan is refused in one line
  before any work, and bad options are refused when the plan is validated.
"""

from __future__ import annotations

import pytest
import torch

from speccompile.runtime.drafting import check_plan

pytest.importorskip("onnxruntime")

from lossless import assert_speculative_is_plain, run  # noqa: E402
from onnx_helpers import make_artifact, ort_backend  # noqa: E402
from tiny_models import FAMILIES  # noqa: E402

from speccompile.runtime.artifact.manifest import DraftPlan, read_manifest  # noqa: E402
from speccompile.runtime.backends.torch.backend import TorchBackend  # noqa: E402
from speccompile.runtime.drafting import read_plans  # noqa: E402
from speccompile.runtime.errors import ArtifactError  # noqa: E402


def precision_plans(num_layers: int) -> dict[str, DraftPlan]:
    plans = [
        DraftPlan.of(
            name="int8",
            kind="precision",
            params={"precision": "int8"},
            sources={"model": {"max_draft": 4, "threshold": 0.0}},
        ),
        DraftPlan.of(
            name="int4-b16s",
            kind="precision",
            params={"precision": "int4", "block_size": 16, "symmetric": True},
            sources={"model": {"max_draft": 3, "threshold": 0.0}},
        ),
        DraftPlan.of(
            name="int4-exit",
            kind="precision",
            params={"precision": "int4"},
            exit_layer=num_layers - 1,
            sources={"model": {"max_draft": 3, "threshold": 0.0}},
        ),
        DraftPlan.of(
            name="int8-skip",
            kind="precision",
            params={"precision": "int8"},
            skip_mlp=[1],
            sources={"model": {"max_draft": 3, "threshold": 0.0}},
        ),
        DraftPlan.of(
            name="int8+lookup",
            kind="precision",
            params={"precision": "int8", "block_size": 16},
            lookup=["ngram"],
            lookup_max_draft=4,
            sources={"model": {"max_draft": 4}, "ngram": {"min": 1, "max": 3}},
        ),
    ]
    return {p.name: p for p in plans}


def prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(4)
    return [torch.randint(3, vocab, (4 + 9 * i,), generator=gen).tolist() for i in range(3)]


@pytest.mark.parametrize("family", FAMILIES)
def test_precision_drafts_are_lossless_on_onnx_runtime(tiny_decoder, tmp_path, family):
    _, decoder = tiny_decoder(family)
    plans = precision_plans(decoder.config.num_layers)
    root = make_artifact(decoder, plans, tmp_path / family, variant="fused")
    backend = ort_backend(root)
    backend.check_plans(read_plans(plans, backend.config.num_layers))
    assert_speculative_is_plain(backend, decoder, prompts(decoder.config.vocab_size), plans, 24)
    plain, _ = run(backend, prompts(decoder.config.vocab_size)[0], 24)
    _, stats = run(backend, prompts(decoder.config.vocab_size)[0], 24, plans["int8"])
    assert stats.accepted / max(stats.drafted, 1) > 0.5  # an int8 copy of the model agrees with it most of the time


def test_quantized_weights_are_stored_once_and_read_only_by_the_draft(tiny_decoder, tmp_path):
    _, decoder = tiny_decoder("llama")
    plans = {
        "int4": DraftPlan.of(
            name="int4", kind="precision", params={"precision": "int4"}, sources={"model": {"max_draft": 3}}
        )
    }
    record = read_manifest(make_artifact(decoder, plans, tmp_path / "a", variant="fused")).backends["onnx"]
    assert record["graphs"]["draft.int4"]["segment"] == {
        "start": 0,
        "stop": decoder.config.num_layers,
        "precision": "int4",
    }
    quantized = {n for n in record["tensors"] if ".int4" in n}
    assert quantized and quantized <= set(record["graphs"]["draft.int4"]["initializers"])
    assert not quantized & set(record["graphs"]["verify"]["initializers"])
    assert record["plans"]["int4"] == {"kind": "precision", "graphs": ["draft.int4"]}
    stored = {record["tensors"][n]["offset"]: record["tensors"][n]["nbytes"] for n in quantized}
    assert record["precision_draft_bytes"] == sum(stored.values()) > 0  # what inspect reports as the draft's bytes


def torch_plans(num_layers: int) -> dict[str, DraftPlan]:
    int8 = {"precision": "int8"}
    plans = [
        DraftPlan.of(name="int8", kind="precision", params=int8, sources={"model": {"max_draft": 4, "threshold": 0.0}}),
        DraftPlan.of(
            name="int8-b128s",
            kind="precision",
            params={**int8, "block_size": 128, "symmetric": True},
            sources={"model": {"max_draft": 6, "adaptive": False}},
        ),
        DraftPlan.of(
            name="int8-exit",
            kind="precision",
            params=int8,
            exit_layer=num_layers - 1,
            sources={"model": {"max_draft": 3}},
        ),
        DraftPlan.of(
            name="int8-skip",
            kind="precision",
            params=int8,
            skip_mlp=[1],
            sources={"model": {"max_draft": 3, "threshold": 0.0}},
        ),
        DraftPlan.of(
            name="int8+lookup",
            kind="precision",
            params=int8,
            lookup=["ngram"],
            lookup_max_draft=4,
            sources={"model": {"max_draft": 4}, "ngram": {"min": 1, "max": 3}},
        ),
    ]
    return {p.name: p for p in plans}


@pytest.mark.parametrize("smoothed", [False, True], ids=["plain-twin", "smoothed-twin"])
@pytest.mark.parametrize("family", FAMILIES)
def test_int8_precision_drafts_are_lossless_on_torch(tiny_decoder, family, smoothed):
    """Greedy speculative == plain with the int8 twin, without and with SmoothQuant scales (measured on the
    prompts, as a build measures them on its calibration text: folded norms, int8 down projections)."""
    from speccompile.passes.precision_estimate import int8_input_scales
    from speccompile.runtime.backends.torch.int8_twin import set_input_scales

    _, decoder = tiny_decoder(family)
    backend = TorchBackend(decoder)
    plans = torch_plans(decoder.config.num_layers)
    backend.check_plans(read_plans(plans, backend.config.num_layers))
    if smoothed:
        set_input_scales(
            decoder, int8_input_scales(decoder, [torch.tensor([p]) for p in prompts(decoder.config.vocab_size)])
        )
    try:
        assert_speculative_is_plain(backend, decoder, prompts(decoder.config.vocab_size), plans, 24)
        _, stats = run(backend, prompts(decoder.config.vocab_size)[0], 24, plans["int8-b128s"])
    finally:
        set_input_scales(decoder, None)  # the decoder is shared by the session's other tests
    assert stats.accepted / max(stats.drafted, 1) > 0.5, stats  # the int8 twin agrees with the model most of the time


def test_the_int8_twin_shares_every_tensor_but_the_products(tiny_decoder):
    from speccompile.runtime.backends.torch.int8_twin import DynamicInt8Linear, int8_twin

    _, decoder = tiny_decoder("llama")
    TorchBackend(decoder)  # packs q/k/v and gate/up on CPU, as a backend runs the decoder
    twin = int8_twin(decoder)
    ours = {id(t) for t in list(decoder.parameters()) + list(decoder.buffers())}
    assert {id(t) for t in list(twin.parameters()) + list(twin.buffers())} <= ours  # norms, embeddings, rotary
    # the only float products left are the parts of packed products, which the packed int8 product replaces
    parts = {
        id(p) for m in twin.modules() for key in ("_qkv", "_gate_up") if key in m.__dict__ for p in m.__dict__[key][2]
    }
    assert parts and all(id(m) in parts for m in twin.modules() if isinstance(m, torch.nn.Linear))
    assert twin.layers[0].attn.__dict__["_qkv"][0].__class__ is DynamicInt8Linear  # the packed product too
    assert any(isinstance(m, torch.nn.Linear) for m in decoder.modules())  # the model itself is untouched
    ids = torch.tensor([prompts(decoder.config.vocab_size)[1]])
    with torch.inference_mode():
        full, draft = decoder(ids), twin(ids)
    assert not torch.equal(full, draft)
    assert (full.argmax(-1) == draft.argmax(-1)).float().mean() > 0.8


@pytest.mark.parametrize("family", FAMILIES)
def test_the_twin_s_smoothing_folds_exactly(tiny_decoder, family):
    """SmoothQuant scales are folded into the twin's own norms (or up rows) and its products' weight columns: with
    float products the folded twin computes the model's function, whatever the scales; the model is untouched."""
    from speccompile.passes.precision_estimate import int8_input_scales
    from speccompile.runtime.backends.torch.int8_twin import fold_points, twin_with

    _, decoder = tiny_decoder(family)
    TorchBackend(decoder)  # packed q/k/v and gate/up, as the backend runs them
    points = fold_points(decoder)
    assert "head" in points and any(name.endswith(".attn") for name in points) == (
        decoder.layers[0].attn_norm is not None
    )
    generator = torch.Generator().manual_seed(0)
    scales = {
        name: torch.rand(readers[0].in_features, generator=generator) * 4 + 0.25
        for name, (_, readers, _) in points.items()
    }

    def float_product(linear, down):
        copy = torch.nn.Linear(linear.in_features, linear.out_features, bias=linear.bias is not None)
        copy.weight.data, copy.bias = linear.weight.detach().clone(), None if linear.bias is None else linear.bias
        return copy

    norms = {name: points[name][0].weight.detach().clone() for name in points if points[name][0] is not None}
    twin = twin_with(decoder, float_product, scales)
    ids = torch.tensor([prompts(decoder.config.vocab_size)[1]])
    with torch.inference_mode():
        full, folded = decoder(ids), twin(ids)
    torch.testing.assert_close(folded, full, rtol=1e-4, atol=1e-4 * full.abs().max().item())
    assert all(torch.equal(points[name][0].weight, w) for name, w in norms.items())  # the model's norms stay
    measured = int8_input_scales(decoder, [ids])
    assert set(measured) == set(points) and all(
        bool(torch.isfinite(s).all() and (s > 0).all()) for s in measured.values()
    )


def test_int8_precision_sampling_keeps_the_target_distribution(tmp_path_factory):
    """The draft's q is its own softmax (int8 products and two skipped blocks, so that it differs from the
    target); the rejection rule keeps the full model's distribution. Negative control: the samples are not
    distributed like the draft."""
    import numpy as np
    from lossless import chi_square_pvalue, exact_marginals, next_token_logits
    from tiny_models import make_model
    from transformers import AutoModelForCausalLM

    from speccompile.convert import arch_config, canonical_weights
    from speccompile.runtime.backends.torch.decoder import build_decoder
    from speccompile.runtime.backends.torch.int8_twin import int8_twin
    from speccompile.runtime.sampling import SamplingParams

    vocab, prompt, samples, alpha = 12, [1, 5, 7, 3], 2000, 1e-3
    folder = make_model(
        "llama", tmp_path_factory.mktemp("int8_sampling"), seed=4, vocab_size=vocab, initializer_range=0.15
    )
    hf = AutoModelForCausalLM.from_pretrained(folder).eval()
    decoder = build_decoder(arch_config(hf), canonical_weights(hf, arch_config(hf)))
    backend = TorchBackend(decoder)
    plan = DraftPlan.of(
        name="int8-skip",
        kind="precision",
        params={"precision": "int8"},
        skip_attn=[1, 2],
        skip_mlp=[1, 2],
        sources={"model": {"max_draft": 2, "adaptive": False}},
    )
    params = SamplingParams(temperature=1.0)
    target2, target3 = exact_marginals(next_token_logits(decoder), params, prompt, vocab)
    _, draft3 = exact_marginals(next_token_logits(int8_twin(decoder), plan), params, prompt, vocab)
    assert 0.5 * np.abs(target3 - draft3).sum() > 0.1, "draft too close to the target for the control to mean anything"
    second, third, accepted = [], [], 0
    for seed in range(samples):
        tokens, stats = run(backend, prompt, 3, plan, params, seed=seed)
        second.append(tokens[1])
        third.append(tokens[2])
        accepted += stats.accepted
    assert 0 < accepted < 2 * samples
    assert chi_square_pvalue(second, target2) > alpha
    assert chi_square_pvalue(third, target3) > alpha
    assert chi_square_pvalue(third, draft3) < alpha


def test_precision_drafts_are_refused_in_one_line_where_nothing_runs_them(tiny_decoder, tmp_path):
    _, decoder = tiny_decoder("llama")
    plan = DraftPlan.of(
        name="int4", kind="precision", params={"precision": "int4"}, sources={"model": {"max_draft": 3}}
    )
    with pytest.raises(ArtifactError) as torch_refusal:
        TorchBackend(decoder).check_plans(read_plans({"int4": plan}, decoder.config.num_layers))
    standard = make_artifact(decoder, {"int4": plan}, tmp_path / "std")  # standard graphs: no MatMulNBits draft
    with pytest.raises(ArtifactError) as onnx_refusal:
        ort_backend(standard)  # refused when the artifact is opened
    for exc in (torch_refusal, onnx_refusal):
        assert "int4" in str(exc.value) and "\n" not in str(exc.value)
    assert "ONNX Runtime only" in str(torch_refusal.value) and "int8" in str(torch_refusal.value)
    assert "no graph" in str(onnx_refusal.value)
    for params, needle in (({"precision": "int3"}, "int3"), ({"precision": "int4", "block_size": 24}, "block_size")):
        with pytest.raises(ArtifactError, match=needle):
            check_plan(DraftPlan.of(name="bad", kind="precision", params=params), decoder.config.num_layers)


@pytest.mark.parametrize("backend", ["torch", "onnx"])
def test_precision_build_prices_in_rounds_scores_in_the_real_loop_and_stays_lossless(backend, tiny_model_dir, tmp_path):
    """``--method precision``: the draft's step and the verify after it are timed in rounds on the backend and
    priced into the plan's estimate (the manifest keeps them, next to the parallel pass's estimate); the
    artifact's precision plan decodes exactly what plain decoding does."""
    from speccompile.build import BuildOptions, build
    from speccompile.passes.cost_model import segment_key
    from speccompile.runtime.drafting.kinds import kind_of
    from speccompile.runtime.model import load

    out = build(
        BuildOptions(
            model=str(tiny_model_dir("llama")),
            out=tmp_path / "p",
            method="precision",
            backends=(backend,),
            max_draft=4,
            calibration_tokens=16,
            confirm_prompts=2,
            confirm_tokens=16,
            show_progress=False,
        ),
        log=lambda message: None,
    )
    model = load(out)
    plan = model.manifest.plans["precision"]
    assert plan.kind == "precision" and plan.measured["method"] == "precision"
    schemes = {"torch": {"int8"}, "onnx": {"int8", "int4"}}[backend]
    assert set(plan.measured["draft_costs"]) == schemes and plan.params["precision"] in schemes
    assert all(c["draft_step_ms"] > 0 and c["verify_after_draft"] >= 1 for c in plan.measured["draft_costs"].values())
    assert plan.measured["expected_speedup"] > 0 and "parallel_estimate" in plan.measured
    if backend == "torch":  # the twin's SmoothQuant scales ship in the artifact and reach the runtime's twin
        from speccompile.runtime.backends.torch.int8_twin import SCALES_FILE

        assert (
            model.manifest.backends["torch"]["int8_scales_file"] == SCALES_FILE and SCALES_FILE in model.manifest.files
        )
        assert "head" in model.backend.decoder.int8_input_scales
        from speccompile.runtime.backends.torch.int8_twin import _TWINS

        assert model.backend.decoder in _TWINS  # made at load, not inside the first request's decode
        from cli_helpers import invoke

        assert f"SmoothQuant scales: {SCALES_FILE}" in invoke("inspect", out, check=True).output
        from speccompile.build import TuneOptions, tune

        shipped = (out / SCALES_FILE).read_bytes()
        tune(
            TuneOptions(
                artifact=out,
                method="lookup",
                max_draft=4,
                calibration_tokens=16,
                confirm_prompts=2,
                confirm_tokens=16,
                show_progress=False,
            ),
            log=lambda message: None,
        )
        retuned = load(out)  # a retuned artifact keeps the scales its precision plan was tuned with
        assert (out / SCALES_FILE).read_bytes() == shipped and "precision" in retuned.manifest.plans
        assert retuned.manifest.backends["torch"]["int8_scales_file"] == SCALES_FILE
    step_costs = model.manifest.tuning["step_costs"]
    key = segment_key(kind_of(plan, model.manifest.config.num_layers).draft_segment)
    assert step_costs["draft_steps"][key] > 0  # what the estimate priced the draft step with
    # the other composition (alone, or behind the lookup plan) is kept beside it, for confirmation to race
    others = {name: p for name, p in model.manifest.plans.items() if name in ("precision-alone", "precision-hybrid")}
    assert len(others) == ("lookup" in model.manifest.plans)
    for name, other in others.items():
        assert other.kind == "precision" and bool(other.lookup) == (name == "precision-hybrid") != bool(plan.lookup)
        assert other.measured["expected_speedup"] <= plan.measured["expected_speedup"]
    prompt = model.tokenizer.encode("def read_lines(path):")
    plain = model.generate(prompt, max_new_tokens=24, speculate=False).token_ids
    for name in ("precision", *others):
        assert model.generate(prompt, max_new_tokens=24, plan=name).token_ids == plain


def test_an_onnx_artifact_with_a_precision_draft_reexports(tiny_decoder, tmp_path):
    """The canonical weights read back from an ONNX-only artifact (what ``tune`` and the benchmarks re-export
    from) leave out the draft's quantized copies: re-exporting them used to feed the old uint8 tensors to the
    new draft graph as floats."""
    from speccompile.artifact_writer import read_canonical_weights
    from speccompile.exporters.onnx_export import export_onnx_weights, export_options
    from speccompile.runtime.backends.onnx import OnnxBackend

    _, decoder = tiny_decoder("llama")
    plans = {
        "int8": DraftPlan.of(
            name="int8", kind="precision", params={"precision": "int8"}, sources={"model": {"max_draft": 3}}
        )
    }
    root = make_artifact(decoder, plans, tmp_path / "a", variant="fused")
    manifest = read_manifest(root)
    weights = read_canonical_weights(root, manifest)
    assert weights and not [name for name in weights if ".int8" in name]
    out = tmp_path / "b"
    record = export_onnx_weights(
        manifest.config, weights, plans, out / "onnx", relative_to=out, **export_options(manifest.backends["onnx"])
    )
    backend = OnnxBackend(out, record, manifest.config, plans=plans)
    prompt = prompts(decoder.config.vocab_size)[1]
    assert run(backend, prompt, 12, plans["int8"])[0] == run(backend, prompt, 12)[0]


def test_the_precision_pass_bound_is_zero_where_the_int8_twin_cannot_run(tiny_decoder, monkeypatch):
    """The bound runs the int8 twin on torch: where it cannot (a GPU decoder, a torch without the kernel) the pass
    is skipped by its bound instead of failing the build."""
    import numpy as np

    import speccompile.passes.precision_tune as precision_tune
    from speccompile.passes.ir import DecoderIR
    from speccompile.passes.tuning import TuningContext

    _, decoder = tiny_decoder("llama")
    ir = DecoderIR(decoder.config, {})
    ir.attach_decoder(decoder)
    rng = np.random.default_rng(0)
    context = TuningContext.prepare(
        ir, [rng.integers(3, decoder.config.vocab_size, 8).tolist() for _ in range(4)], 12, 4, show_progress=False
    )
    tune = precision_tune.PrecisionTune(context, show_progress=False, quick=True)
    assert tune.bound(ir) > 0.0
    monkeypatch.setattr(precision_tune, "int8_kernel_missing", lambda: "no dynamic-int8 kernel")
    assert tune.bound(ir) == 0.0
