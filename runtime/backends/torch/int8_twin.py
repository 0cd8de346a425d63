"""The torch lowering of an int8 precision self-draft (``runtime/drafting/kinds/precision.py``): a twin of the
decoder that shares every tensor with it (embeddings, norms, rotary tables, the KV cache it is run on) except the
weights of its products, which are int8.

Why dynamic int8 and not weight-only: torch's CPU weight-only products (``_weight_int8pack_mm``,
``_weight_int4pack_mm_for_cpu``) are slower than the fp32 ``F.linear`` on this project's machines, while its
dynamic-int8 product (weights int8 per output channel, the activation row quantized per call, fbgemm / oneDNN
with VNNI) takes a fraction of the fp32 time (measured: docs/history.md, 'Figures behind the code's
constants'). ONNX Runtime's
``MatMulNBits`` at accuracy level 4 quantizes activations to int8 as well, so both backends draft with
int8 x int8 products. The twin quantizes each weight matrix per output channel, symmetric, whatever block
size the plan names (that option shapes the ONNX Runtime draft only), and quantizes at load: a torch artifact
stores only the smoothing scales below (one float per input channel of each product); the twin holds about a
quarter of the fp32 weights' bytes in memory.

Activation outliers, measured. A product's input may carry a few channels far larger than the rest (as
LLM.int8() describes), and one int8 scale per activation row crushes the others: with int8 everywhere the
twin's greedy token agrees with the model's far less often than with fp16 weights and fp32 activations in the
MLP's down projection (``linear_dynamic_fp16``), whose input, the gated product, has the worst outliers (at the
price of a dearer step). SmoothQuant removes most of that loss (``fold_points``, ``set_input_scales``):
per-channel scales measured on the build's calibration text divide each input channel (folded into the twin's
own copy of the norm before the product, or of the up rows before the down projection) and multiply the weight
columns, exactly. With them the down projection is int8 too: a slightly worse draft than with fp16 down
projections, on a cheaper step that makes the plan faster (``benchmarks/experiments/twin_variants.py``;
measured: docs/history.md, 'Figures behind the code's constants'). An artifact without scales keeps the fp16
down projections.

Activations use the full 8 bits where this CPU's kernel sums u8 x s8 products exactly (VNNI, AMX), and 7 bits
(``reduce_range``) where it does not: without VNNI, fbgemm sums each pair of products into int16 with
saturation (AVX2's ``vpmaddubsw``), which a full 8-bit activation overflows. Measured at first use
(``int8_pairs_saturate``), never assumed from the CPU's name: on an AVX2 CPU without VNNI a row of ones times a
matrix of ones gives half its sum at 8 bits, and the twin's acceptance falls (measured: docs/history.md, 'Figures
behind the code's constants'; lossless all the same: the full model decides every token).

On a GPU (the decoder's weights on a CUDA device) the twin's products are weight-only int8 or fp8 instead,
chosen by what the device offers and measured there: ``runtime/backends/torch/cuda_twin.py``, which says why.
``set_twin_lowering`` names the products for a decoder on any device (the CPU runs the GPU forms too, which is
how they are tested without a GPU).

The full model never runs through the twin: plain decoding and every verify use the decoder itself.
"""

from __future__ import annotations

import copy
import functools
import itertools
import warnings
import weakref
from typing import Callable

import torch
from torch import nn

PACKED = ("_qkv", "_gate_up")  # decoder.pack_projections' entries in a module's __dict__


def int8_kernel_missing() -> str | None:
    """Why this torch build cannot run dynamic-int8 products on CPU, or None."""
    if torch.backends.quantized.engine in (None, "none") or not hasattr(torch.ops.quantized, "linear_dynamic"):
        return f"this torch build has no dynamic-int8 CPU kernel (quantized engine {torch.backends.quantized.engine!r})"
    return None


@functools.cache
def int8_pairs_saturate() -> bool:
    """Whether this CPU's dynamic-int8 product saturates 8-bit activations (see the module's docstring): a row
    of ones times a matrix of ones, whose exact product is the row's width, at the full 8 bits."""
    width = 64
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        scale = torch.full((4,), 1 / 127, dtype=torch.double)
        weight = torch.quantize_per_channel(
            torch.ones(4, width), scale, torch.zeros(4, dtype=torch.long), 0, torch.qint8
        )
        packed = torch.ops.quantized.linear_prepack(weight, None)
        out = torch.ops.quantized.linear_dynamic(torch.ones(2, width), packed, False)
    return bool((out - width).abs().max() > 0.01 * width)


