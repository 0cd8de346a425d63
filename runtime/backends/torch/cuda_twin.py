"""The int8 twin's products on a GPU (``int8_twin.py`` makes the twin; this module makes its products where the
decoder's weights are on a CUDA device): weight-only int8, and fp8 where the device has fp8 products.

Why not the CPU twin's dynamic int8: a draft step on a GPU multiplies one to a few token rows by every weight,
so it is bound by reading the weights, and a product's cost is its weight bytes plus the kernels around it;
torch's CUDA builds have no dynamic-int8 product (fbgemm / oneDNN are CPU libraries). What they have:

- ``torch._weight_int8pack_mm`` (not every torch build has its CUDA kernel: ``weight_int8_missing`` asks the
  dispatcher and runs it once, never reads the version): the weight int8 per output channel, the activation in
  the model's dtype, one call, half the bytes of a bfloat16 weight. Activations are not quantized, so the draft
  is close to the model (int8 weight rounding only). Its kernel is a plain float32 reduction (no tensor cores,
  the activation and output cast around it), so half the bytes need not make it faster than cuBLAS's bfloat16
  product.
- ``torch._scaled_mm`` (fp8 e4m3 x e4m3 on tensor cores, compute capability 8.9 or later): the weight in fp8
  per output channel, the activation quantized per call (its row's largest magnitude to 448: a norm, a divide,
  a cast; no padding: only the inner and output sizes must be multiples of 16). Per-row scales where this torch
  and device take them (``rowwise_scales``, probed), else a per-tensor activation scale and the weight's
  channel scales applied to the output. A coarser draft than int8 weight-only (3 mantissa bits on both
  operands), on cuBLAS's tuned kernels, with three small kernels before each product.
- not candidates: ``torch._int_mm`` (cuBLAS int8 x int8) takes only more than 16 rows and its activation
  quantized by separate kernels, a padded 17-row product per draft step; an eager ``F.linear(x, W.to(bf16)) * s``
  writes a bfloat16 copy of each weight per call, slower than the model's own product (gpt-fast's int8 relies on
  torch.compile fusing that cast, a compile a runtime that opens in seconds does not pay for).

Which is fastest depends on the shape: the quantized forms halve the bytes read but add kernels (fp8) or give up
tensor cores (int8), so on small matrices, where a product costs little more than its launches, the model's
own product may win, and on large ones (the head, gate/up) the halved bytes. No fixed ranking holds across GPUs
and torch builds, so the twin's form is chosen when it is made, by what the device offers
(``weight_int8_missing``, ``fp8_missing``) and then by measurement (``choose``): for each weight shape the
available forms and the model's own product are timed at one row (a draft step) on enough of the model's
weights of that shape to overflow the L2 cache (a step reads each weight once, from memory), replayed from a
CUDA graph as the backend replays its steps, and the fastest is kept, the closer draft on a tie (the model's
own product, then weight-only). A shape where no quantized form beats the model's own product keeps the model's product
(exact, no slower): a draft step is never slower than a plain step for want of a kernel. Any form is exact
enough to draft: the full model verifies every token, so output equals plain decoding whatever the twin
computes; only acceptance depends on the form.

Neither form uses the SmoothQuant scales an artifact may carry (``int8_twin.set_input_scales``): they exist
because one int8 scale per activation row crushes the channels beside an outlier; weight-only products leave
activations alone, and fp8's exponent keeps small channels representable beside a large one.

``int8_twin.set_twin_lowering`` names one form for every product instead (``weight-only``, ``fp8``), on any device whose torch
has the op: both ops have CPU kernels, which is how this module is tested without a GPU.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

E4M3_MAX = 448.0  # the largest finite float8_e4m3fn
INT8_MAX = 127.0
LOWERINGS = ("auto", "weight-only", "fp8")
PROBE_PASSES = 4  # passes over a shape's probed weights per timed replay in ``choose``
PROBE_TURNS = 5  # timed replays per form (the median is kept)
PROBE_CACHE_MULTIPLE = 4  # a shape is timed on at least this many L2 caches' worth of its weights (or all)


def _kernel_key(device: torch.device) -> str:
    return "CUDA" if device.type == "cuda" else "CPU"


def _has_kernel(op: str, device: torch.device) -> bool:
    if not hasattr(torch.ops.aten, op):
        return False
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{op}", _kernel_key(device))


@functools.cache
def _int8_probe(device: torch.device, dtype: torch.dtype) -> str | None:
    try:
        out = torch._weight_int8pack_mm(
            torch.ones(2, 32, device=device, dtype=dtype),
            torch.ones(16, 32, device=device, dtype=torch.int8),
            torch.full((16,), 0.5, device=device, dtype=dtype),
        )
    except (RuntimeError, TypeError, NotImplementedError) as exc:
        return f"torch._weight_int8pack_mm does not run on {device} in {dtype}: {str(exc).splitlines()[0][:160]}"
    if not bool((out.float() == 16).all()):
        return f"torch._weight_int8pack_mm on {device} does not compute a product of ones correctly"
    return None


def _indexed(device: torch.device) -> torch.device:
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def weight_int8_missing(device: "str | torch.device", dtype: torch.dtype = torch.float32) -> str | None:
    """Why this torch build cannot run weight-only int8 products on ``device`` with ``dtype`` activations, or
    None: the op's kernel for the device, then one small product run there."""
    device = torch.device(device)
    if not _has_kernel("_weight_int8pack_mm", device):
        return (
            f"torch {torch.__version__} has no {_kernel_key(device)} kernel for _weight_int8pack_mm "
            "(weight-only int8 products)"
        )
    return _int8_probe(_indexed(device), dtype)


