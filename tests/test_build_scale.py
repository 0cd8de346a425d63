"""Builds at the sizes users start with: a wall-clock budget capped by the model's size that sizes calibration,
timings and confirmation; bounds that measure only the signals that can change a decision; a build that holds
the weights once (conversion, decoder, ONNX export and tuning sessions on the same memory, quantized copies made
once) and reports its peak resident memory.

Decision rules are tested with injected clocks; memory by where tensors live (``data_ptr``), not by timing or
resident-set figures (``benchmarks/scale.py`` measures those at real shapes)."""

from __future__ import annotations

import json
import mmap
import sys
import time

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from speccompile.cli import main
from speccompile.passes.acceptance_estimate import MIN_CONTINUATION, MIN_CONTINUATIONS, greedy_continuations
from speccompile.passes.budget import (
    ADAPTER_GAIN,
    CAP_BASE_SECONDS,
    MIN_SECONDS,
    Budget,
    cap_seconds,
    default_seconds,
)
from speccompile.passes.confirm import Confirmer
from speccompile.passes.ir import DecoderIR
from speccompile.runtime.artifact.manifest import DraftPlan
from speccompile.runtime.decoding.speculative import Stats
from speccompile.runtime.drafting import read_plan

# -- the budget ----------------------------------------------------------------------------------------------


def test_the_default_budget_is_the_step_budget_capped_by_the_models_size():
    smol, qwen, llama = cap_seconds(134.5e6), cap_seconds(596e6), cap_seconds(1236e6)
    assert 80 <= smol <= 90 and 150 <= qwen <= 240 and 240 <= llama <= 420  # about 90 s, a few minutes for 1B
    assert default_seconds(1.0, 134.5e6) == smol  # a slow machine: the cap, not 2500 slow steps
    assert default_seconds(0.01, 134.5e6) == 25.0 < smol  # a fast one builds in less
    assert default_seconds(0.001, 134.5e6) == MIN_SECONDS and cap_seconds(0) >= CAP_BASE_SECONDS


def test_calibration_is_sized_by_the_planned_budget_before_the_total_is_known():
    clock = type("Clock", (), {"now": 0.0, "__call__": lambda self: self.now})()
    budget = Budget(clock=clock)
    budget.cap = 100.0
    assert budget.planned() == 100.0 and budget.share(0.2) == 20.0 and budget.progress() == "100s of 100s left"
    clock.now = 30.0
    budget.total = 80.0  # the step budget, once timed, below the cap
    assert budget.planned() == 80.0 and budget.progress() == "50s of 80s left"
    assert Budget().share(0.2) is None  # no budget (a --method NAME build): nothing sized


def test_calibration_continuations_stop_at_their_deadline(tiny_decoder):
    """Past the deadline a batch stops growing (at MIN_CONTINUATION tokens) and no further batch starts (at least
    MIN_CONTINUATIONS prompts continued): fewer, shorter continuations where the model is too big for the budget."""
    _, decoder = tiny_decoder("llama")
    prompts = [[1, 5 + i, 9, 40 + i] for i in range(6)]
    full = greedy_continuations(decoder, prompts, 40, batch=2)
    cut = greedy_continuations(decoder, prompts, 40, batch=2, deadline=time.perf_counter())
    assert len(full) == 6 and all(len(c) == 40 for c in full)
    assert len(cut) == MIN_CONTINUATIONS == 2 and all(len(c) == MIN_CONTINUATION for c in cut)
    assert cut == [c[:MIN_CONTINUATION] for c in full[:2]]  # the same greedy tokens, fewer of them


def test_a_confirmation_turn_starts_only_if_it_ends_by_the_deadline():
    """Past the least turns, a turn as long as the turns so far must end by the deadline: a build is never over
    its budget by a turn (each decode takes one second of the test's clock; the plan ties with plain decoding,
    so the race is never sure)."""
    clock = type("Clock", (), {"now": 0.0, "__call__": lambda self: self.now})()
    factors = iter([1.0, 1.06, 0.97, 1.03, 0.95, 1.01, 1.04] * 10)

    def decode(prompt, new_tokens, plan):
        clock.now += 1.0
        seconds = 1.0 if plan is None else next(factors)
        return list(range(new_tokens)), Stats(new_tokens=new_tokens, rounds=4, accepted=4, seconds=seconds)

    confirmer = Confirmer(None, [[1, 2, 3]], 8, decode=decode)
    clock.now = 0.0  # after the warm-up decode
    plan = DraftPlan.of(name="tie", lookup=["ngram"])
    _, notes = confirmer.race([plan], min_turns=3, max_turns=16, deadline=8.5, clock=clock)
    assert notes == {"confirmation_turns": 4, "confirmation_stopped": "budget"} and clock.now <= 8.5


