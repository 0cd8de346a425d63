"""ONNX Runtime backend: the exported graphs on a preallocated numpy KV cache (onnxruntime + numpy only).

Mirrors ``runtime/backends/torch/backend.py`` call for call. The KV cache is one numpy buffer per layer,
``[1, kv_heads, max_len, head_dim]``, plus a hidden-state buffer ``[1, max_len, d]`` for early exits;
rollback is only a smaller ``pos`` next time. How a graph reaches the cache depends on its variant
(the manifest records it per graph):

- ``fused`` graphs (GroupQueryAttention in its shared-buffer mode) take the whole buffer as past KV and
  write the new entries into it; the backend binds each layer's buffer, as one ``OrtValue``, to both
  the past input and the present output with IOBinding, once per ``reserve``. No call copies the past.
  Outputs are bound to fresh numpy arrays, and a prefix graph's ``hidden`` straight into the
  early-exit buffer, which the suffix and head graphs then read in place.
- ``standard`` graphs (ONNX ops only) concatenate past and new KV, so each call feeds the past slice
  ``[:, :, :pos]`` and writes the new entries of ``present`` back at ``pos .. pos+T-1``.

Weights are shared in memory by every session: ``weights.bin`` is read once, each unique tensor
becomes one ``OrtValue`` over that buffer, and every session receives it through
``SessionOptions.add_initializer`` under its own initializer names (with ORT weight prepacking
disabled, so sessions do not make packed copies). The graphs' external-data references are therefore
never read by ONNX Runtime.

This module must not import torch or transformers.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ..artifact.manifest import ArchConfig, DraftPlan
from ..drafting.kinds.adapter import DraftHead, expand_logits, load_draft_head
from ..errors import ArtifactError, BackendUnavailableError
from ..segments import FINAL_HEAD, Segment, full_model
from .base import Backend
from .graph_index import GraphIndex, full_model_without_verify

_NP = {"float32": np.float32, "float16": np.float16, "int64": np.int64, "uint8": np.uint8}


def stop_spinning_after_runs() -> bool:
    """Whether sessions stop their threads' spinning as soon as a call returns (``session.force_spinning_stop``).

    Why: every ONNX Runtime session has its own thread pool, whose threads spin for a while after a call. A
    plan with graphs of its own (precision drafts, early exits, layer skips, adapters) runs a draft session
    and the verify session in turns on the same cores, each while the other's threads still spin: on a
    2-core Xeon, SmolLM2-135M's 5-token verify after four int4 draft steps cost 1.85-1.97x its back-to-back
    time and each draft step 11.5-13.0 ms; with spinning stopped after each call, 1.01-1.03x and 7.1-7.6 ms,
    plain steps within 0-3% (threads still spin inside a call). Turning spinning off altogether cost plain
    decoding 20%; one process-wide pool would have done as well but makes every other onnxruntime session in
    the process (optimum's, a user's) fail unless it opts in. An artifact with one session (plain decoding,
    lookup plans) keeps onnxruntime's default.
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
    ):
        """``record`` is the manifest's ``backends["onnx"]``. ``providers`` overrides the execution
        providers chosen from ``device`` ("cpu" or "cuda"); ``threads`` is ORT's intra-op thread count
        (0: ORT's default); ``roles`` limits the sessions created to those graph keys (default: every
        graph in the record); ``mmap=True`` maps weights.bin read-only instead of reading it into
        private memory (pages then shared with the page cache and other processes).

        ``prepack`` (default on) lets ORT pre-pack weights for its matmul kernels: about 1.5x faster
        decoding and a verify of k tokens barely dearer than one step, which is what speculation needs;
        but every session keeps its own packed copy (the Python API has no shared pre-packed container).
        So when every plan is an early exit at the same block E, there is no separate ``verify``
        session: plain decoding runs prefix(E) then suffix(E), which together are the full model, and
        each weight is packed once. Artifacts with layer-skip plans need the full ``verify`` graph
        next to the draft graphs; ``prepack=False`` keeps them at one copy of the weights, slower.

        ``kv_in_place=False`` runs fused graphs the way standard graphs run (past slice in, present
        copied back): only there to measure what the in-place cache saves. ``plans``: the manifest's, for
        exports whose graph records predate their ``segment`` (``graph_index``)."""
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

        # -- the shared weights, read once ---------------------------------------------------------
        wpath = self.root / weights_rel
        if not wpath.is_file():
            raise ArtifactError(
                f"ONNX weights file {weights_rel!r} is missing from {str(self.root)!r}; restore it or rebuild the "
                "artifact with --backend onnx"
            )
        need = max([int(record.get("weights_bytes", 0))] + [t["offset"] + t["nbytes"] for t in tensors.values()])
        size = wpath.stat().st_size
        if size < need:
            raise ArtifactError(
                f"ONNX weights file {weights_rel!r} is truncated ({size} bytes, the graphs need {need}); restore it "
                "or rebuild the artifact with --backend onnx"
            )
        if mmap:
            self._blob = np.memmap(wpath, dtype=np.uint8, mode="r", shape=(need,))
        else:
            self._blob = np.fromfile(wpath, dtype=np.uint8, count=need)
        self._arrays: dict[tuple, np.ndarray] = {}
        self._ortvalues: dict[str, Any] = {}
        by_slot: dict[tuple, Any] = {}
        for name, t in tensors.items():
            slot = (t["offset"], t["nbytes"], t["dtype"], tuple(t["shape"]))
            if slot not in by_slot:
                arr = self._blob[t["offset"] : t["offset"] + t["nbytes"]].view(_NP[t["dtype"]]).reshape(t["shape"])
                self._arrays[slot] = arr
                by_slot[slot] = ort.OrtValue.ortvalue_from_numpy(arr)
            self._ortvalues[name] = by_slot[slot]

        # -- one session per graph, all on the same OrtValues ---------------------------------------
        self.sessions: dict[str, Any] = {}
        self.inputs: dict[str, list[str]] = {}
        self.outputs: dict[str, list[str]] = {}
        opened = [key for key in graphs if roles is None or key in roles]
        # Sessions take turns only when there is more than one; a lone verify session keeps onnxruntime's default
        self.spin_stop = len(opened) > 1 and stop_spinning_after_runs()
        for key in opened:
            self.sessions[key] = self._session(ort, key, graphs[key], threads)
        self.max_len = 0
        self.k: list[np.ndarray] = []
        self.v: list[np.ndarray] = []
        self.exit_hidden: np.ndarray | None = None
        self._kv_values: dict[str, Any] = {}  # "past_key_values.{i}.{key|value}" -> OrtValue over self.k / self.v
        self._bindings: dict[str, Any] = {}  # graph key -> IOBinding with the KV buffers bound
        self.draft_heads: dict[str, DraftHead] = {}  # plan.draft_head_file -> its draft head (vocabulary ids)
        self._tree_feed: dict[str, np.ndarray] | None = None  # a token tree's positions and mask, during its call

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
            if name not in self._ortvalues:
                raise ArtifactError(
                    f"ONNX graph {g['file']!r} needs tensor {name!r}, which the manifest's tensor table "
                    "lacks; rebuild the artifact with --backend onnx"
                )
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
    def from_artifact(cls, root: Path, manifest, device: str = "cpu", **kwargs) -> "OnnxBackend":
        if "onnx" not in manifest.backends:
            raise BackendUnavailableError("this artifact has no 'onnx' backend; rebuild with --backend onnx")
        backend = cls(
            Path(root), manifest.backends["onnx"], manifest.config, device=device, plans=manifest.plans, **kwargs
        )
        backend.check_plans(manifest.plans)
        return backend

    def unsupported(self, segment: Segment) -> str | None:
        reason = self.index.check(segment)
        return None if reason is None else f"{reason}; re-export with --backend onnx after changing plans"

    def replica(self) -> "OnnxBackend":
        """Another backend over the same sessions and weights with its own KV buffers (one per concurrent
        sequence): ORT sessions may be run from several threads at once."""
        other = copy.copy(self)
        other.max_len, other.k, other.v, other.exit_hidden = 0, [], [], None
        other._kv_values, other._bindings = {}, {}
        return other

    # -- cache -------------------------------------------------------------------------------------
    def reserve(self, max_len: int) -> None:
        """Make sure the KV buffers hold ``max_len`` positions; reuse them across requests."""
        c = self.config
        if not self.k or self.k[0].shape[2] < max_len:
            shape = (1, c.num_kv_heads, max_len, c.head_dim)
            self.k = [np.zeros(shape, self.dtype) for _ in range(c.num_layers)]
            self.v = [np.zeros(shape, self.dtype) for _ in range(c.num_layers)]
            self.exit_hidden = np.zeros((1, max_len, c.hidden_size), self.dtype)
            self._kv_values, self._bindings = {}, {}
            if self.fused:
                ort = _ort()
                for i in range(c.num_layers):
                    self._kv_values[f"past_key_values.{i}.key"] = ort.OrtValue.ortvalue_from_numpy(self.k[i])
                    self._kv_values[f"past_key_values.{i}.value"] = ort.OrtValue.ortvalue_from_numpy(self.v[i])
        self.max_len = max_len

    def _run(
        self,
        key: str,
        pos: int,
        ids: Sequence[int] | None = None,
        hidden: np.ndarray | None = None,
        hidden_out: np.ndarray | None = None,
    ):
        """Run graph ``key`` at position ``pos`` (past = cache[:pos]); return its outputs by name (not the
        KV, which is in the cache afterwards). A ``hidden`` output goes into ``hidden_out`` when given."""
        if key in self.fused:
            return self._run_in_place(key, pos, ids, hidden, hidden_out)
        feed: dict[str, np.ndarray] = {}
        t = len(ids) if ids is not None else hidden.shape[1]
        for name in self.inputs[key]:
            if name == "seqlens_k":
                feed[name] = np.array([pos + t - 1], dtype=np.int32)
            elif name == "total_sequence_length":
                feed[name] = np.array(pos + t, dtype=np.int32)
            elif name == "input_ids":
                feed[name] = np.asarray([list(ids)], dtype=np.int64)
            elif name == "hidden":
                feed[name] = np.ascontiguousarray(hidden, dtype=self.dtype)
            elif name in ("position_ids", "attention_bias"):
                feed[name] = self._position_feed(name, pos, t)
            elif name.startswith("past_key_values."):
                _, layer, kind = name.split(".")
                buf = self.k[int(layer)] if kind == "key" else self.v[int(layer)]
                feed[name] = np.ascontiguousarray(buf[:, :, :pos])
        outs = dict(zip(self.outputs[key], self.sessions[key].run(self.outputs[key], feed)))
        for name, value in outs.items():
            if name.startswith("present."):
                _, layer, kind = name.split(".")
                buf = self.k[int(layer)] if kind == "key" else self.v[int(layer)]
                buf[:, :, pos : pos + t] = value[:, :, pos : pos + t]
        if hidden_out is not None and "hidden" in outs:
            hidden_out[...] = outs["hidden"]
        return outs

    def _binding(self, key: str):
        """The IOBinding of graph ``key`` with every layer's KV buffer bound as past input and present
        output (the same OrtValue), made once per ``reserve``."""
        io = self._bindings.get(key)
        if io is None:
            io = self.sessions[key].io_binding()
            for name in self.inputs[key]:
                if name.startswith("past_key_values."):
                    io.bind_ortvalue_input(name, self._kv_values[name])
            for name in self.outputs[key]:
                if name.startswith("present."):
                    io.bind_ortvalue_output(name, self._kv_values["past_key_values." + name[len("present.") :]])
            self._bindings[key] = io
        return io

    def _run_in_place(self, key: str, pos: int, ids, hidden, hidden_out):
        t = len(ids) if ids is not None else hidden.shape[1]
        io = self._binding(key)
        keep = []  # arrays bound by pointer must outlive the run
        for name in self.inputs[key]:
            if name == "input_ids":
                value = np.asarray([list(ids)], dtype=np.int64)
            elif name == "hidden":
                value = np.ascontiguousarray(hidden, dtype=self.dtype)
            elif name == "seqlens_k":
                value = np.array([pos + t - 1], dtype=np.int32)
            elif name == "total_sequence_length":
                value = np.array(pos + t, dtype=np.int32)
            elif name in ("position_ids", "attention_bias"):
                value = self._position_feed(name, pos, t)
            else:
                continue
            keep.append(value)
            io.bind_cpu_input(name, value)
        outs: dict[str, np.ndarray] = {}
        for name in self.outputs[key]:
            if name.startswith("present."):
                continue
            if name == "hidden" and hidden_out is not None:
                value = hidden_out
            else:
                width = self.config.vocab_size if name == "logits" else self.config.hidden_size
                value = np.empty((1, t, width), self.dtype)
            io.bind_output(name, "cpu", 0, self.dtype, list(value.shape), value.ctypes.data)
            outs[name] = value
        self.sessions[key].run_with_iobinding(io)
        return outs

    def _position_feed(self, name: str, pos: int, t: int) -> np.ndarray:
        """``position_ids`` / ``attention_bias`` of a call: a token tree's (``forward_tree``) or a chain's
        (positions ``pos..pos+t-1``, a zero bias: the kernel's causal mask alone)."""
        if self._tree_feed is not None:
            return self._tree_feed[name]
        if name == "position_ids":
            return np.arange(pos, pos + t, dtype=np.int64)[None]
        return np.zeros((1, 1, t, pos + t), self.dtype)

    # -- token trees (runtime/tree.py) -------------------------------------------------------------
    def tree_unsupported(self) -> str | None:
        calls = self.index.calls(full_model(self.config.num_layers))
        if not calls or len(calls) != 1 or "attention_bias" not in self.inputs.get(calls[0], []):
            return "this export's full-model graph takes no tree mask (rebuild the artifact with --backend onnx)"
        return None

    def tree_fits(self, pos: int, t: int) -> bool:
        """GroupQueryAttention counts a sliding window in cache slots, and a tree node's position is smaller than
        its slot: the two windows agree while the call's last slot is inside the window."""
        c = self.config
        windows = [w for w in (c.window_of(i) for i in range(c.num_layers)) if w is not None]
        return not windows or pos + t <= min(windows)

    def forward_tree(self, tokens: Sequence[int], parents: Sequence[int], pos: int) -> np.ndarray:
        from ..tree import attention_rows, depths

        t = len(tokens)
        bias = np.zeros((1, 1, t, pos + t), self.dtype)
        bias[0, 0, :, pos:][~attention_rows(parents)] = np.finfo(self.dtype).min
        positions = pos + np.array([0] + depths(parents), dtype=np.int64)[None]
        self._tree_feed = {"position_ids": positions, "attention_bias": bias}
        try:
            return self.forward(tokens, pos)
        finally:
            self._tree_feed = None

    def keep_rows(self, pos: int, moves: Sequence[tuple[int, int]]) -> None:
        if not moves:
            return
        src, dst = [pos + a for a, _ in moves], [pos + b for _, b in moves]
        for buf in self.k + self.v:  # [1, kv_heads, max_len, head_dim], the OrtValues' memory
            buf[:, :, dst] = buf[:, :, src]

    @staticmethod
    def _logits(x: np.ndarray) -> np.ndarray:
        return x[0].astype(np.float32, copy=False)

    # -- the backend interface ---------------------------------------------------------------------
    def run(self, segment: Segment, pos: int, tokens: Sequence[int] | None = None, count: int = 0) -> np.ndarray | None:
        """The segment's graphs in turn (``graph_index``): a blocks graph, then a head graph on its hidden
        state. Hidden states the segment keeps go straight into the hidden buffer, where segments that
        start from them read them in place."""
        calls = self.index.calls(segment)
        if calls is None:
            raise ArtifactError(
                f"the ONNX export has no graphs for {segment.describe()}; rebuild the artifact with --backend onnx"
            )
        if segment.head not in (None, FINAL_HEAD) and segment.head not in self.draft_heads:
            raise ArtifactError(
                f"draft head {segment.head!r} was not loaded; open the artifact with speccompile.runtime.load"
            )
        t = len(tokens) if segment.from_tokens else count
        ids = tokens if segment.from_tokens else None
        hidden = None if segment.from_tokens else self.exit_hidden[:, pos : pos + t]
        for i, key in enumerate(calls):
            keep = self.exit_hidden[:, pos : pos + t] if segment.keep_hidden and i == 0 else None
            outs = self._run(key, pos, ids=ids, hidden=hidden, hidden_out=keep)
            ids, hidden = None, outs.get("hidden", outs.get("last_hidden"))
        if segment.head is None:
            return None
        logits = self._logits(outs["logits"])
        if segment.head in self.draft_heads:  # a reduced draft vocabulary: back to token ids
            logits = expand_logits(logits, self.draft_heads[segment.head].vocab, self.config.vocab_size)
        return logits

    def load_draft_head(self, head_file: str, root: Path | None) -> None:
        """Read a draft head file's vocabulary ids (its weights are in the graphs) for segments ending in it."""
        c = self.config
        self.draft_heads[head_file] = load_draft_head(Path(root or self.root) / head_file, c.hidden_size, c.vocab_size)


__all__ = ["OnnxBackend"]