class DynamicInt8Linear(nn.Module):
    """``F.linear(x, W, b)`` with ``W`` int8 per output channel (symmetric) and ``x`` quantized per call to
    8 bits, or 7 where this CPU's kernel would saturate 8 (``int8_pairs_saturate``)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        weight = linear.weight.detach().float().cpu()
        scale = (weight.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
        zeros = torch.zeros(weight.shape[0], dtype=torch.long)
        bias = None if linear.bias is None else linear.bias.detach().float().cpu()
        with warnings.catch_warnings():  # quantized tensors are deprecated as a user API, not the kernels under them
            warnings.simplefilter("ignore")
            quantized = torch.quantize_per_channel(weight, scale.double(), zeros, 0, torch.qint8)
            self._packed = torch.ops.quantized.linear_prepack(quantized, bias)
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.nbytes = weight.numel() + 4 * weight.shape[0]
        self.reduce_range = int8_pairs_saturate()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # a draft step is ~120 of these: no no-op casts around each
            return torch.ops.quantized.linear_dynamic(x, self._packed, self.reduce_range)
        return torch.ops.quantized.linear_dynamic(x.float(), self._packed, self.reduce_range).to(x.dtype)


class DynamicFp16Linear(nn.Module):
    """``F.linear(x, W, b)`` with ``W`` stored in fp16 and ``x`` kept in fp32 (fbgemm's fp16 product)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        weight = linear.weight.detach().float().cpu()
        bias = None if linear.bias is None else linear.bias.detach().float().cpu()
        self._packed = torch.ops.quantized.linear_prepack_fp16(weight, bias)
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.nbytes = 2 * weight.numel()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return torch.ops.quantized.linear_dynamic_fp16(x, self._packed)
        return torch.ops.quantized.linear_dynamic_fp16(x.float(), self._packed).to(x.dtype)


SCALES_FILE = "weights/int8_scales.safetensors"  # a torch artifact's twin scales (backends['torch'].int8_scales_file)
SMOOTHING_ALPHA = 0.7
"""SmoothQuant's migration strength: how much of an input channel's range moves into the weights
(``s = max|x|^a / max|W|^(1-a)``): of 0.5, 0.7 and 0.85, the strength whose twin agreed best with the model's
greedy token, each above no smoothing (measured: docs/history.md, 'Figures behind the code's constants')."""


def fold_points(model: nn.Module) -> dict[str, tuple[nn.Module | None, list[nn.Module], nn.Module | None]]:
    """Where the twin can rescale a product's input channels exactly: name -> (the norm whose output is the
    input, the products reading it, the gated MLP whose up rows make it). Dividing the norm's weight (and bias),
    or those rows, by ``s`` and multiplying the readers' weight columns by ``s`` leaves the function unchanged:

    - ``layers.i.attn``: the attention norm's output, read by q/k/v (and their packed product);
    - ``layers.i.mlp``: the MLP norm's output, read by gate/up;
    - ``layers.i.down``: a gated MLP's ``act(gate) * up``, read by down, made by the up rows;
    - ``head``: the final norm's output, read by the lm_head.

    Blocks without a pre-norm (OLMo 2's post-norms) or with experts are left out: their inputs stay as they are."""
    from .decoder import MLP

    points: dict = {}
    for i, block in enumerate(model.layers):
        attn = block.attn
        if block.attn_norm is not None:
            qkv = [attn.q, attn.k, attn.v] + ([attn.__dict__["_qkv"][0]] if "_qkv" in attn.__dict__ else [])
            points[f"layers.{i}.attn"] = (block.attn_norm, qkv, None)
        mlp = block.mlp
        if not isinstance(mlp, MLP):
            continue
        packed = [mlp.__dict__["_gate_up"][0]] if "_gate_up" in mlp.__dict__ else []
        if block.mlp_norm is not None:
            points[f"layers.{i}.mlp"] = (
                block.mlp_norm,
                [p for p in (mlp.gate, mlp.up) if p is not None] + packed,
                None,
            )
        if mlp.gate is not None:
            points[f"layers.{i}.down"] = (None, [mlp.down], mlp)
    points["head"] = (model.norm, [model.lm_head], None)
    return points


def input_scales_from(
    points: dict, absmax: dict[str, torch.Tensor], alpha: float = SMOOTHING_ALPHA
) -> dict[str, torch.Tensor]:
    """SmoothQuant's per-channel scales ``max|x|^a / max|W|^(1-a)`` for each fold point with statistics:
    ``absmax[name]`` is the largest magnitude each input channel took on calibration text."""
    scales = {}
    for name, (_, readers, _) in points.items():
        if name not in absmax:
            continue
        w = torch.stack([r.weight.detach().float().abs().amax(0).cpu() for r in readers]).amax(0)
        x = absmax[name].float().cpu()
        scales[name] = (x.clamp(min=1e-5) ** alpha / w.clamp(min=1e-5) ** (1 - alpha)).clamp(min=1e-5).contiguous()
    return scales


def _rescaled(linear: nn.Linear, columns: torch.Tensor | None, rows: tuple[int, torch.Tensor] | None) -> nn.Linear:
    """A float copy of ``linear`` with its weight columns times ``columns`` and, from row ``rows[0]`` on, its
    rows (and bias) divided by ``rows[1]``."""
    weight = linear.weight.detach().float().cpu().clone()
    bias = None if linear.bias is None else linear.bias.detach().float().cpu().clone()
    if columns is not None:
        weight *= columns[None, :]
    if rows is not None:
        start, divisor = rows
        weight[start : start + divisor.shape[0]] /= divisor[:, None]
        if bias is not None:
            bias[start : start + divisor.shape[0]] /= divisor
    copy_ = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    copy_.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        copy_.bias = nn.Parameter(bias, requires_grad=False)
    return copy_


def _fold(twin: nn.Module, scales: dict[str, torch.Tensor]) -> tuple[dict, dict]:
    """Divide the twin's own copies of the fold points' norms by their scales; returns the column scales and
    row divisors (first row, divisor) the products must take, by module id."""
    columns, rows = {}, {}
    for name, (norm, readers, maker) in fold_points(twin).items():
        s = scales.get(name)
        if s is None:
            continue
        if norm is not None:  # the twin's own norm parameters: the decoder's stay untouched
            norm.weight = nn.Parameter(
                (norm.weight.detach().float() / s.to(norm.weight.device)).to(norm.weight.dtype), requires_grad=False
            )
            if getattr(norm, "bias", None) is not None:
                norm.bias = nn.Parameter(
                    (norm.bias.detach().float() / s.to(norm.bias.device)).to(norm.bias.dtype), requires_grad=False
                )
        for reader in readers:
            columns[id(reader)] = s
        if maker is not None:  # the MLP's up rows, alone and inside its packed gate/up product
            rows[id(maker.up)] = (0, s)
            if "_gate_up" in maker.__dict__:
                packed, sizes, _, _ = maker.__dict__["_gate_up"]
                rows[id(packed)] = (sizes[0], s)
    return columns, rows


def twin_with(
    decoder: nn.Module, product: Callable[[nn.Linear, bool], nn.Module], scales: dict[str, torch.Tensor] | None = None
) -> nn.Module:
    """A copy of ``decoder`` (``runtime/backends/torch/decoder.Decoder``) whose every ``nn.Linear``, and every
    packed q/k/v or gate/up product (``decoder.pack_projections``), is ``product(linear, outliers)`` (``outliers``:
    an MLP down projection whose input ``scales`` do not smooth); all parameters and buffers are the decoder's own
    tensors (no copy). A tied or packed module is converted once; the parts of a packed product are not converted
    (the packed one runs; they keep viewing the decoder's weights).

    ``scales`` (``fold_points`` name -> per-channel scale): SmoothQuant smoothing. Activation outliers, a few
    channels far larger than the rest, crush the others under one int8 scale per row: dividing each input channel
    by ``s`` (folded into the twin's own copy of the norm before it, or of the up rows) and multiplying the
    product's weight columns by ``s`` moves part of that range into the per-channel weight scales."""
    from .decoder import MLP

    shared = {id(t): t for t in itertools.chain(decoder.parameters(), decoder.buffers())}
    for module in decoder.modules():  # the packed products' weights are no parameters of the module tree
        for name in PACKED:
            if name in module.__dict__:
                shared.update({id(t): t for t in module.__dict__[name][0].parameters()})
    twin = copy.deepcopy(decoder, memo=shared)
    columns, rows = _fold(twin, scales) if scales else ({}, {})
    made: dict[int, nn.Module] = {}

    def convert(linear: nn.Linear, outliers: bool = False) -> nn.Module:
        if id(linear) not in made:
            col, row = columns.get(id(linear)), rows.get(id(linear))
            made[id(linear)] = product(linear if col is None and row is None else _rescaled(linear, col, row), outliers)
        return made[id(linear)]

    packed_parts = {
        id(part)
        for module in twin.modules()
        for name in PACKED
        if name in module.__dict__
        for part in module.__dict__[name][2]
    }
    for module in list(twin.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear) and id(child) not in packed_parts:  # down: outliers unless smoothed
                setattr(
                    module,
                    name,
                    convert(child, isinstance(module, MLP) and name == "down" and id(child) not in columns),
                )
        for name in PACKED:
            entry = module.__dict__.get(name)
            if entry is not None:  # (product, sizes, parts, views): the parts still view the shared packed weight
                packed, sizes, parts, views = entry
                object.__setattr__(module, name, (convert(packed), sizes, parts, views))
    twin.product_bytes = sum(getattr(m, "nbytes", 0) for m in made.values())
    return twin


_TWINS: "weakref.WeakKeyDictionary[nn.Module, nn.Module]" = weakref.WeakKeyDictionary()


def set_input_scales(decoder: nn.Module, scales: dict[str, torch.Tensor] | None) -> None:
    """Give ``decoder``'s int8 twin SmoothQuant scales (``fold_points`` names; an artifact's
    ``backends['torch'].int8_scales_file``, or the tuner's from calibration text); the next ``int8_twin`` is made
    with them."""
    decoder.int8_input_scales = scales
    _TWINS.pop(decoder, None)


TWIN_LOWERINGS = ("dynamic", "auto", "weight-only", "fp8")


def twin_lowering(decoder: nn.Module) -> str:
    """How ``decoder``'s twin makes its products: as ``set_twin_lowering`` said, else by the weights' device:
    ``dynamic`` (this module's dynamic-int8 products) on CPU, ``auto`` (``cuda_twin.device_product``) on CUDA."""
    lowering = getattr(decoder, "int8_twin_lowering", None)
    if lowering is not None:
        return lowering
    return "dynamic" if decoder.embed.weight.device.type == "cpu" else "auto"


def set_twin_lowering(decoder: nn.Module, lowering: str | None) -> None:
    """Make ``decoder``'s next twin with ``lowering`` (``TWIN_LOWERINGS``; None: by device, ``twin_lowering``)."""
    if lowering is not None and lowering not in TWIN_LOWERINGS:
        raise ValueError(f"twin lowering {lowering!r} must be one of {', '.join(TWIN_LOWERINGS)}")
    decoder.int8_twin_lowering = lowering
    _TWINS.pop(decoder, None)


def int8_twin(decoder: nn.Module) -> nn.Module:
    """The decoder's int8 twin. ``dynamic`` lowering (CPU): ``DynamicInt8Linear`` products, smoothed with the
    decoder's input scales when it has them (``set_input_scales``); ``DynamicFp16Linear`` for the MLP down
    projections they do not smooth. Otherwise (CUDA, or ``set_twin_lowering``): ``cuda_twin.device_product``'s
    weight-only int8 or fp8 products, unsmoothed. Made once per decoder, so the backend's replicas and the
    tuner's estimator run the same one."""
    if decoder not in _TWINS:
        lowering = twin_lowering(decoder)
        if lowering == "dynamic":
            twin = twin_with(
                decoder,
                lambda linear, outliers: (DynamicFp16Linear if outliers else DynamicInt8Linear)(linear),
                getattr(decoder, "int8_input_scales", None),
            )
        else:
            from .cuda_twin import device_product

            product = device_product(decoder, lowering)
            twin = twin_with(decoder, product)
            twin.product_forms = product.chosen or {"*": product.forms[0]}
        twin.lowering = lowering
        _TWINS[decoder] = twin
    return _TWINS[decoder]


def release_int8_twin(decoder: nn.Module) -> None:
    """Forget ``decoder``'s int8 twin (its int8 products are about a third of the model's bytes, more with their
    packed forms): a build tuning for ONNX Runtime uses it only for a bound."""
    _TWINS.pop(decoder, None)


__all__ = [
    "DynamicFp16Linear",
    "DynamicInt8Linear",
    "SCALES_FILE",
    "SMOOTHING_ALPHA",
    "TWIN_LOWERINGS",
    "fold_points",
    "input_scales_from",
    "int8_kernel_missing",
    "int8_pairs_saturate",
    "int8_twin",
    "release_int8_twin",
    "set_input_scales",
    "set_twin_lowering",
    "twin_lowering",
    "twin_with",
]