# -- bounds that measure only what can change a decision ------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_context(tiny_decoder):
    from speccompile.passes.tuning import TuningContext

    _, decoder = tiny_decoder("llama")
    ir = DecoderIR(decoder.config, {})
    ir.attach_decoder(decoder)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, decoder.config.vocab_size, 8).tolist() for _ in range(4)]
    return ir, TuningContext.prepare(ir, prompts, 12, 4, show_progress=False)


def test_an_exit_whose_perfect_drafts_cannot_win_is_bounded_without_its_agreement(tiny_context):
    from speccompile.passes.autotune import ExitLayerAutotune

    ir, context = tiny_context
    context.signals.pop("exit_agreements", None)
    exits = ExitLayerAutotune(context, show_progress=False)
    cheap = exits.exit_bounds(floor=1e9)  # nothing can reach it: no head product at all
    assert context.signals.get("exit_agreements", {}) == {}
    measured = exits.exit_bounds()
    assert set(context.signals["exit_agreements"]) == set(measured) == set(cheap)
    assert all(cheap[e] >= measured[e] for e in cheap)  # a bound without the signal is the looser one


def test_the_adapter_bound_counts_the_training_time_it_has(tiny_context):
    from speccompile.passes.adapter import DEFAULT_TIME_BUDGET, AdapterAutotune

    ir, context = tiny_context
    adapter = AdapterAutotune(context, show_progress=False)
    assert adapter.gain() == ADAPTER_GAIN  # unbudgeted: its whole time
    adapter.deadline = time.perf_counter() + DEFAULT_TIME_BUDGET / 4
    assert adapter.gain() == pytest.approx(ADAPTER_GAIN / 2, rel=0.01)
    short = adapter.bound(ir)
    adapter.deadline = None
    assert short <= adapter.bound(ir)


# -- holding the weights once ---------------------------------------------------------------------------------