@functools.cache
def _fp8_probe(device: torch.device) -> str | None:
    try:
        a = torch.ones(2, 32, device=device).to(torch.float8_e4m3fn)
        b = torch.ones(16, 32, device=device).to(torch.float8_e4m3fn).t()
        one = torch.ones((), device=device)
        out = torch._scaled_mm(a, b, one, one, out_dtype=torch.float32)
    except (RuntimeError, TypeError, NotImplementedError) as exc:
        return f"torch._scaled_mm does not run on {device}: {str(exc).splitlines()[0][:160]}"
    if not bool((out == 32).all()):
        return f"torch._scaled_mm on {device} does not compute a product of ones correctly"
    return None


def fp8_missing(device: "str | torch.device") -> str | None:
    """Why ``device`` cannot run the fp8 products, or None: the dtype and ``_scaled_mm``'s kernel in this torch,
    on CUDA a compute capability of 8.9 or later (fp8 tensor cores), then one small product run there."""
    device = torch.device(device)
    if not hasattr(torch, "float8_e4m3fn") or not _has_kernel("_scaled_mm", device):
        return f"torch {torch.__version__} has no {_kernel_key(device)} kernel for fp8 products (_scaled_mm)"
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            return f"compute capability {major}.{minor} has no fp8 tensor cores (8.9 or later has)"
    return _fp8_probe(_indexed(device))


