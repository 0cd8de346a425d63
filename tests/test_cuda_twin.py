"""The int8 twin's GPU products (``runtime/backends/torch/cuda_twin.py``): weight-only int8
(``torch._weight_int8pack_mm``) and fp8 (``torch._scaled_mm``).

Both ops have CPU kernels, so the GPU code path runs here with its lowering named (``set_twin_lowering``, a
setting of the decoder, not a stand-in): each product is the product of its operands on its format's grid, so
within the grid's rounding bound of the float product; a twin made of them shares every tensor of the model but its products' weights, and greedy speculative
decoding with an int8 precision plan through them is plain decoding, on the host round and inside the device
round's captured body. The ``cuda``-marked tests run the real CUDA path, the form measured per shape included
(``benchmarks/gpu_check.sh`` runs them with ``-m cuda``; skipped without a GPU).
"""

from __future__ import annotations

import pytest
import torch
from lossless import assert_speculative_is_plain, run
from test_precision_draft import prompts
from test_precision_draft import torch_plans as plans

from speccompile.runtime.backends.torch import cuda_twin
from speccompile.runtime.backends.torch.backend import TorchBackend
from speccompile.runtime.backends.torch.graphs import eager_capture
from speccompile.runtime.backends.torch.int8_twin import int8_twin, set_twin_lowering
from speccompile.runtime.drafting import read_plans