def test_conversion_and_the_decoder_hold_the_source_models_own_tensors(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from speccompile.convert import arch_config, canonical_weights

    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama")).eval()
    config = arch_config(hf)
    weights = canonical_weights(hf, config)
    assert weights["layers.0.attn.q.weight"].data_ptr() == hf.model.layers[0].self_attn.q_proj.weight.data_ptr()
    ir = DecoderIR(config, weights)
    decoder = ir.decoder()
    assert decoder.layers[0].mlp.up.weight.data_ptr() == hf.model.layers[0].mlp.up_proj.weight.data_ptr()
    ids = torch.tensor([[1, 7, 9, 30]])
    with torch.inference_mode():
        assert torch.allclose(decoder(ids).float(), hf(ids).logits, atol=1e-4)


def test_the_irs_weights_follow_the_decoder_when_the_torch_backend_packs_it(tiny_decoder):
    """The torch backend concatenates q/k/v and gate/up (the parts become views): the IR then reads the packed
    tensors, so the originals are freed instead of kept as a second copy."""
    from speccompile.runtime.backends.torch.backend import TorchBackend

    _, reference = tiny_decoder("llama")
    tied = reference.config.tie_word_embeddings
    weights = {k: v.clone() for k, v in reference.state_dict().items() if not (tied and k == "lm_head.weight")}
    ir = DecoderIR(reference.config, weights)
    before = ir.weights["layers.1.attn.k.weight"].clone()
    TorchBackend(ir.decoder())
    decoder = ir.decoder()
    assert ir.weights["layers.1.attn.k.weight"].data_ptr() == decoder.layers[1].attn.k.weight.data_ptr()
    assert torch.equal(ir.weights["layers.1.attn.k.weight"], before) and len(ir.weights) == len(weights)


def test_tuning_sessions_read_the_weights_in_memory_and_quantize_once(tiny_decoder, tmp_path):
    """The ONNX runner's sessions get the torch decoder's own memory and the quantized copies, made once for every
    export of the build, instead of reading weights.bin into memory again; their logits are the artifact's."""
    from speccompile.exporters.onnx_export import export_onnx_weights
    from speccompile.runtime.backends.onnx import OnnxBackend

    _, decoder = tiny_decoder("llama")
    tied = decoder.config.tie_word_embeddings
    weights = {k: v for k, v in decoder.state_dict().items() if not (tied and k == "lm_head.weight")}
    plans = {"int8": DraftPlan.of(name="int8", kind="precision", params={"precision": "int8"})}
    derived, arrays = {}, {}
    record = export_onnx_weights(
        decoder.config,
        weights,
        plans,
        tmp_path / "mem" / "onnx",
        variant="fused",
        derived=derived,
        arrays=arrays,
    )
    first = dict(derived)
    assert first and all(".int8" in name for name in first)
    assert arrays["layers.0.mlp.up.weight"].ctypes.data == weights["layers.0.mlp.up.weight"].data_ptr()
    again = export_onnx_weights(
        decoder.config, weights, plans, tmp_path / "again" / "onnx", variant="fused", derived=derived
    )
    assert all(derived[name] is first[name] for name in first)  # reused, not quantized again
    in_memory = OnnxBackend(tmp_path / "mem", record, decoder.config, initializers=arrays, threads=1)
    from_file = OnnxBackend(tmp_path / "again", again, decoder.config, threads=1)
    for backend in (in_memory, from_file):
        backend.reserve(16)
    ids = [1, 7, 9, 30, 2]
    assert np.array_equal(in_memory.forward(ids, 0), from_file.forward(ids, 0))
    int8 = read_plan(plans["int8"], in_memory.config.num_layers)
    assert np.array_equal(in_memory.draft(int8, 4, 5), from_file.draft(int8, 4, 5))


def test_a_build_reports_its_peak_resident_memory(tiny_model_dir, tmp_path):
    out = tmp_path / "art"
    result = CliRunner().invoke(
        main,
        [
            "build",
            str(tiny_model_dir("llama")),
            "-o",
            str(out),
            "--method",
            "cosine",
            "--max-draft",
            "2",
            "--calibration-tokens",
            "8",
            "--quiet",
        ],
    )
    assert result.exit_code == 0, result.output
    memory = json.loads((out / "manifest.json").read_text())["tuning"]["memory"]
    assert memory["peak_resident_bytes"] > 0 and memory["fp32_weights_bytes"] > 0
    last = result.stdout.strip().splitlines()[-1]
    assert last.startswith(f"wrote {out}: peak resident memory of the build") and "x the model's" in last
    shown = CliRunner().invoke(main, ["inspect", str(out)]).output
    assert "the build's peak resident memory" in shown


# -- quantized targets: speculation only where a verify computes its steps bit for bit ------------------------


class RoundsApart:
    """A backend whose calls of several tokens round one unit differently from its one-token calls: what a CPU
    whose kernels take another path for several rows does to a quantized target."""

    name = "onnx"
    record = {"quantization": {"scheme": "int4"}}

    def __init__(self, inner, apart: bool):
        self.inner, self.apart, self.config = inner, apart, inner.config

    def reserve(self, n):
        self.inner.reserve(n)

    def replica(self):
        return RoundsApart(self.inner.replica(), self.apart)

    def forward(self, ids, pos):
        logits = np.array(self.inner.forward(ids, pos), copy=True)
        return np.nextafter(logits, np.inf) if self.apart and len(ids) > 1 else logits


def test_the_self_check_finds_a_verify_that_rounds_unlike_its_steps(tiny_decoder, tiny_model_dir, tmp_path):
    from onnx_helpers import make_artifact, ort_backend

    from speccompile.runtime.backends.onnx.selfcheck import rows_differ, speculation_refusal

    _, decoder = tiny_decoder("llama")
    plan = DraftPlan.of(name="ngram", lookup=["ngram"], lookup_max_draft=4, sources={"ngram": {"min": 1, "max": 3}})
    root = make_artifact(
        decoder,
        {"ngram": plan},
        tmp_path / "q4",
        tiny_model_dir("llama") / "tokenizer.json",
        variant="fused",
        quantize="int4",
        block_size=16,
    )
    quantized = ort_backend(root)
    assert rows_differ(quantized) is None and speculation_refusal(quantized) is None  # the padded export: equal here
    apart = RoundsApart(quantized, apart=True)
    assert "5-token verify and its 5 one-token steps differ" in rows_differ(apart)
    assert "decodes plainly here" in speculation_refusal(apart)
    assert speculation_refusal(RoundsApart(quantized, apart=False)) is None


def test_a_refused_artifact_decodes_plainly_and_says_why(tiny_model_dir, tmp_path, monkeypatch):
    from speccompile.runtime import load
    from speccompile.runtime.backends.onnx.descriptor import OnnxDescriptor

    out = tmp_path / "q8"
    args = ["build", str(tiny_model_dir("llama")), "-o", str(out), "--method", "lookup", "--backend", "onnx"]
    args += ["--quantize", "int8", "--calibration-tokens", "8", "--max-draft", "2", "--quiet"]
    assert CliRunner().invoke(main, args).exit_code == 0
    monkeypatch.setattr(OnnxDescriptor, "speculation_refusal", lambda self, backend: "kernels differ here")
    model = load(out)
    assert (
        model.draft_plan() is None
        and model.draft_plan("lookup") is None
        and model.plain_reason == "kernels differ here"
    )
    result = model.generate("def add(a, b):", max_new_tokens=6)
    assert result.stats.rounds == 0 or result.stats.accepted == 0
    shown = CliRunner().invoke(main, ["generate", str(out), "--prompt", "def add(a, b):", "--max-new-tokens", "4"])
    assert "[plain decoding: kernels differ here]" in shown.stderr


def test_an_estimation_twin_keeps_its_grid_as_codes_not_a_float_copy():
    """The ONNX precision draft's torch stand-in de-quantizes each product per call from one-byte codes: the same
    fp32 grid weights (so the same estimates), at a third of the memory of the fp32 copy it used to keep."""
    from speccompile.passes.precision_estimate import GridLinear, dequantized

    linear = torch.nn.Linear(128, 24)
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(0))
    for bits, symmetric in ((4, False), (8, True)):
        grid = GridLinear(linear, bits, 32, symmetric)
        weight = dequantized(grid.codes, grid.scale, grid.zero, 128)
        assert weight.shape == linear.weight.shape and 0 < float((weight - linear.weight).abs().max()) < 0.1
        assert torch.equal(grid(x), torch.nn.functional.linear(x, weight, linear.bias))
        held = sum(
            t.numel() * t.element_size()
            for t in (grid.codes, grid.scale) + ((grid.zero,) if grid.zero is not None else ())
        )
        assert held < linear.weight.numel() * 4 / 2.5


