"""Linear layers for a few token rows on CPU: three forms of the same product, chosen by measurement.

Decoding and verifying multiply one to a few dozen token rows by every weight matrix, so a step is a
stream over the weights. ``F.linear(x, W)`` computes ``x @ W^T``, and how fast BLAS streams the weights
for one to sixteen rows depends on the CPU and the BLAS build:

- on some CPUs torch's MKL runs ``x @ W^T`` with one or two rows far below the memory bandwidth, where the
  same products written ``W @ x^T`` with at least two columns (the *streaming* form) run near it;
- on others ``F.linear`` streams one to three rows near the memory bandwidth but slows down from four rows
  on: MKL re-packs every weight on each call at those shapes. The *packed* form packs each weight once, at
  load, into MKL's own GEMM layout (``cblas_sgemm_pack`` through ``torch.ops.mkl._mkl_reorder_linear_weight``,
  what inductor's freezing pass uses) and multiplies by it (``cblas_sgemm_compute``), which keeps a
  k-row product close to a one-row one. A pack made for ``MAX_ROWS`` rows serves every count up to it
  (checked once per process, ``MklPack.missing``). At a real model's shapes its rows may also be
  batch-invariant (row i of a k-row product bitwise row i of the one-row product), so that a verify computes
  its positions' products exactly as plain decoding's steps do; on tiny test shapes they are not, so nothing
  relies on it. The pack is a second copy of each weight, in memory only (nothing is stored): the price of
  the form, which ``SPECCOMPILE_CPU_LINEAR=standard`` avoids.
- on others again MKL is slow at every count, while oneDNN, torch's other CPU GEMM library, multiplies by a
  weight it reordered once into its own blocked layout (``torch.ops.mkldnn._reorder_linear_weight`` and
  ``_linear_pointwise``, what inductor's freezing uses where MKL is absent), with little more time for 16 rows
  than for one. The packed form is therefore one of two packs, MKL's or oneDNN's, whichever is faster for the shape
  (``fastest_packs``).

The figures, CPU by CPU: docs/backends.md, "The torch backend on CPU", and docs/history.md, 'Figures behind
the code's constants'.

``use_streaming_linears`` times the forms on the model's own weights for each row count, once per weight
shape (cold, in model order, as a step reads them; the first few times the last-level cache's size of each
shape's weights, ``probe_weights``), and switches the model's ``nn.Linear`` modules to ``StreamingLinear``,
which applies its shape's winner per count. The choice is per shape because the forms rank differently by
shape: MKL's packed product can win on the tall matrices (q/k/v, gate/up, the head) and lose on the wide ones
(o, down) of the same model on the same CPU. Packs are kept only where they beat the other forms clearly
(``PACK_GAIN``): they double their weights' memory, so a pack made for a shape where it gains nothing is a copy
for nothing.
Every form computes the same dot products; like any change of kernel they may round differently, which the
near-tie rule of lossless greedy covers (docs/design.md section 6): a backend's plain and speculative decoding
always run the same modules.

``SPECCOMPILE_CPU_LINEAR=standard`` keeps ``F.linear`` everywhere; ``=streaming`` / ``=packed`` use that
form for every row count up to ``MAX_ROWS`` without timing. A choice timed once is kept for the machine
(``product_forms_store.py``), so every later load of the same shapes on it chooses the same.
"""

from __future__ import annotations

import os
import time

import torch
import torch.nn.functional as F
from torch import nn

from ...machine import last_level_cache_bytes
from .product_forms_store import FormsStore

MAX_ROWS = 16  # longest verify the choice covers (a lookup draft is at most 12 tokens); longer calls use F.linear
PROBE_ROWS = (1, 2, 3, 4, 8, 16)  # probed row counts (the others follow the probed count below them)
MODES = ("auto", "standard", "streaming", "packed")
# the packed form is kept for a row count when it is at most this much slower than the fastest other form: no
# slack, though one form for every count would keep a step and a verify on one kernel, because a margin lets the
# load-time timing's noise give a pack products it is much slower at, which costs plain decoding more than
# kernel agreement is worth (the near-tie rule covers a step and a verify on two kernels; figures: docs/backends.md,
# "The torch backend on CPU")
PACKED_PREFERENCE = 1.0
# ... but packs are made at all only where, at some probed count, the packed form takes at most this much of the
# best other form's time: a pack is a second copy of every weight, worth it where MKL re-packs per call, not for
# a few percent at one row (figures: docs/history.md, 'Figures behind the code's constants')
PACK_GAIN = 0.9
# the forms are timed on the first weights in model order up to this many bytes per byte of last-level cache
# (at least MIN_PROBE_BYTES): a stream that size runs at memory bandwidth as the whole model does, and the packs
# the timing makes are only that big
PROBE_CACHE_MULTIPLE, MIN_PROBE_BYTES = 4, 64 << 20
STREAMING_MARGIN = 0.9  # W @ x^T is kept for a row count when it is more than 10% faster than F.linear