FORMS = ("weight-only", "fp8")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def rounding_bound(form: str, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The largest error ``form`` may make on ``x @ W^T`` (per output), from its formats' rounding alone:
    int8 weight-only rounds each weight by at most half its row's step (``max|W_n| / 127 / 2``); fp8 rounds each
    operand by at most 2^-4 relatively (3 mantissa bits) or, below e4m3's normal range, by half its smallest
    step (2^-10 of the operand's scale)."""
    x, w = x.double(), weight.double()
    if form == "weight-only":
        step = w.abs().amax(1) / 127
        return x.abs().sum(-1, keepdim=True) * step / 2
    wscale = w.abs().amax(1) / cuda_twin.E4M3_MAX
    xscale = x.abs().amax(-1, keepdim=True) / cuda_twin.E4M3_MAX  # per row or per call: per call is the larger
    xscale = torch.maximum(xscale, x.abs().amax() / cuda_twin.E4M3_MAX)
    x_err = x.abs() / 16 + xscale * 2**-10
    w_err = w.abs() / 16 + wscale[:, None] * 2**-10
    return x_err @ w.abs().T + x.abs() @ w_err.T + x_err @ w_err.T


def linears_of(decoder) -> list[torch.nn.Linear]:
    found = [m for m in decoder.modules() if isinstance(m, torch.nn.Linear)]
    for module in decoder.modules():
        for name in ("_qkv", "_gate_up"):
            if name in module.__dict__:
                found.append(module.__dict__[name][0])
    return found


def on_the_grid(form: str, x: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype, rowwise: bool) -> torch.Tensor:
    """``x @ W^T`` in float64 over the operands as ``form`` stores them, derived here from its definition: int8
    weight-only, each weight row on 255 levels of ``max|W_n| / 127`` (the scale kept in ``dtype``), the activation
    as it is; fp8, each weight row and each activation row (or the whole call's rows) scaled to a largest
    magnitude of 448 and rounded to float8 e4m3."""
    w = weight.detach().float()
    if form == "weight-only":
        scale = (w.abs().amax(1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
        codes = (w / scale[:, None]).round().clamp(-127, 127)
        return x.double() @ (codes.double() * scale.to(dtype).double()[:, None]).T
    wscale = (w.abs().amax(1) / cuda_twin.E4M3_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    wq = (w / wscale[:, None]).to(torch.float8_e4m3fn).double() * wscale.double()[:, None]
    amax = x.float().abs().amax(-1, keepdim=True) if rowwise else x.float().abs().amax()
    xscale = amax.clamp(min=1e-12) / cuda_twin.E4M3_MAX
    xq = (x.float() / xscale).to(torch.float8_e4m3fn).double() * xscale.double()
    return xq @ wq.T


def check_products(decoder, form: str, dtype: torch.dtype, slack: float) -> None:
    """Each of the decoder's products in ``form`` computes the product of its operands on the form's grid
    (``on_the_grid``: float32 sums, the output rounded to ``dtype``), so it stays within the grid's rounding bound
    (``rounding_bound``, times ``slack``) of the float64 product of the model's weights; and is not that product."""
    gen = torch.Generator().manual_seed(1)
    device = decoder.embed.weight.device
    differs = False
    for linear in linears_of(decoder):
        if not cuda_twin.fits(form, linear):
            continue
        x = (torch.randn(5, linear.in_features, generator=gen) * 3).to(device, dtype)
        product = cuda_twin.FORMS[form](linear, device, dtype)
        with torch.inference_mode():
            out = product(x).double()
        assert out.shape == (5, linear.out_features)
        bias = 0 if linear.bias is None else linear.bias.double()
        magnitude = x.double().abs() @ linear.weight.double().abs().T + 1e-6  # how large the sums' terms are
        grid = on_the_grid(form, x, linear.weight, dtype, getattr(product, "rowwise", True)) + bias
        sums = 1e-5 * magnitude + (grid.abs() * torch.finfo(dtype).eps if dtype != torch.float32 else 0)
        assert bool(((out - grid).abs() <= sums).all()), f"{form}: not the product of its grid's operands"
        exact = x.double() @ linear.weight.double().T + bias
        bound = rounding_bound(form, x, linear.weight) * slack + sums
        assert bool(((out - exact).abs() <= bound).all()), f"{form} beyond its rounding bound"
        differs |= bool((out != exact).any())
    assert differs, f"{form}: no product differs from the float one (the form was not applied)"


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_products_are_within_their_rounding_bound(tiny_decoder, family, form):
    _, decoder = tiny_decoder(family)
    check_products(decoder, form, torch.float32, slack=1.01)


@pytest.mark.parametrize("form", FORMS)
def test_the_twin_shares_every_tensor_but_the_products(tiny_decoder, form):
    _, decoder = tiny_decoder("qwen3")
    TorchBackend(decoder)  # packs q/k/v and gate/up on CPU, as a backend runs the decoder
    set_twin_lowering(decoder, form)
    try:
        twin = int8_twin(decoder)
    finally:
        set_twin_lowering(decoder, None)  # the decoder is shared by the session's other tests
    assert twin.lowering == form and twin.product_forms == {"*": form}
    ours = {id(t) for t in list(decoder.parameters()) + list(decoder.buffers())}
    assert {id(t) for t in list(twin.parameters()) + list(twin.buffers())} <= ours
    assert twin.layers[0].attn.__dict__["_qkv"][0].__class__ is cuda_twin.FORMS[form]  # the packed product too
    assert isinstance(twin.lm_head, cuda_twin.FORMS[form]) and isinstance(
        twin.layers[1].mlp.down, cuda_twin.FORMS[form]
    )
    products = {id(m): m for m in twin.modules() if isinstance(m, cuda_twin.FORMS[form])}
    products.update(
        {
            id(m.__dict__[k][0]): m.__dict__[k][0]
            for m in twin.modules()
            for k in ("_qkv", "_gate_up")
            if k in m.__dict__
        }
    )
    weights = sum(product.in_features * product.out_features for product in products.values())
    assert weights < twin.product_bytes < 1.2 * weights  # a byte per weight and a scale per row
    ids = torch.tensor([prompts(decoder.config.vocab_size)[1]])
    with torch.inference_mode():
        full, draft = decoder(ids), twin(ids)
    assert not torch.equal(full, draft)
    assert (full.argmax(-1) == draft.argmax(-1)).float().mean() > 0.8
    assert int8_twin(decoder).lowering == "dynamic"  # back to the CPU's own twin


@pytest.mark.parametrize("where", ["host-round", "device-round"])
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("family", ["llama", "gemma", "gpt2"])
def test_int8_plans_through_the_gpu_forms_decode_plainly(tiny_decoder, family, form, where):
    """Greedy speculative == plain with the twin's products in each GPU form, on the host round and in the device
    round's captured body (``eager_capture``: the same static steps a CUDA graph replays), and the drafts are
    accepted (an int8 or fp8 copy of the model agrees with it most of the time)."""
    _, decoder = tiny_decoder(family)
    device_round = where == "device-round"
    backend = TorchBackend(decoder, round_on_device=device_round, capture=eager_capture if device_round else None)
    plan_map = plans(decoder.config.num_layers)
    backend.check_plans(read_plans(plan_map, backend.config.num_layers))
    set_twin_lowering(decoder, form)
    try:
        assert_speculative_is_plain(backend, backend, prompts(decoder.config.vocab_size), plan_map, 24)
        _, stats = run(backend, prompts(decoder.config.vocab_size)[0], 24, plan_map["int8"])
        assert int8_twin(decoder).lowering == form
    finally:
        set_twin_lowering(decoder, None)
    assert stats.accepted / max(stats.drafted, 1) > 0.5, stats


def test_lowerings_are_refused_in_one_line(tiny_decoder):
    _, decoder = tiny_decoder("llama")
    with pytest.raises(ValueError, match="must be one of"):
        set_twin_lowering(decoder, "int3")
    with pytest.raises(ValueError, match="must be one of"):
        cuda_twin.device_product(decoder, "dynamic")  # the CPU's own products are int8_twin.py's
    assert cuda_twin.weight_int8_missing("cpu", torch.bfloat16) is None and cuda_twin.fp8_missing("cpu") is None
    assert cuda_twin.cuda_precision_missing("cpu", "int8") is None
    refusal = cuda_twin.cuda_precision_missing("cpu", "int4")
    assert "int4" in refusal and "int8" in refusal and "\n" not in refusal
    assert cuda_twin.available_forms("cpu") == ["weight-only", "fp8"]


def test_the_benchmark_smoke_run(tmp_path):
    """``benchmarks/experiments/cuda_twin_step.py --smoke``: the plain and twin steps at tiny shapes on CPU,
    one table row per lowering and token count (a run, not a timing: nothing is compared)."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parents[1] / "benchmarks" / "experiments" / "cuda_twin_step.py"
    done = subprocess.run(
        [sys.executable, str(script), "--smoke"], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    rows = [line for line in done.stdout.splitlines() if line.startswith("|") and "---" not in line]
    assert len(rows) == 1 + 2 * 2, done.stdout  # the header, then weight-only and fp8 at 1 and 4 tokens
    assert all("weight-only" in r or "fp8" in r for r in rows[1:])


# -- on a GPU ----------------------------------------------------------------------------------------------------
@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_products_are_within_their_rounding_bound(tiny_model_dir, dtype):
    from test_cuda_graphs import _cuda_decoder

    decoder = _cuda_decoder(tiny_model_dir, dtype)
    forms = cuda_twin.available_forms("cuda", dtype)
    assert forms, cuda_twin.cuda_precision_missing("cuda", "int8", dtype)
    for form in forms:  # float32 sums inside the kernels; a 16-bit dtype rounds the output
        check_products(decoder, form, dtype, slack=1.05)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("lowering", ["auto", "weight-only", "fp8"])
def test_cuda_int8_plans_decode_plainly(tiny_model_dir, lowering, dtype):
    """On the GPU: greedy speculative decoding with int8 plans, through the twin ``auto`` makes (each shape's form
    measured) and through each form named, gives the eager host backend's plain tokens (near-ties aside: 1e-4 in
    fp32, 2e-2 in fp16), with CUDA graphs and the device round (the defaults) and on the host round."""
    from test_cuda_graphs import PROMPT, _cuda_decoder, _same_or_near_tie

    missing = {"weight-only": cuda_twin.weight_int8_missing("cuda", dtype), "fp8": cuda_twin.fp8_missing("cuda")}
    if missing.get(lowering):
        pytest.skip(missing[lowering])
    assert cuda_twin.cuda_precision_missing("cuda", "int8", dtype) is None
    decoder = _cuda_decoder(tiny_model_dir, dtype)
    set_twin_lowering(decoder, lowering)
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    prompt = PROMPT + PROMPT[:5]
    reference, _ = run(TorchBackend(decoder, cuda_graphs=False, round_on_device=False), prompt, 32)
    plan_map = plans(decoder.config.num_layers)
    twin = int8_twin(decoder)  # at load, as the backend's prepare makes it: never inside a captured round
    assert set(twin.product_forms.values()) <= {"dense", "weight-only", "fp8"}
    accepted = 0
    for backend in (TorchBackend(decoder), TorchBackend(decoder, round_on_device=False)):
        backend.check_plans(read_plans(plan_map, backend.config.num_layers))
        for plan in plan_map.values():
            spec, stats = run(backend, prompt, 32, plan)
            _same_or_near_tie(decoder, prompt, reference, spec, tolerance)
            accepted += stats.accepted
    assert accepted > 0
