"""ONNX Runtime backend: the exported graphs on a preallocated numpy KV cache (onnxruntime + numpy only).

Mirrors ``runtime/backends/torch/backend.py`` call for call. The KV cache is one numpy buffer per layer,
``[slots, kv_heads, max_len, head_dim]`` (one slot per sequence of a batch), plus a hidden-state buffer
``[slots, max_len, d]`` for early exits; rollback is only a smaller ``pos`` next time. Every call is a batch of
``Row``s (``run_rows``; one sequence is a batch of one). How a graph reaches the cache depends on its variant
(the manifest records it per graph):

- ``fused`` graphs (GroupQueryAttention in its shared-buffer mode) take the whole buffer as past KV and
  write the new entries into it; the backend binds the layers' buffers over the call's slots, as
  ``OrtValue`` views, to both the past input and the present output with IOBinding (once per slot range
  and ``reserve``). No call copies the past. A graph that takes ``query_seqlens`` (``packed_rows`` exports,
  ONNX Runtime 1.32 or later) runs every row of a call together, whatever its width (one-token steps,
  verifies, trees, prompt chunks), each row its own length and position: the products and MLPs on the rows'
  tokens one after another, only the attention on the rows padded to the widest (``FusedGraph.packed_layout``),
  so the weights are read once for the whole batch and a call costs what its tokens cost. Older graphs run one-token rows in consecutive slots (a
  batch of plain or draft steps) as one call and wider rows one call each: without ``query_seqlens``
  GroupQueryAttention takes several sequences only with one new token each.
- ``standard`` graphs (ONNX ops only) concatenate past and new KV, so each call feeds one row's past slice
  ``[:, :, :pos]`` and writes the new entries of ``present`` back at ``pos .. pos+T-1``; rows run one by one.

Weights are in memory once. A tensor that several of the backend's sessions use becomes one ``OrtValue``,
read once from ``weights.bin``, that every such session receives through ``SessionOptions.add_initializer``.
A tensor only one session uses is read by that session itself from the graph's external data: with weight
prepacking on (the default) ONNX Runtime packs it for its matmul kernels and frees the bytes it read, so
the packed copy is the only one (an ``OrtValue`` given by the caller must outlive the session, so ONNX
Runtime keeps it beside the packed copy: an unpacked copy of the weights more, were every tensor given so;
measured: docs/history.md, 'Figures behind the code's constants'). With ``prepack=False`` every tensor is shared.

This module must not import torch or transformers.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ...artifact.draft_head_file import DraftHead, expand_logits, load_draft_head
from ...artifact.manifest import ArchConfig, DraftPlan
from ...errors import ArtifactError, BackendUnavailableError
from ...segments import FINAL_HEAD, Row, Segment, full_model
from ...tree import attention_rows as tree_attention_rows
from ...tree import depths as tree_depths
from ..base import Backend
from ..graph_index import GraphIndex, full_model_without_verify
from .draft_window import DraftWindow
from .initializers import from_arrays, from_blob, read_weights, shared_tensors
from .selfcheck import tree_refusal

_NP = {"float32": np.float32, "float16": np.float16, "int64": np.int64, "uint8": np.uint8}
PACKED_ROWS_ORT = (1, 32)  # the ONNX Runtime that first takes GroupQueryAttention's ``query_seqlens``


def logit_rows(rows: Sequence[Row | None], width: int, packed: bool) -> np.ndarray:
    """The ``logit_rows`` input of a graph that takes it (``FusedGraph.head``): along the token stream of a packed
    call, every token of each row but a ``last_only`` row's last token alone; along each row's width otherwise (one
    index list for the whole batch: a lone row that wants its last token only gets that, a batch every place)."""
    real = [row for row in rows if row is not None]
    if not packed:
        lone = len(rows) == 1 and real[0].last_only
        return np.array([real[0].width - 1] if lone else range(width), np.int64)
    picked, start = [], 0
    for row in real:
        picked.extend([start + row.width - 1] if row.last_only else range(start, start + row.width))
        start += row.width
    return np.array(picked, np.int64)


def check_packed_rows_runtime(ort, graphs: dict[str, dict]) -> None:
    """Refuse, in one line, graphs that take ``query_seqlens`` on an ONNX Runtime too old for them (it would fail
    to load them with a message about the operator's inputs)."""
    if not any(i["name"] == "query_seqlens" for g in graphs.values() for i in g.get("inputs", [])):
        return
    version = tuple(int(part) for part in re.findall(r"\d+", ort.__version__)[:2])
    if version < PACKED_ROWS_ORT:
        floor = ".".join(map(str, PACKED_ROWS_ORT))
        raise BackendUnavailableError(
            f"this artifact's ONNX graphs need onnxruntime>={floor} (installed: {ort.__version__}); "
            f"pip install -U 'onnxruntime>={floor}'"
        )


def stop_spinning_after_runs() -> bool:
    """Whether sessions stop their threads' spinning as soon as a call returns (``session.force_spinning_stop``).

    Why: every ONNX Runtime session has its own thread pool, whose threads spin for a while after a call. A
    plan with graphs of its own (precision drafts, early exits, layer skips, adapters) runs a draft session
    and the verify session in turns on the same cores, each while the other's threads still spin: a verify
    after draft steps then costs nearly twice its back-to-back time, and with spinning stopped after each call
    about its back-to-back time, plain steps barely slower (threads still spin inside a call). Turning spinning
    off altogether costs plain decoding much more (figures: docs/history.md, 'Figures behind the code's
    constants', and docs/drafting.md); one process-wide pool would have done as well but makes every other
    onnxruntime session in the process (optimum's, a user's) fail unless it opts in. An artifact with one
    session (plain decoding, lookup plans) keeps onnxruntime's default.
    ``SPECCOMPILE_ORT_SPIN_STOP=0`` keeps onnxruntime's default (to measure the difference)."""
    import os

    return os.environ.get("SPECCOMPILE_ORT_SPIN_STOP", "1").strip().lower() not in ("0", "false", "no", "off")


def _ort():
    try:
        import onnxruntime
    except ImportError:
        raise BackendUnavailableError(
            "the ONNX backend needs onnxruntime; install it (pip install onnxruntime) or use a torch artifact"
        ) from None
    return onnxruntime


class OnnxBackend(Backend):
    name = "onnx"

    def __init__(
        self,
        root: Path,
        record: dict[str, Any],
        config: ArchConfig,
        device: str = "cpu",
        providers: list | None = None,
        threads: int = 0,
        roles: Sequence[str] | None = None,
        mmap: bool = False,
        prepack: bool = True,
        kv_in_place: bool = True,
        plans: dict[str, DraftPlan] | None = None,
        initializers: dict[str, np.ndarray] | None = None,
    ):
        """``record`` is the manifest's ``backends["onnx"]``. ``providers`` overrides the execution
        providers chosen from ``device`` ("cpu" or "cuda"); ``threads`` is ORT's intra-op thread count
        (0: ORT's default); ``roles`` limits the sessions created to those graph keys (default: every
        graph in the record); ``mmap=True`` keeps the shared tensors as views of the read-only map of weights.bin
        instead of copying them into private memory (pages then shared with the page cache and other processes).

        ``prepack`` (default on) lets ORT pre-pack weights for its matmul kernels: faster decoding (measured:
        docs/history.md, 'Figures behind the code's constants') and a verify of k tokens barely dearer than one
        step, which is what speculation needs;
        but every session keeps its own packed copy (the Python API has no shared pre-packed container).
        So when every plan is an early exit at the same block E, there is no separate ``verify``
        session: plain decoding runs prefix(E) then suffix(E), which together are the full model, and
        each weight is packed once. Artifacts with layer-skip plans need the full ``verify`` graph
        next to the draft graphs; ``prepack=False`` keeps them at one copy of the weights, slower.

        ``kv_in_place=False`` runs fused graphs the way standard graphs run (past slice in, present
        copied back): only there to measure what the in-place cache saves. ``plans``: the manifest's, for
        exports whose graph records predate their ``segment`` (``graph_index``). ``initializers``: every tensor of
        the table, by name, already in memory (a build's tuning runner): weights.bin is then not read."""
        ort = _ort()
        self.root = Path(root)
        self.record = record
        self.config = config
        try:
            self.dtype = np.dtype(_NP[record.get("dtype", "float32")])
            graphs: dict[str, dict] = record["graphs"]
            tensors: dict[str, dict] = record["tensors"]
            weights_rel: str = record["weights"]
        except (KeyError, TypeError) as exc:
            raise ArtifactError(
                f"manifest backends['onnx'] is malformed ({exc}); rebuild the artifact with --backend onnx"
            ) from None
        self.prepack = prepack
        self.fused = {key for key, g in graphs.items() if g.get("variant") == "fused"} if kv_in_place else set()
        # graphs whose rows of any width share a call (GroupQueryAttention's query_seqlens)
        self.packed = {key for key in self.fused if any(i["name"] == "query_seqlens" for i in graphs[key]["inputs"])}
        L = config.num_layers
        self.index = GraphIndex(record, plans or {}, L)
        # No session for the whole-model graph when the other graphs compose the full model and none of them
        # runs every block from the tokens (an export whose plans all exit at one block): with prepacking each
        # session packs its own copy of the weights it uses, and prefix + suffix already cover them all.
        self.full_split = full_model_without_verify(record, plans or {}, L) if roles is None else None
        if self.full_split is not None:
            roles = [key for key in graphs if key != "verify"]
            self.index = GraphIndex(record, plans or {}, L, opened=set(roles))
        if providers is None:
            if device == "cpu":
                providers = ["CPUExecutionProvider"]
            elif device.startswith("cuda"):
                if "CUDAExecutionProvider" not in ort.get_available_providers():
                    raise BackendUnavailableError(
                        "device 'cuda' needs onnxruntime-gpu with the CUDA execution provider; install "
                        "onnxruntime-gpu or use --device cpu"
                    )
                providers = ["CUDAExecutionProvider", "CPUExecutionProvider"]
            else:
                raise BackendUnavailableError(f"unknown device {device!r} for the ONNX backend; use cpu or cuda")
        self.providers = providers

        opened = [key for key in graphs if roles is None or key in roles]
        check_packed_rows_runtime(ort, {key: graphs[key] for key in opened})
        # -- the weights: shared ones read once, the rest read by their one session (initializers.py) ---------
        shared = shared_tensors(graphs, opened, tensors) if prepack else set(tensors)
        self._blob = read_weights(self.root, record, tensors, weights_rel)  # checked, mapped; read as needed
        if initializers is not None:
            self._arrays, self._ortvalues = from_arrays(ort, tensors, initializers, only=shared)
        else:
            self._arrays, self._ortvalues = from_blob(ort, tensors, self._blob, only=shared, copy=not mmap)

        # -- one session per graph, the shared tensors as the same OrtValues ---------------------------
        self.sessions: dict[str, Any] = {}
        self.inputs: dict[str, list[str]] = {}
        self.outputs: dict[str, list[str]] = {}
        # Sessions take turns only when there is more than one; a lone verify session keeps onnxruntime's default
        self.spin_stop = len(opened) > 1 and stop_spinning_after_runs()
        for key in opened:
            self.sessions[key] = self._session(ort, key, graphs[key], threads)
        self.max_len, self.slots = 0, 0
        self.k: list[np.ndarray] = []  # per layer [slots, kv_heads, max_len, head_dim]
        self.v: list[np.ndarray] = []
        self.exit_hidden: np.ndarray | None = None  # [slots, max_len, d]
        self._kv_values: dict[tuple, dict[str, Any]] = {}  # (first slot, count) -> KV OrtValues over those slots
        self._bindings: dict[tuple, Any] = {}  # (graph key, first slot, count) -> IOBinding with that KV bound
        self.draft_heads: dict[str, DraftHead] = {}  # plan.draft_head_file -> its draft head (vocabulary ids)
        # precision drafts' graphs that take each row's positions: at long context they attend to a window
        self.windowed = {
            key
            for key in self.fused - self.packed
            if graphs[key].get("segment", {}).get("precision")
            and "position_ids" in self.inputs.get(key, [])
            and "attention_bias" not in self.inputs.get(key, [])
        }
        self.window = DraftWindow(L, config.num_kv_heads, config.head_dim, self.dtype) if self.windowed else None
        self._window_bindings: dict[tuple, Any] = {}  # as _bindings, over the window's buffers
        self._window_values: list[Any] = []  # the OrtValues those bindings hold, kept with them

    def _session(self, ort, key: str, g: dict, threads: int):
        path = self.root / g["file"]
        if not path.is_file():
            raise ArtifactError(
                f"ONNX graph {g['file']!r} is missing from {str(self.root)!r}; restore it or rebuild the "
                "artifact with --backend onnx"
            )
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        if self.spin_stop:
            options.add_session_config_entry("session.force_spinning_stop", "1")
        if not self.prepack:
            options.add_session_config_entry("session.disable_prepacking", "1")
        options.log_severity_level = 3
        for name in g.get("initializers", []):
            if name not in self.record["tensors"]:
                raise ArtifactError(
                    f"ONNX graph {g['file']!r} needs tensor {name!r}, which the manifest's tensor table "
                    "lacks; rebuild the artifact with --backend onnx"
                )
            if name in self._ortvalues:  # the others this session reads from weights.bin itself
                options.add_initializer(name, self._ortvalues[name])
        try:
            session = ort.InferenceSession(str(path), sess_options=options, providers=self.providers)
        except Exception as exc:  # onnxruntime raises its own exception types (InvalidProtobuf, Fail, ...)
            first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
            raise ArtifactError(
                f"ONNX graph {g['file']!r} could not be loaded (corrupted or truncated: {first}); restore it or rebuild "
                "the artifact with --backend onnx"
            ) from None
        got = [(i.name, len(i.shape)) for i in session.get_inputs()]
        want = [(i["name"], len(i["shape"])) for i in g["inputs"]]
        got_out = [o.name for o in session.get_outputs()]
        want_out = [o["name"] for o in g["outputs"]]
        if sorted(got) != sorted(want) or sorted(got_out) != sorted(want_out):
            g_set, w_set = dict(got), dict(want)
            diffs = [f"graph input {n!r} not in the manifest" for n in g_set if n not in w_set]
            diffs += [f"manifest input {n!r} not in the graph" for n in w_set if n not in g_set]
            diffs += [
                f"input {n!r} has rank {g_set[n]} in the graph, {w_set[n]} in the manifest"
                for n in g_set
                if n in w_set and g_set[n] != w_set[n]
            ]
            diffs += [f"output {n!r} differs" for n in sorted(set(got_out) ^ set(want_out))]
            shown = "; ".join(diffs[:3]) + (f"; and {len(diffs) - 3} more" if len(diffs) > 3 else "")
            raise ArtifactError(
                f"ONNX graph {g['file']!r} does not match the manifest ({shown}); the graph and manifest are from "
                "different builds: rebuild the artifact with --backend onnx"
            )
        self.inputs[key] = [i.name for i in session.get_inputs()]
        self.outputs[key] = got_out
        return session

    @classmethod
    def from_artifact(cls, root: Path, manifest, plans: dict, device: str = "cpu", **kwargs) -> "OnnxBackend":
        """``plans``: the manifest's plans read (``drafting.check_plans``); each is checked against the graphs."""
        if "onnx" not in manifest.backends:
            raise BackendUnavailableError("this artifact has no 'onnx' backend; rebuild with --backend onnx")
        backend = cls(Path(root), manifest.backends["onnx"], manifest.config, device=device, plans=plans, **kwargs)
        backend.check_plans(plans)
        return backend

    def unsupported(self, segment: Segment) -> str | None:
        reason = self.index.check(segment)
        return None if reason is None else f"{reason}; re-export with --backend onnx after changing plans"

    def replica(self) -> "OnnxBackend":
        """Another backend over the same sessions and weights with its own KV buffers (one per concurrent
        sequence): ORT sessions may be run from several threads at once."""
        other = copy.copy(self)
        other.max_len, other.slots, other.k, other.v, other.exit_hidden = 0, 0, [], [], None
        other._kv_values, other._bindings, other._window_bindings, other._window_values = {}, {}, {}, []
        if self.window is not None:
            other.window = DraftWindow(
                self.config.num_layers, self.window.kv_heads, self.window.head_dim, self.dtype, self.window.shape
            )
        return other

    # -- cache -------------------------------------------------------------------------------------
    def reserve(self, max_len: int, slots: int = 1) -> None:
        """Make sure the KV buffers hold ``max_len`` positions for ``slots`` sequences (``[slots, kv_heads,
        max_len, head_dim]`` per layer); reuse them across requests. Growing copies what the cache held, so a
        batch can take a longer request without losing its running sequences."""
        c = self.config
        have_len = self.k[0].shape[2] if self.k else 0
        have_slots = self.k[0].shape[0] if self.k else 0
        # packed graphs: a one-token row at the last position may run with its attention on two rows, and
        # GroupQueryAttention wants room for the padded width after each row's past (FusedGraph.packed_layout)
        room = max_len + (1 if self.packed else 0)
        if have_len < room or have_slots < slots:
            size, count = max(room, have_len), max(slots, have_slots)
            shape = (count, c.num_kv_heads, size, c.head_dim)
            old_k, old_v, old_hidden = self.k, self.v, self.exit_hidden
            self.k = [np.zeros(shape, self.dtype) for _ in range(c.num_layers)]
            self.v = [np.zeros(shape, self.dtype) for _ in range(c.num_layers)]
            self.exit_hidden = np.zeros((count, size, c.hidden_size), self.dtype)
            if old_k:
                for new, old in zip(self.k + self.v + [self.exit_hidden], old_k + old_v + [old_hidden]):
                    new[: old.shape[0], ..., : old.shape[-2], :] = old
            self._kv_values, self._bindings = {}, {}
        self.max_len = max_len  # this request's limit; the buffers may be longer
        self.slots = self.k[0].shape[0]

    def move_slot(self, source: int, target: int, length: int) -> None:
        """Copy slot ``source``'s cache (positions below ``length``) into slot ``target`` (a batch keeping its
        sequences in the first slots when one leaves)."""
        for buf in self.k + self.v:
            buf[target, :, :length] = buf[source, :, :length]
        self.exit_hidden[target, :length] = self.exit_hidden[source, :length]
        if self.window is not None:
            self.window.forget(target)

    def _kv_range(self, first: int, count: int) -> dict[str, Any]:
        """OrtValues over slots ``first .. first + count - 1`` of every layer's buffer (views, no copy)."""
        key = (first, count)
        values = self._kv_values.get(key)
        if values is None:
            ort = _ort()
            values = {}
            for i in range(self.config.num_layers):
                values[f"past_key_values.{i}.key"] = ort.OrtValue.ortvalue_from_numpy(self.k[i][first : first + count])
                values[f"past_key_values.{i}.value"] = ort.OrtValue.ortvalue_from_numpy(
                    self.v[i][first : first + count]
                )
            self._kv_values[key] = values
        return values

    def _binding(self, key: str, first: int, count: int):
        """The IOBinding of graph ``key`` with slots ``first .. first + count - 1`` of every layer's KV buffer
        bound as past input and present output (the same OrtValue), made once per ``reserve``."""
        io = self._bindings.get((key, first, count))
        if io is None:
            values = self._kv_range(first, count)
            io = self.sessions[key].io_binding()
            for name in self.inputs[key]:
                if name.startswith("past_key_values."):
                    io.bind_ortvalue_input(name, values[name])
            for name in self.outputs[key]:
                if name.startswith("present."):
                    io.bind_ortvalue_output(name, values["past_key_values." + name[len("present.") :]])
            self._bindings[(key, first, count)] = io
        return io

    def rows_share_a_call(self, segment: Segment | None = None) -> bool:
        """Whether rows of several sequences can run in one call of the fused graphs, each computing what it
        computes alone (rows of any width where the graphs take ``query_seqlens``, else one-token rows).

        - Packed graphs give every row its own positions (the kernel's rotary, or positions computed in the
          graph from each row's length) and its own attention layout, at least two places wide whatever the
          call (``_feeds``), so a row takes the same kernel paths, to the bit, alone or beside rows of any
          widths: every architecture they cover batches, quantized targets (int8 activations) included
          (``tests/test_packed_rows.py``, at SmolLM2's shapes).
        - Older graphs of quantized targets run their single steps with a padding row (``FusedGraph.padding``)
          and a batch without it: the attention rounds differently there, and int8 activations turn that into
          logits about a quantization step apart (``tests/test_real_shapes.py``), so their verifier's rows run
          alone, exact and as slow as one sequence after another. A draft segment (a precision self-draft)
          may batch: its tokens are proposals, and the verifier decides every committed token.
        - Other older graphs: GroupQueryAttention takes each row's length (``seqlens_k``) and applies the rotary
          itself from each row's positions; graphs that compute positions outside the kernel from one call-wide
          range (learned positions, a rotary the kernel cannot apply) run each row alone."""
        c = self.config
        calls = self.index.calls(segment if segment is not None else full_model(c.num_layers))
        if calls and self._packs(calls):
            return True
        drafting = segment is not None and segment.precision is not None
        if not drafting and self.record.get("quantization"):
            return False
        kernel_rotary = c.positions == "rotary" and (c.rotary_dim // 2) % 8 == 0 and c.rotary_dim <= c.head_dim
        return kernel_rotary and not c.local_rope

    def _packs(self, calls: list[str]) -> bool:
        """Whether the graphs ``calls`` (a segment's) run rows of any width together: all fused, and every one
        that attends takes ``query_seqlens`` (a head graph has no cache)."""
        attends = [key for key in calls if "seqlens_k" in self.inputs[key]]
        return bool(attends) and all(key in self.fused for key in calls) and all(key in self.packed for key in attends)

    def _feeds(self, key: str, rows: Sequence[Row | None], width: int, ids, hidden) -> dict[str, np.ndarray]:
        """The inputs of graph ``key`` other than the KV cache for ``rows`` (None: an idle slot between two rows
        of a packed call), each padded to ``width`` tokens after its own.

        A packed graph (``query_seqlens``) gets each row's count of tokens and the layout of its token stream
        (``FusedGraph.packed_layout``), at least two places wide, so that a one-token row computes the same in
        every call; where the export pads attention rows (``padded_attention_rows``: quantized targets) a
        one-token row counts one pad with it as a query row, so that it also computes what the same position
        computes inside a verify. An older graph counts every pad in the row. A pad repeats the row's last
        token, one position later: causal attention keeps it out of every real token's result, and its KV lands
        past the row's length, where the row's next call writes before anything reads."""
        packed = "query_seqlens" in self.inputs[key]
        real = [row for row in rows if row is not None]
        if packed:
            width = max(width, 2)

        def counted(row: Row) -> int:  # a packed row's query rows: its pad too where one-token rows count one
            return max(row.width, 2) if self.record.get("padded_attention_rows") else row.width

        n = len(rows)
        positions = np.empty((n, width), np.int64)
        for b, row in enumerate(rows):
            depth = np.arange(width, dtype=np.int64)
            if row is not None and row.parents is not None:
                depth[: row.width] = [0] + tree_depths(row.parents)
            positions[b] = (row.pos if row is not None else 0) + depth
        total = max(row.pos for row in real) + width
        feed: dict[str, np.ndarray] = {}
        for name in self.inputs[key]:
            if name == "input_ids":
                feed[name] = ids
            elif name == "hidden":
                feed[name] = hidden
            elif name == "seqlens_k":  # an idle slot: one position of past, no new token (query_seqlens 0)
                ends = [0 if row is None else row.pos + (counted(row) if packed else width) - 1 for row in rows]
                feed[name] = np.array(ends, dtype=np.int32)
            elif name == "query_seqlens":
                feed[name] = np.array([0 if row is None else counted(row) for row in rows], dtype=np.int32)
            elif name == "token_index":  # each place of the padded layout -> its token in the stream
                index, start = np.zeros((n, width), np.int64), 0
                for b, row in enumerate(rows):
                    if row is not None:
                        index[b] = start + np.minimum(np.arange(width), row.width - 1)
                        start += row.width
                feed[name] = index
            elif name == "token_place":  # each token of the stream -> its place in the flattened layout
                feed[name] = np.concatenate(
                    [b * width + np.arange(row.width) for b, row in enumerate(rows) if row is not None]
                ).astype(np.int64)
            elif name == "total_sequence_length":
                feed[name] = np.array(total, dtype=np.int32)
            elif name == "position_ids":
                feed[name] = positions
            elif name == "logit_rows":
                feed[name] = logit_rows(rows, width, packed)
            elif name == "attention_bias":
                bias = np.zeros((n, 1, width, total), self.dtype)
                for b, row in enumerate(rows):
                    if row is not None and row.parents is not None:
                        rows_mask = tree_attention_rows(row.parents)
                        block = bias[b, 0, : row.width, row.pos : row.pos + row.width]
                        block[~rows_mask] = np.finfo(self.dtype).min
                feed[name] = bias
        return feed

    def _call(
        self, key: str, rows: Sequence[Row | None], width: int, ids, hidden, io=None, positions=None
    ) -> dict[str, np.ndarray]:
        """Graph ``key`` on the contiguous slots of ``rows`` (one call; KV written in place); its outputs by name:
        ``[rows, width, size]``, or for a packed call (``rows`` may hold None: an idle slot) ``[1, tokens, size]``.
        ``io``: another binding of the cache (the draft window's); ``positions``: the rows' real positions where
        ``rows`` give their places in that cache."""
        first, n = rows[0].slot, len(rows)
        io = io if io is not None else self._binding(key, first, n)
        feed = self._feeds(key, rows, width, ids, hidden)
        if positions is not None:
            feed["position_ids"] = positions
        for name, value in feed.items():
            io.bind_cpu_input(name, value)
        source = ids if ids is not None else hidden
        shape = source.shape[:2]  # [rows, width], or [1, tokens] packed
        outs: dict[str, np.ndarray] = {}
        for name in self.outputs[key]:
            if name.startswith("present."):
                continue
            size = self.config.vocab_size if name == "logits" else self.config.hidden_size
            rows_out = shape if name != "logits" or "logit_rows" not in feed else (shape[0], len(feed["logit_rows"]))
            value = np.empty((*rows_out, size), self.dtype)
            io.bind_output(name, "cpu", 0, self.dtype, list(value.shape), value.ctypes.data)
            outs[name] = value
        self.sessions[key].run_with_iobinding(io)
        return outs

    def _call_growing(self, key: str, row: Row, ids, hidden) -> dict[str, np.ndarray]:
        """Graph ``key`` on one row the way ``standard`` graphs run (and fused ones with ``kv_in_place=False``):
        the past slice in, the new entries of ``present`` copied back into the row's slot."""
        t, pos, slot = row.width, row.pos, row.slot
        feed = self._feeds(key, [row], t, ids, hidden)
        for name in self.inputs[key]:
            if name.startswith("past_key_values."):
                _, layer, kind = name.split(".")
                buf = self.k[int(layer)] if kind == "key" else self.v[int(layer)]
                feed[name] = np.ascontiguousarray(buf[slot : slot + 1, :, :pos])
        if "attention_bias" in feed:  # the growing cache: keys are exactly the row's own past and tokens
            feed["attention_bias"] = feed["attention_bias"][..., : int(feed["total_sequence_length"])]
        outs = dict(zip(self.outputs[key], self.sessions[key].run(self.outputs[key], feed)))
        for name, value in outs.items():
            if name.startswith("present."):
                _, layer, kind = name.split(".")
                buf = self.k[int(layer)] if kind == "key" else self.v[int(layer)]
                buf[slot, :, pos : pos + t] = value[0, :, pos : pos + t]
        return outs

    # -- token trees (runtime/tree.py) -------------------------------------------------------------
    def tree_unsupported(self) -> str | None:
        calls = self.index.calls(full_model(self.config.num_layers))
        if not calls or len(calls) != 1 or "attention_bias" not in self.inputs.get(calls[0], []):
            return "this export's full-model graph takes no tree mask (rebuild the artifact with --backend onnx)"
        return tree_refusal(self)  # a quantized target: trees only where they compute their steps bit for bit

    def tree_fits(self, pos: int, t: int) -> bool:
        """GroupQueryAttention counts a sliding window in cache slots, and a tree node's position is smaller than
        its slot: the two windows agree while the call's last slot is inside the window."""
        c = self.config
        windows = [w for w in (c.window_of(i) for i in range(c.num_layers)) if w is not None]
        return not windows or pos + t <= min(windows)

    def forward_tree(self, tokens: Sequence[int], parents: Sequence[int], pos: int) -> np.ndarray:
        full = full_model(self.config.num_layers)
        return self.run_rows(full, [Row(0, pos, list(tokens), parents=list(parents))])[0]

    def keep_rows(self, pos: int, moves: Sequence[tuple[int, int]], slot: int = 0) -> None:
        if not moves:
            return
        src, dst = [pos + a for a, _ in moves], [pos + b for _, b in moves]
        for buf in self.k + self.v:  # [slots, kv_heads, max_len, head_dim], the OrtValues' memory
            buf[slot, :, dst] = buf[slot, :, src]
        if self.window is not None:
            self.window.stale_from(slot, pos)

    # -- the backend interface ---------------------------------------------------------------------
    batched = True
    slots_copy = True  # one KV buffer per layer with a slot dimension: move_slot copies

    @property
    def rows_in_one_call(self) -> bool:
        """How the load policy prices a call: packed graphs run every row of a round in one call, its products on
        the rows' tokens; older graphs run one-token rows together and each wider row alone."""
        return bool(self.packed) and self.rows_share_a_call()

    def run(self, segment: Segment, pos: int, tokens: Sequence[int] | None = None, count: int = 0) -> np.ndarray | None:
        return self.run_rows(segment, [Row(0, pos, tokens, count)])[0]

    def run_rows(self, segment: Segment, rows: Sequence[Row]) -> list[np.ndarray | None]:
        """The segment's graphs in turn (``graph_index``: a blocks graph, then a head graph on its hidden
        state) on every row at once: the rows that share a call (``_groups``) are one call of each graph, which
        reads the weights once for all of them. Hidden states the segment keeps go into each row's slot of the
        hidden buffer, where segments that start from them read them."""
        calls = self.index.calls(segment)
        if calls is None:
            raise ArtifactError(
                f"the ONNX export has no graphs for {segment.describe()}; rebuild the artifact with --backend onnx"
            )
        if segment.head not in (None, FINAL_HEAD) and segment.head not in self.draft_heads:
            raise ArtifactError(
                f"draft head {segment.head!r} was not loaded; open the artifact with speccompile.runtime.load"
            )
        results: list[np.ndarray | None] = [None] * len(rows)
        windowed = self.window is not None and segment.from_tokens and any(key in self.windowed for key in calls)
        for group in self._groups(calls, rows, segment):
            members = [rows[i] for i in group]
            if windowed and self.window.applies(members):
                logits = self._run_windowed(segment, calls, members)
            else:
                if self.window is not None:  # the main cache changes at these rows' positions
                    for row in members:
                        self.window.stale_from(row.slot, row.pos)
                logits = self._run_group(segment, calls, members, max(row.width for row in members))
            if logits is not None:
                for i, row_logits in zip(group, logits):
                    results[i] = row_logits[: rows[i].width]
        return results

    def _groups(self, calls: list[str], rows: Sequence[Row], segment: Segment | None = None) -> list[list[int]]:
        """Indices of ``rows`` that run in one call, each group in slot order.

        - Graphs that take ``query_seqlens``: every row in one call, whatever its width (idle slots between rows
          ride along with no tokens), except a row whose past leaves no room in the cache for the call's padded
          width (``FusedGraph.packed_layout``: ``P + S <= max_len``), which runs alone: a row computes the same
          in either call.
        - Older graphs: one-token rows (plain steps, draft steps) in consecutive slots. GroupQueryAttention's CPU
          kernel refuses a batch of several sequences with more than one new token each and a past without
          ``query_seqlens`` ("batch_size must be 1 when sequence_length > 1"), so a prompt chunk, a k-token
          verify or a tree runs as a call of its own.

        Only when every graph of the segment is fused and rows may share a call; otherwise every row alone."""
        order = sorted(range(len(rows)), key=lambda i: rows[i].slot)
        together = (
            len(rows) > 1
            and self.record.get("batched_steps", False)
            and all(key in self.fused for key in calls)
            and self.rows_share_a_call(segment)
        )
        if together and self._packs(calls):
            capacity, alone = self.k[0].shape[2], []
            while order:  # the widest row sets the call's width; rows without room for it leave the call
                width = max(rows[i].width for i in order)
                padded = width + 1 if width == 1 else width  # a one-token call's attention may run on two rows
                misfits = [i for i in order if rows[i].pos + padded > capacity]
                if not misfits:
                    break
                order = [i for i in order if i not in misfits]
                alone += misfits
            return ([order] if order else []) + [[i] for i in alone]
        groups: list[list[int]] = []
        for i in order:
            row = rows[i]
            joins = together and row.width == 1 and row.parents is None and row.pos > 0
            last = rows[groups[-1][-1]] if groups else None
            if joins and last is not None and last.width == 1 and last.parents is None and last.pos > 0:
                if last.slot == row.slot - 1:
                    groups[-1].append(i)
                    continue
            groups.append([i])
        return groups

    def _run_group(self, segment: Segment, calls: list[str], rows: list[Row], width: int) -> list[np.ndarray] | None:
        """One call of each of the segment's graphs on ``rows`` (in slot order, each padded to ``width``); each
        row's logits in the order of ``rows`` (None: the segment has no head)."""
        if self._packs(calls):
            return self._run_packed(segment, calls, rows)
        n, d = len(rows), self.config.hidden_size
        ids = hidden = None
        if segment.from_tokens:
            ids = np.empty((n, width), np.int64)
            for b, row in enumerate(rows):
                ids[b, : row.width] = row.tokens
                ids[b, row.width :] = row.tokens[-1]
        else:
            hidden = np.empty((n, width, d), self.dtype)
            for b, row in enumerate(rows):
                hidden[b, : row.width] = self.exit_hidden[row.slot, row.pos : row.pos + row.width]
                hidden[b, row.width :] = hidden[b, row.width - 1]
        outs: dict[str, np.ndarray] = {}
        for i, key in enumerate(calls):
            if key in self.fused:
                outs = self._call(key, rows, width, ids, hidden)
            else:
                outs = self._call_growing(key, rows[0], ids, hidden)
            if segment.keep_hidden and i == 0:
                for b, row in enumerate(rows):
                    self.exit_hidden[row.slot, row.pos : row.pos + row.width] = outs["hidden"][b, : row.width]
            ids, hidden = None, outs.get("hidden", outs.get("last_hidden"))
        return None if segment.head is None else list(self._logits(segment, outs["logits"]))

    def _run_windowed(self, segment: Segment, calls: list[str], rows: list[Row]) -> list[np.ndarray] | None:
        """``_run_group`` for draft rows far into their context: the draft graph attends to each row's sinks and
        window (``draft_window.py``), bound in place of the main cache, at the rows' real positions."""
        views, grown = self.window.prepare(self.k, self.v, rows)
        if grown:
            self._window_bindings, self._window_values = {}, []
        n, width = len(rows), max(row.width for row in rows)
        ids = np.empty((n, width), np.int64)
        positions = np.empty((n, width), np.int64)
        for b, row in enumerate(rows):
            ids[b, : row.width] = row.tokens
            ids[b, row.width :] = row.tokens[-1]
            positions[b] = row.pos + np.arange(width)
        hidden = None
        outs: dict[str, np.ndarray] = {}
        for i, key in enumerate(calls):
            if key in self.windowed:
                io = self._window_binding(key, views[0].slot, n)
                outs = self._call(key, views, width, ids, hidden, io=io, positions=positions)
            else:  # a head graph (no cache)
                outs = self._call(key, rows, width, ids, hidden)
            if segment.keep_hidden and i == 0:
                for b, row in enumerate(rows):
                    self.exit_hidden[row.slot, row.pos : row.pos + row.width] = outs["hidden"][b, : row.width]
            ids, hidden = None, outs.get("hidden", outs.get("last_hidden"))
        self.window.write_back(self.k, self.v, rows)
        return None if segment.head is None else list(self._logits(segment, outs["logits"]))

    def _window_binding(self, key: str, first: int, count: int):
        """``_binding`` over the draft window's buffers."""
        io = self._window_bindings.get((key, first, count))
        if io is None:
            ort = _ort()
            io = self.sessions[key].io_binding()
            for i in range(self.config.num_layers):
                for kind, bufs in (("key", self.window.k), ("value", self.window.v)):
                    value = ort.OrtValue.ortvalue_from_numpy(bufs[i][first : first + count])
                    self._window_values.append(value)
                    if f"past_key_values.{i}.{kind}" in self.inputs[key]:
                        io.bind_ortvalue_input(f"past_key_values.{i}.{kind}", value)
                        io.bind_ortvalue_output(f"present.{i}.{kind}", value)
            self._window_bindings[(key, first, count)] = io
        return io

    def _run_packed(self, segment: Segment, calls: list[str], rows: list[Row]) -> list[np.ndarray] | None:
        """``_run_group`` on packed graphs: the rows' tokens (or kept hidden states) as one stream, in slot order;
        the call spans the slots from the first row's to the last's, and the slots between without a row are idle
        entries (``query_seqlens`` 0)."""
        first = rows[0].slot
        entries: list[Row | None] = [None] * (rows[-1].slot - first + 1)
        for row in rows:
            entries[row.slot - first] = row
        width = max(row.width for row in rows)
        starts = np.cumsum([0] + [row.width for row in rows])
        ids = hidden = None
        if segment.from_tokens:
            ids = np.array([[token for row in rows for token in row.tokens]], np.int64)
        else:
            hidden = np.concatenate([self.exit_hidden[row.slot, row.pos : row.pos + row.width] for row in rows])[None]
        outs: dict[str, np.ndarray] = {}
        for i, key in enumerate(calls):
            outs = self._call(key, entries, width, ids, hidden)
            if segment.keep_hidden and i == 0:
                for row, start in zip(rows, starts):
                    self.exit_hidden[row.slot, row.pos : row.pos + row.width] = outs["hidden"][
                        0, start : start + row.width
                    ]
            ids, hidden = None, outs.get("hidden", outs.get("last_hidden"))
        if segment.head is None:
            return None
        logits = self._logits(segment, outs["logits"])[0]
        selects = "logit_rows" in self.inputs[calls[-1]]  # a last_only row then got one row of logits
        counts = [1 if selects and row.last_only else row.width for row in rows]
        starts = np.cumsum([0] + counts)
        return [logits[start : start + n] for n, start in zip(counts, starts)]

    def _logits(self, segment: Segment, logits: np.ndarray) -> np.ndarray:
        """A head graph's output as float32 logits over the whole vocabulary."""
        logits = logits.astype(np.float32, copy=False)
        if segment.head in self.draft_heads:  # a reduced draft vocabulary: back to token ids
            vocab = self.draft_heads[segment.head].vocab
            logits = np.stack([expand_logits(x, vocab, self.config.vocab_size) for x in logits])
        return logits

    def load_draft_head(self, head_file: str, root: Path | None) -> None:
        """Read a draft head file's vocabulary ids (its weights are in the graphs) for segments ending in it."""
        c = self.config
        self.draft_heads[head_file] = load_draft_head(Path(root or self.root) / head_file, c.hidden_size, c.vocab_size)


__all__ = ["OnnxBackend"]