class StreamingLinear(nn.Linear):
    """``nn.Linear`` that computes its product in the form chosen for the call's row count: the packed
    product (MKL's or oneDNN's) for the counts in ``packed_rows`` (when the module holds a current pack of its
    weight), ``W @ x^T`` (at least two columns) for those in ``streaming_rows``, ``F.linear`` otherwise.
    Created only by switching an ``nn.Linear``'s class."""

    streaming_rows: frozenset[int] = frozenset()
    packed_rows: frozenset[int] = frozenset()
    pack: "WeightPack | None" = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if x.dtype != self.weight.dtype:
            return F.linear(x, self.weight, self.bias)
        if rows in self.packed_rows and self.pack is not None and self.pack.fits(self.weight):
            return self.pack.product(x, self.weight, self.bias, rows)
        if rows in self.streaming_rows:
            return streaming_product(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


class WeightPack:
    """One weight in a GEMM library's own layout, made once for ``MAX_ROWS`` rows, and the product by it. It
    remembers which tensor it packed (storage and version): a module whose weight was replaced or changed in
    place since falls back to the other forms. Shared, not copied, by ``copy.deepcopy`` (the int8 twin copies
    the module tree). Subclasses say how to pack and multiply; ``missing`` says once per process why this
    torch build cannot (None when it can)."""

    kind = "pack"
    _missing: list[str | None]

    def __init__(self, weight: torch.Tensor):
        self.tensor = self.pack(weight.detach().contiguous())
        self.ptr, self.version = weight.data_ptr(), _version_of(weight)
        self.nbytes = weight.numel() * weight.element_size()  # about the pack's own size (measured in RSS)

    @staticmethod
    def pack(weight: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def product(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows: int) -> torch.Tensor:
        raise NotImplementedError

    def fits(self, weight: torch.Tensor) -> bool:
        return weight.data_ptr() == self.ptr and _version_of(weight) == self.version

    def __deepcopy__(self, memo) -> "WeightPack":
        return self

    @classmethod
    def missing(cls) -> str | None:
        """Why this torch build cannot use this pack, or None: its ops are missing, or a pack made for
        ``MAX_ROWS`` rows does not compute ``F.linear`` for fewer (checked once per process on random weights,
        bias included)."""
        if cls._missing:
            return cls._missing[0]
        reason = cls.unavailable()
        if reason is None:
            try:
                gen = torch.Generator().manual_seed(0)
                weight, bias = torch.randn(40, 24, generator=gen), torch.randn(40, generator=gen)
                layer = nn.Linear(24, 40)
                layer.weight.data, layer.bias.data = weight, bias
                layer.__class__ = StreamingLinear
                layer.packed_rows, layer.pack = frozenset(range(1, MAX_ROWS + 1)), cls(layer.weight)
                x = torch.randn(1, MAX_ROWS, 24, generator=gen)
                with torch.inference_mode():
                    for rows in (1, 2, 3, 5, MAX_ROWS):
                        if not torch.allclose(
                            layer(x[:, :rows]), F.linear(x[:, :rows], weight, bias), rtol=1e-4, atol=1e-5
                        ):
                            reason = f"{cls.kind}'s packed product disagrees with F.linear for {rows} rows"
                            break
            except Exception as exc:  # an op missing from this build, or the library refusing the call
                reason = f"{cls.kind} packing is unavailable ({str(exc).splitlines()[0][:100]})"
        cls._missing.append(reason)
        return reason

    @staticmethod
    def unavailable() -> str | None:
        return None


class MklPack(WeightPack):
    """MKL's packed GEMM layout (``cblas_sgemm_pack`` through ``torch.ops.mkl._mkl_reorder_linear_weight``)."""

    kind = "MKL"
    _missing: list[str | None] = []

    @staticmethod
    def pack(weight: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkl._mkl_reorder_linear_weight(weight, MAX_ROWS)

    def product(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows: int) -> torch.Tensor:
        # the call's own row count as the pack's batch size: MKL computes with the pack for any count up to the
        # one it was made for (checked once per process: missing)
        return torch.ops.mkl._mkl_linear(x, self.tensor, weight, bias, rows)

    @staticmethod
    def unavailable() -> str | None:
        return None if torch.backends.mkl.is_available() else "this torch build has no MKL"


class OneDnnPack(WeightPack):
    """oneDNN's blocked layout for an inner product (``torch.ops.mkldnn._reorder_linear_weight``, made for
    ``MAX_ROWS`` rows) and its product (``_linear_pointwise``, no fused activation)."""

    kind = "oneDNN"
    _missing: list[str | None] = []

    @staticmethod
    def pack(weight: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._reorder_linear_weight(weight, MAX_ROWS)

    def product(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows: int) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.tensor, bias, "none", [], "")

    @staticmethod
    def unavailable() -> str | None:
        return None if torch.backends.mkldnn.is_available() else "this torch build has no oneDNN"


PACK_KINDS: tuple[type[WeightPack], ...] = (MklPack, OneDnnPack)


def _version_of(weight: torch.Tensor) -> int | None:
    try:
        return weight._version
    except RuntimeError:  # an inference tensor keeps no version counter (nor can it change in place outside one)
        return None


def packing_missing() -> str | None:
    """Why this torch build has no packed form at all (neither pack kind works), or None."""
    reasons = [kind.missing() for kind in PACK_KINDS]
    return None if any(r is None for r in reasons) else "; ".join(reasons)


def available_pack_kinds() -> list[type[WeightPack]]:
    return [kind for kind in PACK_KINDS if kind.missing() is None]


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


def _follow_lower(winners: set[int], rows: tuple[int, ...]) -> frozenset[int]:
    """The chosen counts 1..MAX_ROWS: a count between two probed ones follows the lower one."""
    chosen, last = set(), False
    for n in range(1, MAX_ROWS + 1):
        if n in rows:
            last = n in winners
        if last:
            chosen.add(n)
    return frozenset(chosen)


@torch.inference_mode()
def choose_forms(
    weights: list[torch.Tensor],
    packs: list[WeightPack] | None = None,
    rows: tuple[int, ...] = PROBE_ROWS,
    repeats: int = 5,
    margin: float = STREAMING_MARGIN,
    preference: float = PACKED_PREFERENCE,
    gain: float = PACK_GAIN,
) -> tuple[frozenset[int], frozenset[int]]:
    """(row counts given ``W @ x^T``, row counts given the packed product), from 1..MAX_ROWS, timed over all
    of ``weights`` (``packs``: their packs, of one kind, in the same order; None: no packed form). Per probed count the
    forms run in turns, ``repeats`` times each, best time kept. ``W @ x^T`` is chosen where it beats
    ``F.linear`` by more than ``1 - margin``; the packed form where it takes at most ``preference`` times
    the faster of the other two forms, provided that at some probed count it takes at most ``gain`` times the best
    other form (else no count gets it: its packs are a second copy of the weights). A count between two
    probed ones follows the lower one."""
    if not weights:
        return frozenset(), frozenset()
    widths = {w.shape[1] for w in weights}
    inputs = {(n, k): torch.randn(n, k, dtype=weights[0].dtype) for n in rows for k in widths}

    def every_product(n: int, form: str) -> None:
        for i, w in enumerate(weights):
            x = inputs[n, w.shape[1]]
            if form == "packed":
                packs[i].product(x, w, None, n)
            elif form == "streaming":
                streaming_product(x, w)
            else:
                F.linear(x, w)

    forms = ("standard", "streaming") + (("packed",) if packs else ())
    for form in forms:  # warm-up (allocator, thread pool, each library's first call at these shapes)
        every_product(rows[0], form)
    streaming, packed, gains = set(), set(), []
    for n in rows:
        best = {form: float("inf") for form in forms}
        for _ in range(repeats):  # in turns, so that a slow moment of the machine does not fall on one form only
            for form in forms:
                best[form] = min(best[form], _seconds(lambda: every_product(n, form)))
        if best["streaming"] < margin * best["standard"]:
            streaming.add(n)
        # measured against the faster of the other two: where W @ x^T is faster than F.linear by less than the
        # margin it is still what the packed form must match (a pack measured against F.linear alone can be kept
        # where it is much slower than W @ x^T: docs/backends.md, "The torch backend on CPU")
        fastest_other = min(best["standard"], best["streaming"])
        if best.get("packed", float("inf")) <= preference * fastest_other:
            packed.add(n)
        gains.append(best.get("packed", float("inf")) / fastest_other)
    if not gains or min(gains) > gain:
        packed = set()
    return _follow_lower(streaming - packed, rows), _follow_lower(packed, rows)


@torch.inference_mode()
def fastest_packs(
    weights: list[torch.Tensor], rows: tuple[int, ...] = PROBE_ROWS, repeats: int = 3
) -> list[WeightPack] | None:
    """Packs of ``weights`` of the kind (``PACK_KINDS``: MKL's, oneDNN's) whose products take the least time
    over the probed row counts together (the kinds in turns, best of ``repeats``), or None where this torch
    build packs with neither. Why one kind per shape: each pack is a copy of the weights, and the kinds rank
    by CPU (MKL wins on some, oneDNN on others: docs/backends.md, "The torch backend on CPU")."""
    kinds = available_pack_kinds()
    if not kinds or not weights:
        return None
    candidates = {kind: [kind(w) for w in weights] for kind in kinds}
    if len(kinds) == 1:
        return candidates[kinds[0]]
    inputs = {(n, w.shape[1]): torch.randn(n, w.shape[1], dtype=w.dtype) for n in rows for w in weights}

    def every_product(packs: list[WeightPack]) -> float:
        start = time.perf_counter()
        for n in rows:
            for w, pack in zip(weights, packs):
                pack.product(inputs[n, w.shape[1]], w, None, n)
        return time.perf_counter() - start

    for packs in candidates.values():
        every_product(packs)  # warm-up: each library's first call sets up its kernels
    best = dict.fromkeys(kinds, float("inf"))
    for _ in range(repeats):
        for kind, packs in candidates.items():
            best[kind] = min(best[kind], every_product(packs))
    return candidates[min(kinds, key=best.__getitem__)]


def probe_weights(weights: list[torch.Tensor]) -> list[torch.Tensor]:
    """The first of ``weights`` (model order) that ``choose_forms`` times: ``PROBE_CACHE_MULTIPLE`` times the
    last-level cache's bytes (at least ``MIN_PROBE_BYTES``; all of them where the cache is not known). A first
    weight larger than that alone (a head over a large vocabulary) is timed on its first rows up to it: a view,
    and a pack of that size, not of the whole matrix."""
    cache = last_level_cache_bytes()
    if cache is None:
        return weights
    limit, total, chosen = max(PROBE_CACHE_MULTIPLE * cache, MIN_PROBE_BYTES), 0, []
    for w in weights:
        if total >= limit:
            break
        chosen.append(w)
        total += w.numel() * w.element_size()
    first = chosen[0] if chosen else None
    if len(chosen) == 1 and first.dim() == 2 and first.is_contiguous() and total > 2 * limit:
        rows = -(-limit // (first.shape[1] * first.element_size()))
        chosen = [first[:rows]]
    return chosen


def _by_shape(weights: list[torch.Tensor]) -> dict[tuple[int, ...], list[torch.Tensor]]:
    """``weights`` grouped by shape, each group in model order."""
    groups: dict[tuple[int, ...], list[torch.Tensor]] = {}
    for w in weights:
        groups.setdefault(tuple(w.shape), []).append(w)
    return groups


Forms = tuple[frozenset[int], frozenset[int]]  # (row counts given W @ x^T, row counts given the packed product)


def _kept_forms(
    store: FormsStore | None, shape: tuple[int, ...], dtype
) -> tuple[Forms, type[WeightPack] | None] | None:
    """This machine's kept choice for ``shape`` and its pack kind, or None (not kept, or its pack kind is missing
    from this process's torch: timed again)."""
    kept = store.get(shape, dtype) if store is not None else None
    if kept is None:
        return None
    streaming, packed, pack = kept
    if not packed:
        return (streaming, packed), None
    kind = next((k for k in PACK_KINDS if k.__name__ == pack), None)
    if kind is None or kind.missing() is not None:
        return None
    return (streaming, packed), kind


def use_streaming_linears(
    model: nn.Module, packed: list[tuple[nn.Linear, tuple[nn.Linear, ...]]] = ()
) -> frozenset[int]:
    """Switch every float ``nn.Linear`` of a CPU ``model`` to ``StreamingLinear`` with the product form per
    row count measured to be fastest for its weight's shape (once per model: later calls return the first
    choice). ``model._forms`` holds the choice per shape; ``model._streaming_rows`` and ``model._packed_rows``
    the counts some shape gives the streaming and the packed form (what is returned: the streaming ones), and
    ``model._packed_bytes`` what the packs take.

    ``packed``: products made by ``decoder.pack_projections`` (not submodules of ``model``), each with
    the modules it replaces; the timing reads the products a step runs, so the packed ones instead of
    their parts, and every one of them is switched (only what a step runs gets a pack; a part, run only
    where its product no longer applies, takes its product's choice without the pack)."""
    chosen = getattr(model, "_streaming_rows", None)
    if chosen is not None:
        return chosen
    product_at = {id(parts[0]): product for product, parts in packed}
    replaced = {id(part) for _, parts in packed for part in parts}
    stepped = [product_at.get(id(m), m) for m in model.modules() if id(m) in product_at or id(m) not in replaced]

    def eligible(m: nn.Module) -> bool:
        return type(m) is nn.Linear and m.weight.device.type == "cpu" and m.weight.dtype == torch.float32

    timed = [m for m in stepped if eligible(m)]  # what a step runs, in model order
    parts = [(part, product) for product, group in packed for part in group if eligible(part)]
    mode = os.environ.get("SPECCOMPILE_CPU_LINEAR", "auto").strip().lower()
    if mode not in MODES:
        raise ValueError(f"SPECCOMPILE_CPU_LINEAR={mode!r}: use one of {', '.join(MODES)}")
    weights = list(dict.fromkeys(m.weight for m in timed))  # tied weights: read once, as a step does
    groups = _by_shape(weights)
    every, nothing = frozenset(range(1, MAX_ROWS + 1)), frozenset()
    fixed = {"standard": (nothing, nothing), "streaming": (every, nothing), "packed": (nothing, every)}
    if mode == "packed" and (timed or parts):
        missing = packing_missing()
        if missing:
            raise ValueError(f"SPECCOMPILE_CPU_LINEAR=packed: {missing}; use auto or standard")
    forms: dict[tuple[int, ...], Forms] = {}
    kinds: dict[tuple[int, ...], type[WeightPack]] = {}  # the pack kind of each shape given the packed form
    timed_packs: dict[int, WeightPack] = {}  # packs the timing made of whole weights, kept where their shape wins
    store = FormsStore() if mode == "auto" else None  # this machine's earlier choices (product_forms_store.py)
    for shape, group in groups.items():
        if mode not in ("auto", "packed"):
            forms[shape] = fixed[mode]
            continue
        kept = _kept_forms(store, shape, group[0].dtype)
        if kept is not None:
            forms[shape], kind = kept
            if kind is not None:
                kinds[shape] = kind
            continue
        probed = probe_weights(group)
        candidates = fastest_packs(probed) or []
        forms[shape] = fixed[mode] if mode == "packed" else choose_forms(probed, candidates or None)
        if forms[shape][1]:
            kinds[shape] = type(candidates[0])
            whole = {id(w) for w in group}
            timed_packs.update({id(w): pack for w, pack in zip(probed, candidates) if id(w) in whole})
        if store is not None:
            store.put(shape, group[0].dtype, *forms[shape], kinds[shape].__name__ if shape in kinds else None)
        del candidates  # the packs of shapes where they lost are dropped here, never all made
    if store is not None:
        store.save()
    packs = {
        id(w): timed_packs.get(id(w)) or kinds[tuple(w.shape)](w) for w in weights if forms[tuple(w.shape)][1]
    }  # the packs chosen: every weight of a shape that gets the packed form
    del timed_packs
    for module in timed:
        module.__class__ = StreamingLinear
        module.streaming_rows, module.packed_rows = forms[tuple(module.weight.shape)]
        module.pack = packs.get(id(module.weight))
    for part, product in parts:
        part.__class__ = StreamingLinear
        part.streaming_rows, part.packed_rows = forms.get(tuple(product.weight.shape), fixed["standard"])
        part.pack = None
    model._forms = forms
    model._streaming_rows = frozenset().union(*(f[0] for f in forms.values()))
    model._packed_rows = frozenset().union(*(f[1] for f in forms.values()))
    model._packed_bytes = sum(pack.nbytes for pack in packs.values())
    return model._streaming_rows
