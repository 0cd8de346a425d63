"""Linear layers for a few token rows on CPU: the weight-streaming product, chosen by measurement.

Decoding and verifying multiply one to a few dozen token rows by every weight matrix, so a step is a
stream over the weights. ``F.linear(x, W)`` computes ``x @ W^T``; with one to three rows BLAS may take a
matrix-vector or narrow path that streams the weights far below the memory bandwidth (measured on this
project's 2-core AMD EPYC with torch's MKL: SmolLM2-135M's 211 products take 42 ms for one row and 70 ms
for two, where the same products written ``W @ x^T`` with at least two columns take 17 ms and 16 ms).
Which form is faster depends on the CPU and the BLAS build, so ``choose_streaming_rows`` times both on
the model's own weights (cold, in model order, as a step reads them) for each row count and keeps the
winner per count; ``use_streaming_linears`` then switches the model's ``nn.Linear`` modules to
``StreamingLinear``, which applies it. Both forms compute the same dot products; like any change of
kernel they may round differently, which the near-tie rule of lossless greedy covers (DESIGN.md
section 6): a backend's plain and speculative decoding always run the same modules.

``SPECCOMPILE_CPU_LINEAR=standard`` keeps ``F.linear`` everywhere; ``=streaming`` uses the streaming
form for every row count up to ``MAX_ROWS`` without timing.
"""

from __future__ import annotations

import os
import time

import torch
import torch.nn.functional as F
from torch import nn

MAX_ROWS = 16  # longest verify the choice covers (a lookup draft is at most 12 tokens); longer calls use F.linear
PROBE_ROWS = (1, 2, 3, 4, 6, 8, 12, 16)


class StreamingLinear(nn.Linear):
    """``nn.Linear`` that computes ``W @ x^T`` (at least two columns) for the row counts in
    ``streaming_rows``, ``F.linear`` otherwise. Created only by switching an ``nn.Linear``'s class."""

    streaming_rows: frozenset[int] = frozenset()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if rows not in self.streaming_rows or x.dtype != self.weight.dtype:
            return F.linear(x, self.weight, self.bias)
        return streaming_product(x, self.weight, self.bias)


def streaming_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` as ``weight @ x^T``, one row padded to two columns (a GEMM, not a GEMV)."""
    rows = x.numel() // x.shape[-1]
    flat = x.reshape(rows, x.shape[-1]).contiguous()
    if rows == 1:
        flat = torch.cat((flat, flat))
    # W @ flat^T reads flat^T as a transposed row-major matrix (the layout measured); the result is
    # made row-major again, as F.linear returns it, so no later op sees a strided tensor.
    y = torch.mm(weight, flat.t())[:, :rows].t().contiguous()
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], weight.shape[0])


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


@torch.inference_mode()
def choose_streaming_rows(weights: list[torch.Tensor], rows: tuple[int, ...] = PROBE_ROWS, repeats: int = 3,
                          margin: float = 0.9) -> frozenset[int]:
    """Row counts (1..MAX_ROWS) for which ``W @ x^T`` over all of ``weights`` beats ``F.linear`` by more
    than ``1 - margin``; a count between two probed ones follows the lower one."""
    if not weights:
        return frozenset()
    widths = {w.shape[1] for w in weights}
    inputs = {(n, k): torch.randn(n, k, dtype=weights[0].dtype) for n in rows for k in widths}

    def every_product(form, n):
        for w in weights:
            form(inputs[n, w.shape[1]], w)

    winners = set()
    for n in rows:
        every_product(F.linear, n)  # warm-up (allocator, thread pool)
        standard = streaming = float("inf")
        for _ in range(repeats):  # in turns, so that a slow moment of the machine does not fall on one form only
            standard = min(standard, _seconds(lambda: every_product(F.linear, n)))
            streaming = min(streaming, _seconds(lambda: every_product(streaming_product, n)))
        if streaming < margin * standard:
            winners.add(n)
    chosen, last = set(), False
    for n in range(1, MAX_ROWS + 1):
        if n in rows:
            last = n in winners
        if last:
            chosen.add(n)
    return frozenset(chosen)


def use_streaming_linears(model: nn.Module, packed: list[tuple[nn.Linear, tuple[nn.Linear, ...]]] = ()) -> frozenset[int]:
    """Switch every float ``nn.Linear`` of a CPU ``model`` to ``StreamingLinear`` with the row counts
    measured to gain (once per model: later calls return the first choice). Returns the chosen counts.

    ``packed``: products made by ``decoder.pack_projections`` (not submodules of ``model``), each with
    the modules it replaces; the timing reads the products a step runs, so the packed ones instead of
    their parts, and every one of them is switched."""
    chosen = getattr(model, "_streaming_rows", None)
    if chosen is not None:
        return chosen
    product_at = {id(parts[0]): product for product, parts in packed}
    replaced = {id(part) for _, parts in packed for part in parts}
    stepped = [product_at.get(id(m), m) for m in model.modules() if id(m) in product_at or id(m) not in replaced]

    def eligible(m: nn.Module) -> bool:
        return type(m) is nn.Linear and m.weight.device.type == "cpu" and m.weight.dtype == torch.float32

    timed = [m for m in stepped if eligible(m)]  # what a step runs, in model order
    linears = timed + [part for _, parts in packed for part in parts if eligible(part)]
    mode = os.environ.get("SPECCOMPILE_CPU_LINEAR", "auto").strip().lower()
    if mode not in ("auto", "standard", "streaming"):
        raise ValueError(f"SPECCOMPILE_CPU_LINEAR={mode!r}: use auto, standard or streaming")
    if mode == "standard" or not linears:
        chosen = frozenset()
    elif mode == "streaming":
        chosen = frozenset(range(1, MAX_ROWS + 1))
    else:
        weights = list(dict.fromkeys(m.weight for m in timed))  # tied weights: read once, as a step does
        chosen = choose_streaming_rows(weights)
    for module in linears:
        module.__class__ = StreamingLinear
        module.streaming_rows = chosen
    model._streaming_rows = chosen
    return chosen
