"""The torch lowering of an int8 precision self-draft (``draft_kinds/precision.py``): a twin of the decoder that
shares every tensor with it (embeddings, norms, rotary tables, the KV cache it is run on) except the weights
of its products, which are int8.

Why dynamic int8 and not weight-only: torch's CPU weight-only products are slow on this project's machines
(SmolLM2-135M's 211 products for one token row: fp32 ``F.linear`` 20 ms, ``_weight_int8pack_mm`` 50 ms,
``_weight_int4pack_mm_for_cpu`` 112 ms), while its dynamic-int8 product (weights int8 per output channel,
the activation row quantized per call, fbgemm / oneDNN with VNNI) takes 7 ms. ONNX Runtime's
``MatMulNBits`` at accuracy level 4 quantizes activations to int8 as well, so both backends draft with
int8 x int8 products. The twin quantizes each weight matrix per output channel, symmetric, whatever block
size the plan names (that option shapes the ONNX Runtime draft only), and quantizes at load: nothing extra
is stored in a torch artifact; the twin holds about a quarter of the fp32 weights' bytes in memory.

One exception, measured: the MLP's down projection keeps fp16 weights and fp32 activations
(``linear_dynamic_fp16``). Its input (the gated product) carries a few outlier channels, as LLM.int8()
describes, and one int8 scale per activation row crushes the rest: on SmolLM2-135M the twin's greedy token
agreed with the model's on 70% of continuation positions with int8 everywhere and on 93% with fp16 down
projections, for a step of 15.7 ms instead of 13.3 ms (the fp32 step: 29 ms). Activations use the full 8
bits (no ``reduce_range``): on a CPU without VNNI fbgemm's u8 x s8 pair sums may then saturate, which can
only lower the draft's acceptance: the full model decides every token.

The full model never runs through the twin: plain decoding and every verify use the decoder itself.
"""

from __future__ import annotations

import copy
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


class DynamicInt8Linear(nn.Module):
    """``F.linear(x, W, b)`` with ``W`` int8 per output channel (symmetric) and ``x`` quantized per call to
    8 bits (no ``reduce_range``: see the module's docstring)."""

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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # a draft step is ~120 of these: no no-op casts around each
            return torch.ops.quantized.linear_dynamic(x, self._packed, False)
        return torch.ops.quantized.linear_dynamic(x.float(), self._packed, False).to(x.dtype)


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


def twin_with(decoder: nn.Module, product: Callable[[nn.Linear, bool], nn.Module]) -> nn.Module:
    """A copy of ``decoder`` (``runtime/decoder.Decoder``) whose every ``nn.Linear``, and every packed q/k/v or
    gate/up product (``decoder.pack_projections``), is ``product(linear, is_mlp_down)``; all parameters and
    buffers are the decoder's own tensors (no copy). A tied or packed module is converted once."""
    from .decoder import MLP

    shared = {id(t): t for t in itertools.chain(decoder.parameters(), decoder.buffers())}
    for module in decoder.modules():  # the packed products' weights are no parameters of the module tree
        for name in PACKED:
            if name in module.__dict__:
                shared.update({id(t): t for t in module.__dict__[name][0].parameters()})
    twin = copy.deepcopy(decoder, memo=shared)
    made: dict[int, nn.Module] = {}

    def convert(linear: nn.Linear, down: bool = False) -> nn.Module:
        if id(linear) not in made:
            made[id(linear)] = product(linear, down)
        return made[id(linear)]

    for module in list(twin.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, name, convert(child, isinstance(module, MLP) and name == "down"))
        for name in PACKED:
            entry = module.__dict__.get(name)
            if entry is not None:  # (product, sizes, parts, views): the parts still view the shared packed weight
                packed, sizes, parts, views = entry
                object.__setattr__(module, name, (convert(packed), sizes, parts, views))
    twin.product_bytes = sum(getattr(m, "nbytes", 0) for m in made.values())
    return twin


_TWINS: "weakref.WeakKeyDictionary[nn.Module, nn.Module]" = weakref.WeakKeyDictionary()


def int8_twin(decoder: nn.Module) -> nn.Module:
    """The decoder's int8 twin: ``DynamicInt8Linear`` products, ``DynamicFp16Linear`` MLP down projections.
    Made once per decoder, so the backend's replicas and the tuner's estimator run the same one."""
    if decoder not in _TWINS:
        _TWINS[decoder] = twin_with(decoder, lambda linear, down: (DynamicFp16Linear if down else DynamicInt8Linear)(linear))
    return _TWINS[decoder]


__all__ = ["DynamicFp16Linear", "DynamicInt8Linear", "int8_kernel_missing", "int8_twin", "twin_with"]