@functools.cache
def rowwise_scales(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``_scaled_mm`` takes per-row activation and per-column weight scales with ``dtype`` out on
    ``device`` (newer torch and Hopper-class GPUs do; older ones take one scale per operand), tried once."""
    try:
        a = torch.ones(2, 32, device=device).to(torch.float8_e4m3fn)
        b = torch.ones(16, 32, device=device).to(torch.float8_e4m3fn).t()
        out = torch._scaled_mm(
            a, b, torch.full((2, 1), 2.0, device=device), torch.full((1, 16), 0.5, device=device), out_dtype=dtype
        )
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    return bool((out.float() == 32).all())


def cuda_precision_missing(device: "str | torch.device", scheme: str, dtype: torch.dtype = torch.float32) -> str | None:
    """Why the torch backend cannot run a ``scheme`` precision draft on ``device`` (a CUDA device) for a model in
    ``dtype``, in one line, or None: an int8 draft runs where weight-only int8 or fp8 products do."""
    if scheme != "int8":
        return (
            f"{scheme} precision drafts run on ONNX Runtime only (the torch twin's GPU products are int8 weight-only "
            "or fp8); use an int8 precision draft on torch"
        )
    int8, fp8 = weight_int8_missing(device, dtype), fp8_missing(device)
    if int8 is None or fp8 is None:
        return None
    return f"no int8 precision draft on {device}: {int8}; {fp8}"


def _per_channel(weight: torch.Tensor, top: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight / scale, scale) in float32, the scale per output row mapping its largest magnitude to ``top``."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / top).clamp(min=torch.finfo(torch.float32).tiny)
    return w / scale[:, None], scale


class WeightOnlyInt8Linear(nn.Module):
    """``F.linear(x, W, b)`` with ``W`` int8 per output channel (symmetric) and ``x`` as it comes (the model's
    dtype): ``torch._weight_int8pack_mm``. The scales have ``x``'s dtype, as the op's CPU kernel requires."""

    form = "weight-only"

    def __init__(self, linear: nn.Linear, device: torch.device, dtype: torch.dtype):
        super().__init__()
        scaled, scale = _per_channel(linear.weight.to(device), INT8_MAX)
        self.weight = scaled.round_().clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)  # not registered: the twin's own
        self.scales = scale.to(dtype)
        self.bias = None if linear.bias is None else linear.bias.detach().to(device, dtype)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.nbytes = self.weight.numel() + self.scales.numel() * self.scales.element_size()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.dtype != self.scales.dtype:
            rows = rows.to(self.scales.dtype)
        out = torch._weight_int8pack_mm(rows.contiguous(), self.weight, self.scales)
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features).to(x.dtype)


class Fp8Linear(nn.Module):
    """``F.linear(x, W, b)`` with ``W`` in float8 e4m3 per output channel and ``x`` quantized to e4m3 per call
    (per row where ``rowwise_scales``, else per call), through ``torch._scaled_mm``; the output has ``x``'s
    dtype."""

    form = "fp8"

    def __init__(self, linear: nn.Linear, device: torch.device, dtype: torch.dtype):
        super().__init__()
        scaled, scale = _per_channel(linear.weight.to(device), E4M3_MAX)
        # _scaled_mm takes its second operand column-major: the [in, out] transpose of the row-major weight
        self.weight_t = scaled.to(torch.float8_e4m3fn).t()
        self.rowwise = rowwise_scales(device, dtype)
        self.weight_scale = scale[None, :].contiguous() if self.rowwise else scale.to(dtype)
        self.one = torch.ones((), device=device)
        self.bias = None if linear.bias is None else linear.bias.detach().to(device, dtype)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.nbytes = self.weight_t.numel() + 4 * scale.numel()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.rowwise:
            amax = torch.linalg.vector_norm(rows, float("inf"), dim=1, keepdim=True, dtype=torch.float32)
        else:
            amax = torch.linalg.vector_norm(rows, float("inf"), dtype=torch.float32)
        scale = amax.clamp_(min=1e-12).div_(E4M3_MAX)  # all on the device: no host read, graph-safe
        quantized = (rows / scale).to(torch.float8_e4m3fn)
        if self.rowwise:
            out = torch._scaled_mm(quantized, self.weight_t, scale, self.weight_scale, out_dtype=x.dtype)
        else:
            out = torch._scaled_mm(quantized, self.weight_t, scale, self.one, out_dtype=x.dtype) * self.weight_scale
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)


FORMS: dict[str, type[nn.Module]] = {"weight-only": WeightOnlyInt8Linear, "fp8": Fp8Linear}


def fits(form: str, linear: nn.Linear) -> bool:
    """Whether ``form`` takes ``linear``'s shape (``_scaled_mm`` on CUDA: inner and output sizes multiples of
    16)."""
    if form == "fp8" and linear.weight.device.type == "cuda":
        return linear.in_features % 16 == 0 and linear.out_features % 16 == 0
    return True


def available_forms(device: "str | torch.device", dtype: torch.dtype = torch.float32) -> list[str]:
    """The quantized forms ``device`` runs for a model in ``dtype``, the closer draft first."""
    return [
        form
        for form, missing in (("weight-only", weight_int8_missing(device, dtype)), ("fp8", fp8_missing(device)))
        if missing is None
    ]


def _replay_seconds(products: list[nn.Module], x: torch.Tensor) -> float:
    """Seconds per product of ``x`` through each of ``products`` in turn, ``PROBE_PASSES`` times, captured in one
    CUDA graph (the backend replays its steps; a capture that fails times them launched): the median of
    ``PROBE_TURNS`` replays."""
    with torch.inference_mode():
        for product in products:  # lazy initialisation (cuBLAS workspaces, kernels) before the capture
            product(x)
        torch.cuda.synchronize(x.device)

        def calls():
            for _ in range(PROBE_PASSES):
                for product in products:
                    product(x)

        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                calls()
            run = graph.replay
        except RuntimeError:
            run = calls
        run()
        times = []
        for _ in range(PROBE_TURNS):
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop) / 1e3 / (PROBE_PASSES * len(products)))
    return sorted(times)[len(times) // 2]


def probe_set(linears: list[nn.Linear]) -> list[nn.Linear]:
    """The first of ``linears`` (one shape, model order) whose weights together exceed ``PROBE_CACHE_MULTIPLE``
    times the GPU's L2 cache, or all of them: a product timed on one small weight again and again reads it from
    L2, where a step reads each weight once from memory."""
    device = linears[0].weight.device
    cache = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 64 << 20
    chosen, size = [], 0
    for linear in linears:
        chosen.append(linear)
        size += linear.weight.numel() * linear.weight.element_size()
        if size > PROBE_CACHE_MULTIPLE * cache:
            break
    return chosen


def choose(linears: list[nn.Linear], forms: list[str], dtype: torch.dtype) -> dict[tuple[int, int], str]:
    """For each weight shape among ``linears`` (on a CUDA device), the fastest of ``forms`` and the model's own
    product (``"dense"``) on one token row, timed on the model's weights of that shape (``probe_set``,
    ``_replay_seconds``), the forms in turns so that a drifting clock weighs on all alike; on a tie the closer
    draft (the model's own, then weight-only)."""
    by_shape: dict[tuple[int, int], list[nn.Linear]] = {}
    for linear in linears:
        by_shape.setdefault((linear.out_features, linear.in_features), []).append(linear)
    chosen = {}
    for shape, same in by_shape.items():
        probed = probe_set(same)
        device = probed[0].weight.device
        x = torch.randn(1, shape[1], device=device, dtype=dtype)
        candidates = {"dense": probed}
        for form in forms:
            if fits(form, probed[0]):
                candidates[form] = [FORMS[form](linear, device, dtype) for linear in probed]
        best = {name: float("inf") for name in candidates}
        for _ in range(2):
            for name, products in candidates.items():
                best[name] = min(best[name], _replay_seconds(products, x))
        chosen[shape] = min(best, key=best.get)
        del candidates
    return chosen


def device_product(decoder: nn.Module, lowering: str = "auto"):
    """The ``product(linear, outliers)`` that ``int8_twin.twin_with`` applies to each of ``decoder``'s products:
    ``lowering`` one form for all (``weight-only`` or ``fp8``), or ``auto``: on CUDA the form ``choose`` measured
    fastest for the product's shape among those the device runs. Products are made on the decoder's device with
    its dtype; a product no form takes (``fits``) and a shape where the model's own product was fastest stay the
    model's own module."""
    if lowering not in LOWERINGS:
        raise ValueError(f"twin lowering {lowering!r} must be one of {', '.join(LOWERINGS)}")
    device, dtype = decoder.embed.weight.device, decoder.embed.weight.dtype
    if lowering != "auto":
        missing = weight_int8_missing(device, dtype) if lowering == "weight-only" else fp8_missing(device)
        if missing:
            raise RuntimeError(missing)
        forms, chosen = [lowering], None
    else:
        forms, chosen = available_forms(device, dtype), None
        if not forms:
            raise RuntimeError(cuda_precision_missing(device, "int8", dtype))
        # timing synchronizes the device, which a CUDA graph being captured forbids: a twin first made inside a
        # captured round (the backend makes it at load, ``prepare``) takes the closer form everywhere
        if device.type == "cuda" and not torch.cuda.is_current_stream_capturing():
            linears = [m for m in decoder.modules() if isinstance(m, nn.Linear)]
            linears += [
                module.__dict__[name][0]
                for module in decoder.modules()
                for name in ("_qkv", "_gate_up")
                if name in module.__dict__
            ]
            chosen = choose(linears, forms, dtype)

    def product(linear: nn.Linear, outliers: bool = False) -> nn.Module:
        form = forms[0] if chosen is None else chosen[(linear.out_features, linear.in_features)]
        if form != "dense" and not fits(form, linear):
            form = next((f for f in forms if fits(f, linear)), "dense")
        return linear if form == "dense" else FORMS[form](linear, device, dtype)

    product.forms = forms
    product.chosen = chosen
    return product


__all__ = [
    "E4M3_MAX",
    "FORMS",
    "Fp8Linear",
    "LOWERINGS",
    "WeightOnlyInt8Linear",
    "available_forms",
    "choose",
    "cuda_precision_missing",
    "device_product",
    "fits",
    "fp8_missing",
    "rowwise_scales",
    "weight_int8_missing",
]
