"""PyTorch backend: the canonical decoder (or the generic path's) on a static KV cache.

It runs segments (``runtime/segments.py``) and knows nothing of draft plans: draft kinds
(``runtime/drafting/kinds/``) say which segments a draft step and a verify run. The cache is one
``KVCache`` plus a hidden-state buffer ``[1, max_len, d]`` for segments that keep their output
(early-exit prefix reuse); rollback is only a smaller position next time.

CUDA graphs (on by default on a CUDA device; ``cuda_graphs=False`` or ``SPECCOMPILE_CUDA_GRAPHS=0`` turns
them off): every segment of up to ``GRAPH_TOKENS`` tokens that ends in the shared head (or in none), and
every token tree's verify, is captured once and replayed (``runtime/backends/torch/graphs.py``), through
the same decoder with tensor positions; prompts run eagerly. Why the default: a small model's step replayed
from a graph runs several times faster than the same step launched eagerly (``benchmarks/gpu_check.sh``;
measured: docs/history.md, 'Figures behind the code's constants'), and the build tunes with the backend the
runtime opens, so its plan is chosen for graphed steps. On CPU
the flag is ignored and every call runs eagerly.

Rounds on the device (``runtime/backends/torch/device_round.py``, ``device_plain.py``): on CUDA a lone
sequence's speculative round keeps its lookup, drafted tokens and acceptance on the GPU, captured as one CUDA
graph per round shape, with one host read per round; plain decoding picks its tokens on the GPU and reads them
in blocks (``device_round``). Every round on CPU runs on the host, where it runs as fast or faster
(``round_on_device=True`` or ``SPECCOMPILE_DEVICE_ROUND=1`` forces the device round anywhere, ``0`` turns it
off).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch
from safetensors.torch import load_file

from ...artifact.draft_head_file import DraftHead, load_draft_head
from ...artifact.manifest import ArchConfig
from ...errors import ArtifactError, BackendUnavailableError
from ...segments import FINAL_HEAD, Row, Segment
from ..base import Backend
from ..window_shape import WindowShape
from .cpu_linear import use_streaming_linears
from .decoder import Decoder, KVCache, Positions, build_decoder, pack_projections, run_segment
from .int8_twin import int8_kernel_missing, int8_twin, set_input_scales

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
GRAPH_TOKENS = 32  # longest step replayed from a CUDA graph (verify rounds); longer ones (prompts) run eagerly
GRAPH_CACHE_STEP = 256  # with graphs on, caches grow in these steps: a new cache means recapturing every graph
# Batch sizes whose batched calls replay CUDA graphs: a batch pads to the first bucket that holds it (its pad rows
# write past every sequence's end), so a few graphs per width serve every batch, as vLLM's decode graphs do. With
# graphs on, the cache's slots grow to a bucket too (fewer recaptures as a batch grows).
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def batch_bucket(n: int) -> int | None:
    """The smallest bucket of ``BATCH_BUCKETS`` that holds ``n`` rows, or None (the batch runs eagerly)."""
    return next((b for b in BATCH_BUCKETS if b >= n), None)


def device_round_requested() -> bool | None:
    """``SPECCOMPILE_DEVICE_ROUND``: 1 the device round everywhere, 0 never, unset on CUDA only (None)."""
    value = os.environ.get("SPECCOMPILE_DEVICE_ROUND", "").strip().lower()
    return None if value in ("", "auto") else value in ("1", "true", "yes", "on")


def cuda_graphs_requested() -> bool:
    """``SPECCOMPILE_CUDA_GRAPHS``: CUDA graphs on a CUDA device unless it says 0 (or false, no, off)."""
    return os.environ.get("SPECCOMPILE_CUDA_GRAPHS", "1").strip().lower() not in ("0", "false", "no", "off")


def check_device(device: str) -> None:
    """A one-line error for a device PyTorch cannot use, instead of its AssertionError / RuntimeError."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        raise BackendUnavailableError(f"unknown device {device!r}; use cpu, cuda or cuda:N") from None
    if parsed.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (parsed.index or 0) >= count:
            raise BackendUnavailableError(
                f"device {device!r} needs a CUDA GPU that PyTorch can see (it sees {count}); use --device cpu"
            )
    elif parsed.type != "cpu":
        raise BackendUnavailableError(f"device {device!r} is not supported by the torch backend; use cpu or cuda")