def _present_pages(array: np.ndarray) -> int:
    page = mmap.PAGESIZE
    first = array.__array_interface__["data"][0] // page
    with open("/proc/self/pagemap", "rb", buffering=0) as f:
        f.seek(first * 8)
        entries = np.frombuffer(f.read(-(-array.nbytes // page) * 8), dtype=np.uint64)
    return int(((entries >> np.uint64(63)) & np.uint64(1)).sum())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/pagemap")
def test_dropping_file_pages_keeps_what_was_written(tmp_path):
    """A build drops the mapped model file's pages while ONNX Runtime holds its packed copy: only clean file pages
    go (read back byte for byte), a page written in a private mapping (anonymous memory now) stays as written."""
    from speccompile.runtime.memory import drop_file_pages

    path = tmp_path / "weights.bin"
    np.arange(1 << 18, dtype=np.float32).tofile(path)  # 1 MiB: 256 pages
    mapped = np.memmap(path, dtype=np.float32, mode="c")  # private, copy on write, as transformers maps
    total = float(np.arange(1 << 18, dtype=np.float64).sum())
    assert float(mapped.sum(dtype=np.float64)) == total
    mapped[5] = -1.0  # its page is now the process's own
    assert _present_pages(mapped) > 1
    assert drop_file_pages([mapped]) > 0
    assert _present_pages(mapped) == 1  # the written page only
    assert mapped[5] == -1.0 and float(mapped.sum(dtype=np.float64)) == total - 5.0 - 1.0  # read back the same
    assert drop_file_pages([mapped[:0]]) == 0


def test_a_big_product_is_encoded_and_de_quantized_a_few_rows_at_a_time(monkeypatch):
    """A tied head (151,936 rows at Qwen3-0.6B's shapes) is encoded and de-quantized ``CODE_ROWS`` rows at a time:
    the same codes and scales as at once, and the same outputs up to the product's rounding."""
    from speccompile.passes import precision_estimate
    from speccompile.passes.precision_estimate import GridLinear, block_codes

    linear = torch.nn.Linear(96, 50)
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(1))
    whole = {(bits, sym): block_codes(linear.weight, bits, 32, sym) for bits, sym in ((4, False), (8, True))}
    full = {key: GridLinear(linear, key[0], 32, key[1])(x) for key in whole}
    monkeypatch.setattr(precision_estimate, "CODE_ROWS", 16)  # 50 rows: four parts, the last one short
    for (bits, symmetric), expected in whole.items():
        parts = block_codes(linear.weight, bits, 32, symmetric)
        assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(parts, expected))
        torch.testing.assert_close(GridLinear(linear, bits, 32, symmetric)(x), full[bits, symmetric])
