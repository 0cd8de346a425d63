"""The torch decoder that stands in for a precision self-draft (``runtime/drafting/kinds/precision.py``) when the
estimator scores it (``passes/acceptance_estimate.profile_plan``: the draft's logits over a calibration sequence in
one parallel pass against the verifier's KV, which is what the first drafted token of a real round sees).

- On torch the draft *is* a torch decoder, the int8 twin (``runtime/backends/torch/int8_twin.py``): the estimate runs the
  very kernels the artifact runs.
- On ONNX Runtime the draft is ``MatMulNBits`` with the plan's block grid. Its stand-in has the same grid,
  kept as its codes and de-quantized in fp32 for each product (``GridLinear``), with fp32 activations where ONNX Runtime's
  accuracy level 4 quantizes them to int8 per block: close, not exact (``--method precision`` therefore
  keeps the plan that did best in the real loop, on the backend).

Twins are kept per decoder (a build scores several plans of one precision).
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from speccompile.runtime.backends.torch.int8_twin import (
    SMOOTHING_ALPHA,
    fold_points,
    input_scales_from,
    int8_twin,
    twin_with,
)
from speccompile.runtime.memory import large_blocks_returned
from speccompile.runtime.segments import parse_precision

_GRID_TWINS: "weakref.WeakKeyDictionary[nn.Module, dict]" = weakref.WeakKeyDictionary()  # decoder -> precision -> twin


CODE_ROWS = 4096  # rows encoded at a time: a tied 151,936-token head is 0.6 GB of fp32, and each temporary as big


def block_codes(weight: torch.Tensor, bits: int, block: int, symmetric: bool):
    """``weight`` [out, in] on a weight-only block grid along its input dimension (as ``MatMulNBits`` stores it:
    ``block`` inputs share a scale, and a zero point unless ``symmetric``): (integer codes ``[out, blocks,
    block]``, one byte each; scales and zero points ``[out, blocks, 1]``; zero points None when symmetric).
    Encoded ``CODE_ROWS`` rows at a time (each row's codes depend on that row only), so that the fp32
    temporaries stay small next to the codes."""
    out, width = weight.shape
    if out <= CODE_ROWS:
        return _row_codes(weight, bits, block, symmetric)
    parts = [_row_codes(weight[lo : lo + CODE_ROWS], bits, block, symmetric) for lo in range(0, out, CODE_ROWS)]
    codes, scale = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    return codes, scale, None if symmetric else torch.cat([p[2] for p in parts])


def _row_codes(weight: torch.Tensor, bits: int, block: int, symmetric: bool):
    out, width = weight.shape
    padded = -(-width // block) * block
    w = torch.zeros(out, padded, dtype=torch.float32)
    w[:, :width] = weight.detach().float().cpu()
    w = w.view(out, padded // block, block)
    levels = 2**bits - 1
    if symmetric:
        scale = (w.abs().amax(-1, keepdim=True) / (2 ** (bits - 1))).clamp(min=1e-12)
        return (w / scale).round().clamp(-(2 ** (bits - 1)), 2 ** (bits - 1) - 1).to(torch.int8), scale, None
    low, high = w.amin(-1, keepdim=True).clamp(max=0), w.amax(-1, keepdim=True).clamp(min=0)
    scale = ((high - low) / levels).clamp(min=1e-12)
    zero = (-low / scale).round().clamp(0, levels)
    return ((w / scale).round() + zero).clamp(0, levels).to(torch.uint8), scale, zero


def dequantized(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, width: int) -> torch.Tensor:
    """The fp32 weight ``[out, width]`` that ``block_codes`` encoded."""
    w = codes.float() if zero is None else codes.float().sub(zero)
    return (w * scale).view(codes.shape[0], -1)[:, :width]


class GridLinear(nn.Module):
    """A linear layer on a weight-only block grid, kept as its one-byte codes with their scales and de-quantized for
    each call: an estimation twin holds about a third of the fp32 weights' bytes, not a second fp32 copy per scheme
    (such copies are most of a big model's ONNX build peak; measured: docs/history.md, 'Figures behind the code's
    constants')."""

    def __init__(self, linear: nn.Linear, bits: int, block: int, symmetric: bool):
        super().__init__()
        self.width, self.dtype = linear.in_features, linear.weight.dtype
        self.codes, self.scale, self.zero = block_codes(linear.weight, bits, block, symmetric)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = self.codes.shape[0]
        if rows <= CODE_ROWS:
            weight = dequantized(self.codes, self.scale, self.zero, self.width).to(self.dtype)
            return nn.functional.linear(x, weight, self.bias)
        # a big product (a tied head) de-quantized CODE_ROWS output rows at a time: no full fp32 copy per call
        return torch.cat([self._rows(x, lo, min(lo + CODE_ROWS, rows)) for lo in range(0, rows, CODE_ROWS)], dim=-1)

    def _rows(self, x: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        zero = None if self.zero is None else self.zero[lo:hi]
        weight = dequantized(self.codes[lo:hi], self.scale[lo:hi], zero, self.width).to(self.dtype)
        return nn.functional.linear(x, weight, None if self.bias is None else self.bias[lo:hi])


@torch.inference_mode()
def int8_input_scales(decoder: nn.Module, sequences: list[torch.Tensor], alpha: float = SMOOTHING_ALPHA) -> dict:
    """SmoothQuant scales for the int8 twin (``runtime/backends/torch/int8_twin.fold_points``): the largest
    magnitude each input channel of its products takes while the full model reads ``sequences`` (token ids
    ``[1, T]``; the calibration continuations), turned into per-channel scales (``input_scales_from``)."""
    points = fold_points(decoder)
    absmax: dict[str, torch.Tensor] = {}

    def keep(name: str, x: torch.Tensor) -> None:
        seen = x.detach().reshape(-1, x.shape[-1]).abs().amax(0).float().cpu()
        absmax[name] = seen if name not in absmax else torch.maximum(absmax[name], seen)

    handles = []
    for name, (norm, readers, _) in points.items():
        if norm is not None:
            handles.append(norm.register_forward_hook(lambda module, args, out, name=name: keep(name, out)))
        else:
            handles.append(readers[0].register_forward_pre_hook(lambda module, args, name=name: keep(name, args[0])))
    try:
        for tokens in sequences:
            decoder(tokens.to(decoder.embed.weight.device))
    finally:
        for handle in handles:
            handle.remove()
    return input_scales_from(points, absmax, alpha)


def estimation_twin(decoder: nn.Module, precision: str, backend: str) -> nn.Module:
    """The torch decoder whose logits stand for ``precision``'s draft on ``backend`` ("torch" or "onnx")."""
    if backend == "torch":
        return int8_twin(decoder)  # the one the torch backend runs (made once per decoder)
    twins = _GRID_TWINS.setdefault(decoder, {})
    if precision not in twins:
        scheme, block, symmetric = parse_precision(precision)
        bits = {"int4": 4, "int8": 8}[scheme]
        with large_blocks_returned():  # the codes stay, their fp32 temporaries leave the resident set
            twins[precision] = twin_with(decoder, lambda linear, down: GridLinear(linear, bits, block, symmetric))
    return twins[precision]


def release_twins(decoder: nn.Module) -> None:
    """Drop ``decoder``'s ONNX stand-ins (their codes are a third of the model's bytes per scheme) once scored."""
    _GRID_TWINS.pop(decoder, None)


__all__ = ["release_twins", "GridLinear", "block_codes", "dequantized", "estimation_twin", "int8_input_scales"]