class TorchBackend(Backend):
    name = "torch"

    def __init__(
        self,
        decoder: Decoder,
        device: str | None = None,
        cuda_graphs: bool | None = None,
        capture: Callable | None = None,
        round_on_device: bool | None = None,
    ):
        """``cuda_graphs`` replays fixed-shape steps from CUDA graphs when ``device`` is CUDA (ignored on CPU; None:
        as ``SPECCOMPILE_CUDA_GRAPHS`` says, on unless it is 0). ``capture`` replaces the graph capture
        (``graphs.eager_capture`` runs the same static steps without graphs, on any device: how the bookkeeping is
        tested on CPU). ``round_on_device``: speculative rounds stay on the device (``device_round``); None: on CUDA
        only, or as ``SPECCOMPILE_DEVICE_ROUND`` says."""
        self.decoder = decoder
        self.config: ArchConfig = decoder.config
        self.device = device or str(decoder.embed.weight.device)  # default: wherever the weights are
        self.dtype = decoder.embed.weight.dtype
        self.slot_cache: KVCache | None = None  # [layers, slots, kv_heads, max_len, head_dim]
        self.slot_hidden: torch.Tensor | None = None  # [slots, max_len, d]: hidden states kept by early exits
        self.cache: KVCache | None = None  # slot 0's view (the single-sequence calls and their graphs)
        self.hidden: torch.Tensor | None = None
        self.max_len, self.slots = 0, 0
        self.reach = 0  # the longest length reserved: no sequence's KV lies past it
        self.cuda_graphs = cuda_graphs_requested() if cuda_graphs is None else cuda_graphs
        self._capture = capture
        self.round_on_device = device_round_requested() if round_on_device is None else round_on_device
        self.static = None  # graphs.StaticSteps over the current cache, when graphs are on
        self.draft_heads: dict[str, tuple[DraftHead, TorchDraftHead]] = {}  # draft head file -> kernel
        self.draft_window = WindowShape()  # how much of a long past a precision draft attends to (window_shape.py)
        if torch.device(self.device).type == "cpu":
            # q/k/v and gate/up as one product each, then the faster CPU form of small-row products,
            # measured on the products a step runs (runtime/backends/torch/cpu_linear.py)
            packed = pack_projections(decoder) if isinstance(decoder, Decoder) else []
            use_streaming_linears(decoder, packed)

    @property
    def graphed(self) -> bool:
        if getattr(self.decoder, "whole_blocks", False):  # the generic path runs eagerly
            return False
        return self._capture is not None or (self.cuda_graphs and torch.device(self.device).type == "cuda")

    @property
    def reuses_prefix(self) -> bool:
        return getattr(self.decoder, "prefix_reuse", True)

    @classmethod
    def from_files(
        cls,
        weights_path: Path,
        config: ArchConfig,
        dtype: str = "float32",
        device: str = "cpu",
        cuda_graphs: bool | None = None,
        int8_scales: Path | None = None,
    ):
        """``int8_scales``: the int8 twin's SmoothQuant scales
        (``runtime/backends/torch/int8_twin.set_input_scales``)."""
        weights = load_file(str(weights_path), device="cpu")  # a private memory map of the file
        graphs = cuda_graphs_requested() if cuda_graphs is None else cuda_graphs
        # on CPU the decoder holds the mapped tensors themselves (pages read from the file as a step first
        # needs them, and shared with the page cache): a copy would hold the weights twice while loading
        # (measured: docs/history.md, 'Figures behind the code's constants'); the products packed at load drop
        # the pages they replace (decoder.pack_projections)
        on_cpu = torch.device(device).type == "cpu"
        decoder = build_decoder(config, weights, dtype=DTYPES[dtype], device=device, copy=not on_cpu)
        backend = cls(decoder, device=device, cuda_graphs=graphs)
        if int8_scales is not None:
            set_input_scales(backend.decoder, load_file(str(int8_scales), device="cpu"))
        return backend

    def replica(self) -> "TorchBackend":
        """Another backend over the same weights with its own KV cache (one per concurrent sequence)."""
        other = TorchBackend(
            self.decoder,
            device=self.device,
            cuda_graphs=self.cuda_graphs,
            capture=self._capture,
            round_on_device=self.round_on_device,
        )
        other.draft_heads = self.draft_heads
        return other

    def reserve(self, max_len: int, slots: int = 1) -> None:
        """Make sure the static cache holds ``max_len`` positions for ``slots`` sequences; reuse it across
        requests (growing keeps what it held, so a batch can take a longer request). With graphs on, the
        cache grows in steps of ``GRAPH_CACHE_STEP`` (a new cache invalidates every graph). ``cache`` and
        ``hidden`` are slot 0's views, which the single-sequence calls (and their graphs) use."""
        if not self.batched:  # the generic path: transformers' own cache, one sequence
            if self.cache is None or self.cache.max_len < max_len:
                self.cache = self.decoder.new_cache(max_len, dtype=self.dtype, device=self.device)
                self.hidden = torch.zeros(1, max_len, self.config.hidden_size, dtype=self.dtype, device=self.device)
            self.max_len, self.slots = max_len, 1
            return
        have = self.slot_cache.max_len if self.slot_cache is not None else 0
        have_slots = self.slot_cache.k.shape[1] if self.slot_cache is not None else 0
        self.reach = max(self.reach, max_len)
        if have < max_len or have_slots < slots:
            size = max(max_len, have)
            count = max(slots, have_slots, 1)
            if self.graphed:  # room for the pad rows of a graphed batch past every sequence's end
                size = max(size, min(self.reach + GRAPH_TOKENS, self.config.max_position_embeddings))
                rounded = -(-size // GRAPH_CACHE_STEP) * GRAPH_CACHE_STEP
                size = max(size, min(rounded, self.config.max_position_embeddings))
                count = batch_bucket(count) or count
            old, old_hidden = self.slot_cache, self.slot_hidden
            self.slot_cache = KVCache(self.config, size, batch=count, dtype=self.dtype, device=self.device)
            self.slot_hidden = torch.zeros(count, size, self.config.hidden_size, dtype=self.dtype, device=self.device)
            if old is not None:
                self.slot_cache.k[:, :have_slots, :, :have] = old.k
                self.slot_cache.v[:, :have_slots, :, :have] = old.v
                self.slot_hidden[:have_slots, :have] = old_hidden
            self.cache, self.hidden = self.slot_cache.view(0), self.slot_hidden[0:1]
            self.static = self._static_steps() if self.graphed else None
        self.max_len = max_len
        self.slots = self.slot_cache.k.shape[1]

    def move_slot(self, source: int, target: int, length: int) -> None:
        """Copy slot ``source``'s cache below ``length`` into slot ``target`` (a batch keeps its sequences in
        the first slots)."""
        with torch.inference_mode():
            for buf in (self.slot_cache.k, self.slot_cache.v):
                buf[:, target, :, :length] = buf[:, source, :, :length]
            self.slot_hidden[target, :length] = self.slot_hidden[source, :length]

    def _static_steps(self):
        from .graphs import StaticSteps, cuda_capture_with

        capture = self._capture or cuda_capture_with(torch.cuda.graph_pool_handle())
        return StaticSteps(
            self.decoder, self.cache, self.hidden, capture, max_tokens=GRAPH_TOKENS, slot_cache=self.slot_cache
        )

    # -- the backend interface ---------------------------------------------------------------------
    @torch.inference_mode()
    def run(
        self, segment: Segment, pos: int, tokens: Sequence[int] | None = None, count: int = 0, last_only: bool = False
    ) -> np.ndarray | None:
        """``last_only``: the head on the last token alone, one row of logits (``Row.last_only``)."""
        ids = torch.tensor(list(tokens), dtype=torch.long, device=self.device) if segment.from_tokens else None
        out = self.run_tensor(segment, pos, ids, count, last_only)
        return None if out is None else out.float().cpu().numpy()

    @torch.inference_mode()
    def run_tensor(
        self, segment: Segment, pos: int, ids: torch.Tensor | None = None, count: int = 0, last_only: bool = False
    ) -> torch.Tensor | None:
        """``run`` on device tensors, reading nothing back: token ids ``[T]`` (long, on this device) when
        the segment starts at block 0; the logits ``[T, vocab]`` stay on the device (the model's dtype; a
        draft head's over the whole vocabulary, ``-inf`` outside its own)."""
        t = ids.shape[0] if segment.from_tokens else count
        if (
            self.static is not None
            and self.static.fits(t)
            and segment.head in (None, FINAL_HEAD)
            and not segment.precision
        ):
            out = self.static.run(segment, pos, ids, t)
        else:
            decoder, head = self.decoder_and_head(segment)
            where = None
            shape = self.draft_window
            windowed = isinstance(decoder, Decoder) and segment.precision and segment.from_tokens
            if windowed and pos >= shape.min_context and t < shape.margin:
                # a model draft far into its context attends to the sinks and the last ``window`` positions
                where = Positions.windowed(pos, t, self.device, shape.sinks, pos - shape.window)
            out = run_segment(
                decoder,
                segment,
                None if ids is None else ids.view(1, -1),
                pos,
                self.cache,
                self.hidden,
                head,
                count,
                where=where,
                last_only=last_only and isinstance(decoder, Decoder),
            )
        return None if out is None else out[0]

    def decoder_and_head(self, segment: Segment):
        """The decoder ``segment`` runs on (the int8 twin for a precision segment, made once per decoder) and the
        head that ends it (the shared one, or its draft head over the whole vocabulary)."""
        decoder = int8_twin(self.decoder) if segment.precision else self.decoder
        head = decoder.head if segment.head in (None, FINAL_HEAD) else self._draft_head(segment.head)[1].full_logits
        return decoder, head

    rows_in_one_call = True  # rows of a batched call share it, packed (Positions.packed_rows; trees pad)

    @property
    def batched(self) -> bool:  # type: ignore[override]
        """The canonical decoder batches rows; the generic path (transformers' own modules) runs one sequence."""
        return isinstance(self.decoder, Decoder)

    @property
    def slots_copy(self) -> bool:  # type: ignore[override]
        """The slots are one static cache with a slot dimension (the canonical decoder): ``move_slot`` copies."""
        return self.batched

    @torch.inference_mode()
    def run_rows(self, segment: Segment, rows: Sequence[Row]) -> list[np.ndarray | None]:
        """``run`` on several sequences: rows in consecutive slots run as one call (per-row positions, masks
        and KV writes, ``Positions.rows``), so the weights are read once for all of them; slot 0 alone takes
        the single-sequence path (its CUDA graphs)."""
        if not self.batched:
            return super().run_rows(segment, rows)
        results: list[np.ndarray | None] = [None] * len(rows)
        order = sorted(range(len(rows)), key=lambda i: rows[i].slot)
        groups: list[list[int]] = []
        for i in order:
            if groups and rows[groups[-1][-1]].slot == rows[i].slot - 1:
                groups[-1].append(i)
            else:
                groups.append([i])
        for group in groups:
            members = [rows[i] for i in group]
            if len(members) == 1 and members[0].slot == 0:
                row = members[0]
                if row.parents is not None:
                    logits = [self.forward_tree(row.tokens, row.parents, row.pos)]
                else:
                    logits = [self.run(segment, row.pos, row.tokens, row.count, row.last_only)]
            else:
                logits = self._run_group(segment, members)
            for i, out in zip(group, logits):
                results[i] = out
        return results

    def _run_group(self, segment: Segment, rows: list[Row]) -> list[np.ndarray | None]:
        n, width, first = len(rows), max(row.width for row in rows), rows[0].slot
        reach = max(row.pos for row in rows) + width  # a short row's pads write past its tokens
        if reach > self.slot_cache.max_len:  # a row near its end beside a wide one: room for the pads
            self.reserve(max(reach, self.max_len), self.slots)
        bucket = self._graphed_bucket(segment, rows, width)
        if bucket is not None:
            out = self.static.run_rows(segment, rows, bucket, width, pad_start=self.slot_cache.max_len - width)
            if out is None:
                return [None] * n
            logits = out[:n].float().cpu().numpy()
            return [logits[b, : row.width] for b, row in enumerate(rows)]
        cache = self.slot_cache.view(first, n)
        decoder, head = self.decoder_and_head(segment)
        if any(row.width != width for row in rows) and all(row.parents is None for row in rows):
            return self._run_packed(segment, rows, decoder, head, cache)
        where = Positions.rows([row.pos for row in rows], [row.parents for row in rows], width, self.device)
        if segment.from_tokens:
            ids = torch.empty(n, width, dtype=torch.long)
            for b, row in enumerate(rows):
                ids[b, : row.width] = torch.tensor(list(row.tokens), dtype=torch.long)
                ids[b, row.width :] = int(row.tokens[-1])
            h = decoder.embed_tokens(ids.to(self.device), where.ids)
        else:
            h = torch.empty(n, width, self.config.hidden_size, dtype=self.dtype, device=self.device)
            for b, row in enumerate(rows):
                h[b, : row.width] = self.slot_hidden[row.slot, row.pos : row.pos + row.width]
                h[b, row.width :] = h[b, row.width - 1]
        h = decoder.run_blocks(
            h, None, cache, segment.start, segment.stop, segment.skip_attn, segment.skip_mlp, where=where
        )
        if segment.keep_hidden:
            for b, row in enumerate(rows):
                self.slot_hidden[row.slot, row.pos : row.pos + row.width] = h[b, : row.width]
        if segment.head is None:
            return [None] * n
        logits = head(h).float().cpu().numpy()
        return [logits[b, : row.width] for b, row in enumerate(rows)]

    def _run_packed(self, segment: Segment, rows: list[Row], decoder, head, cache) -> list[np.ndarray | None]:
        """Chains of different widths in one call with their tokens packed (``Positions.packed_rows``): a k-token
        verify or a prompt chunk beside one-token steps widens only attention, not every row's products."""
        where = Positions.packed_rows([row.pos for row in rows], [row.width for row in rows], self.device)
        if segment.from_tokens:
            ids = torch.tensor([int(t) for row in rows for t in row.tokens], dtype=torch.long, device=self.device)
            h = decoder.embed_tokens(ids[None], where.ids)
        else:
            h = torch.cat([self.slot_hidden[row.slot, row.pos : row.pos + row.width] for row in rows])[None]
        h = decoder.run_blocks(
            h, None, cache, segment.start, segment.stop, segment.skip_attn, segment.skip_mlp, where=where
        )
        ends = np.cumsum([row.width for row in rows]).tolist()
        if segment.keep_hidden:
            for row, end in zip(rows, ends):
                self.slot_hidden[row.slot, row.pos : row.pos + row.width] = h[0, end - row.width : end]
        if segment.head is None:
            return [None] * len(rows)
        logits = head(h)[0].float().cpu().numpy()
        return [logits[end - row.width : end] for row, end in zip(rows, ends)]

    def _graphed_bucket(self, segment: Segment, rows: list[Row], width: int) -> int | None:
        """The batch bucket whose graph runs ``rows`` (``StaticSteps.run_rows``), or None: eagerly. Graphed: chains
        from token ids in the first slots, up to ``GRAPH_TOKENS`` wide, through the shared head (or none) at full
        precision and keeping no hidden state, with slots for the bucket and room for its pad rows."""
        if self.static is None or rows[0].slot != 0 or width > GRAPH_TOKENS:
            return None
        if any(row.parents is not None for row in rows) or segment.precision or segment.keep_hidden:
            return None
        if not segment.from_tokens or segment.head not in (None, FINAL_HEAD):
            return None
        bucket = batch_bucket(len(rows))
        if bucket is None or bucket > self.slots or self.slot_cache.max_len - width < self.reach:
            return None
        return bucket

    def device_round(self, drafter, seed: int | None):
        """The speculative round of ``runtime.decoding.speculative.decode`` when it stays on this device
        (``runtime/backends/torch/device_round.py``), or, with no ``drafter``, plain decoding's steps picked on
        the device and read in blocks (``device_plain.py``); None: the host runs them. By default on CUDA, where
        a host round reads the device at every draft step and verify and a host plain step at every token; on
        CPU the host round runs as fast or faster (measured: docs/history.md, 'Figures behind the code's
        constants')."""
        on_device = self.round_on_device
        if on_device is None:
            on_device = torch.device(self.device).type == "cuda"
        if not on_device:
            return None
        if drafter is None:
            from .device_plain import DevicePlain

            return DevicePlain(self, seed)
        from .device_round import DeviceRound

        return DeviceRound.for_drafter(self, drafter, seed)

    def prepare(self, segment: Segment) -> None:
        if segment.precision:
            int8_twin(self.decoder)  # quantizing every product takes a second or more: at load, not in a request

    def unsupported(self, segment: Segment) -> str | None:
        if segment.precision is not None:
            return self._precision_unsupported(segment.precision)
        if getattr(self.decoder, "whole_blocks", False) and segment.skip_attn != segment.skip_mlp:
            return "the generic torch path skips whole blocks only (skip_attn must equal skip_mlp)"
        return None

    # -- precision self-drafts (runtime/drafting/kinds/precision.py): the decoder's int8 twin ---------------
    def _precision_unsupported(self, precision: str) -> str | None:
        from ...segments import parse_precision

        scheme = parse_precision(precision)[0]
        if scheme != "int8":  # _weight_int4pack_mm_for_cpu is slower than the fp32 product (int8_twin.py)
            return (
                f"{precision} precision drafts run on ONNX Runtime only (torch has no fast CPU {scheme} product); "
                "use an int8 precision draft on torch, or build with --backend onnx"
            )
        if not isinstance(self.decoder, Decoder):
            return "the generic torch path has no int8 precision draft (its model is transformers' own)"
        if torch.device(self.device).type == "cuda":  # weight-only int8 or fp8 products (cuda_twin.py)
            from .cuda_twin import cuda_precision_missing

            return cuda_precision_missing(self.device, scheme, self.dtype)
        if torch.device(self.device).type != "cpu":
            return "int8 precision drafts on torch run on CPU or CUDA; build with --backend onnx"
        return int8_kernel_missing()

    # -- token trees (runtime/tree.py) ----------------------------------------------------------------
    def tree_unsupported(self) -> str | None:
        if not isinstance(self.decoder, Decoder):
            return "the generic torch path has no tree attention"
        return None

    @torch.inference_mode()
    def forward_tree(self, tokens: Sequence[int], parents: Sequence[int], pos: int) -> np.ndarray:
        from ...tree import attention_rows, depths

        depth = torch.tensor([0] + depths(parents), dtype=torch.long, device=self.device)
        rows = torch.from_numpy(attention_rows(parents)).to(self.device)
        if self.static is not None and self.static.fits(len(tokens)):
            return self.static.forward_tree(tokens, depth, rows, pos)[0].float().cpu().numpy()
        ids = torch.tensor([list(tokens)], dtype=torch.long, device=self.device)
        return self.decoder.forward_tree(ids, pos, self.cache, depth, rows)[0].float().cpu().numpy()

    @torch.inference_mode()
    def keep_rows(self, pos: int, moves: Sequence[tuple[int, int]], slot: int = 0) -> None:
        if not moves:
            return
        src = torch.tensor([pos + a for a, _ in moves], device=self.device)
        dst = torch.tensor([pos + b for _, b in moves], device=self.device)
        for buf in (self.slot_cache.k, self.slot_cache.v):  # [layers, slots, kv_heads, max_len, head_dim]
            view = buf[:, slot]
            view.index_copy_(2, dst, view.index_select(2, src))

    # -- draft heads: trained exit adapters and reduced vocabularies (runtime/artifact/draft_head_file.py) ------------
    def load_draft_head(self, head_file: str, root: Path | None) -> None:
        c = self.config
        head = load_draft_head(Path(root or ".") / head_file, c.hidden_size, c.vocab_size)
        cached = self.draft_heads.get(head_file)
        if cached is None or cached[0] is not head:
            self.draft_heads[head_file] = (head, TorchDraftHead.from_draft_head(self.decoder, head))

    def _draft_head(self, head_file: str) -> tuple[DraftHead, "TorchDraftHead"]:
        if head_file not in self.draft_heads:
            raise ArtifactError(
                f"draft head {head_file!r} was not loaded; open the artifact with speccompile.runtime.load"
            )
        return self.draft_heads[head_file]


class TorchDraftHead(torch.nn.Module):
    """A draft head in torch: the exit adapter (a gated MLP added to the residual stream, no KV), then the
    model's own final norm and the lm_head rows of the draft vocabulary (all rows when not reduced). The
    model's modules are held, not registered, so training this module never touches the target."""

    def __init__(self, decoder: Decoder, width: int | None, vocab: np.ndarray | None = None):
        super().__init__()
        from .decoder import _ACTIVATIONS, Norm

        c, d = decoder.config, decoder.config.hidden_size
        weight, dtype = decoder.embed.weight, decoder.embed.weight.dtype
        self.norm = self.gate = self.up = self.down = None
        if width:
            self.norm = Norm(c, d).to(weight.device, dtype)
            self.gate, self.up = (
                torch.nn.Linear(d, width, bias=False, device=weight.device, dtype=dtype) for _ in "gu"
            )
            self.down = torch.nn.Linear(width, d, bias=False, device=weight.device, dtype=dtype)
            torch.nn.init.zeros_(self.down.weight)  # an untrained adapter is exactly the shared-head exit
        self.act = _ACTIVATIONS[c.activation]
        rows = decoder.lm_head.weight.detach()
        if vocab is not None:
            rows = rows[torch.as_tensor(vocab, dtype=torch.long, device=rows.device)].clone()
        elif rows.is_inference():  # weights made under inference_mode cannot take part in training
            rows = rows.clone()
        final = Norm(c, d).to(weight.device, dtype)  # a copy of the model's final norm (d weights), frozen
        final.load_state_dict({name: t.clone() for name, t in decoder.norm.state_dict().items()})
        self._shared = (final.requires_grad_(False), rows)  # a tuple: not parameters of this module
        self.vocab = None if vocab is None else torch.as_tensor(vocab, dtype=torch.long, device=rows.device)
        self.vocab_size = c.vocab_size

    def adapt(self, h: torch.Tensor) -> torch.Tensor:
        if self.gate is None:
            return h
        x = self.norm(h)
        return h + self.down(self.act(self.gate(x)) * self.up(x))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """Hidden states after block E ``[..., d]`` -> draft logits over the draft vocabulary ``[..., N]``."""
        norm, rows = self._shared
        return torch.nn.functional.linear(norm(self.adapt(h)), rows)

    def full_logits(self, h: torch.Tensor) -> torch.Tensor:
        """``forward`` over the whole vocabulary: ``-inf`` outside the draft vocabulary."""
        logits = self(h)
        if self.vocab is None:
            return logits
        full = logits.new_full(logits.shape[:-1] + (self.vocab_size,), float("-inf"))
        full[..., self.vocab] = logits
        return full

    def adapter_arrays(self) -> dict[str, np.ndarray]:
        if self.gate is None:
            return {}
        return {f"adapter.{name}": t.detach().float().cpu().numpy() for name, t in self.state_dict().items()}

    @classmethod
    def from_draft_head(cls, decoder: Decoder, head: DraftHead) -> "TorchDraftHead":
        width = head.adapter["adapter.gate.weight"].shape[0] if head.has_adapter else None
        kernel = cls(decoder, width, head.vocab)
        if width:
            weight = decoder.embed.weight
            kernel.load_state_dict(
                {
                    name.removeprefix("adapter."): torch.from_numpy(a).to(weight.device, weight.dtype)
                    for name, a in head.adapter.items()
                }
            )
        return kernel.eval().requires_grad_(False)
