"""TensorRT backend: one engine per exported ONNX graph, KV cache in device memory (tensorrt + cuda-python).

Mirrors ``runtime/backends/onnx/backend.py`` (standard graphs) segment for segment, with device buffers instead of
numpy arrays:

- the KV cache is one device buffer per layer and kind, ``[1, kv_heads, max_len, head_dim]``; a call
  at ``pos`` copies each running layer's first ``pos`` entries into a contiguous staging buffer (the
  graph's ``past_key_values`` input, ``cudaMemcpy2DAsync``, device to device), the engine writes
  ``present`` into a second staging buffer, and the new entries ``pos .. pos+T-1`` are copied back;
  rollback after a rejection is only a smaller ``pos`` next time;
- early exits keep the prefix's ``hidden`` output in a device buffer ``[1, max_len, d]``: the prefix
  engine writes it in place at ``pos``, the suffix and head engines read it there;
- token ids go up and logits come down once per call; the only host syncs are that download.

Engines are weight-stripped (``BuilderFlag.STRIP_PLAN`` + ``REFIT_IDENTICAL``) and refitted at load
from the artifact's one ``onnx/weights.bin`` (``refit_weights``): every weight is stored once. They
run only on the GPU model and TensorRT version they were built with (``check_target``). Each engine has
two optimization profiles (``speccompile/exporters/tensorrt.py``): ``step`` (1..S tokens: decode, draft,
verify) and ``prefill`` (up to P tokens; longer prompts are run in chunks of P).

``engines`` and ``memory`` are injectable: ``tests/test_tensorrt.py`` runs this exact bookkeeping on
CPU with the same ONNX graphs on ONNX Runtime over host buffers. This module imports no torch; it
imports numpy only until a backend is opened.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ...artifact.manifest import ArchConfig, DraftPlan
from ...errors import ArtifactError, BackendUnavailableError, InputError
from ...segments import FINAL_HEAD, Segment
from ..base import Backend
from ..graph_index import GraphIndex

_NP = {"float32": np.float32, "float16": np.float16, "int64": np.int64, "int32": np.int32, "uint8": np.uint8}


def tensorrt_module():
    """``import tensorrt``, or a one-line error naming the install."""
    from .cuda import INSTALL

    try:
        import tensorrt
    except ImportError:
        raise BackendUnavailableError(
            f"the tensorrt backend needs TensorRT; install it ({INSTALL}) on a machine with an NVIDIA GPU, or use "
            "--backend onnx"
        ) from None
    return tensorrt


def describe_target(target: dict) -> str:
    return (
        f"{target.get('gpu', '?')} (compute capability {target.get('compute_capability', '?')}) with TensorRT "
        f"{target.get('tensorrt_version', '?')}"
    )


def check_target(built: dict, here: dict) -> None:
    """TensorRT engines run only on the GPU model and TensorRT version that built them: refuse others
    with both named (TensorRT itself would fail deep in deserialisation, or silently run slow kernels)."""
    keys = ("gpu", "compute_capability", "tensorrt_version")
    if any(str(built.get(k)) != str(here.get(k)) for k in keys):
        raise ArtifactError(
            f"this artifact's TensorRT engines were built for {describe_target(built)}, but this machine has "
            f"{describe_target(here)}; rebuild the artifact here with --backend tensorrt (or use --backend onnx)"
        )


def refit_weights(names: Sequence[str], record: dict, blob: np.ndarray) -> tuple[dict[str, np.ndarray], list[str]]:
    """The arrays for an engine's refittable weights, by name, as views of the shared weights file
    ``blob`` (the engine's weight names are the ONNX initializer names, i.e. the canonical names), and
    the names the file does not hold (refitted from the ONNX graph file instead)."""
    tensors = record["tensors"]
    found, missing = {}, []
    for name in names:
        t = tensors.get(name)
        if t is None:
            missing.append(name)
            continue
        end = t["offset"] + t["nbytes"]
        if end > blob.size:
            raise ArtifactError(
                f"weights file {record['weights']!r} is truncated (tensor {name!r} ends at byte {end}, "
                f"the file has {blob.size}); restore it or rebuild the artifact"
            )
        found[name] = blob[t["offset"] : end].view(_NP[t["dtype"]]).reshape(t["shape"])
    return found, missing


class TensorRTEngines:
    """The engines of one artifact, deserialised, refitted and with one execution context per profile.

    ``run`` binds device addresses and input shapes and enqueues the engine on ``memory``'s stream."""

    def __init__(self, root: Path, record: dict[str, Any], memory, keys: Sequence[str] | None = None):
        if root is None:  # with_memory(): filled in by the caller
            return
        trt = self.trt = tensorrt_module()
        self.memory = memory
        built = record.get("target", {})
        info = memory.info()
        check_target(
            built,
            {"gpu": info.name, "compute_capability": info.compute_capability, "tensorrt_version": trt.__version__},
        )
        self.logger = trt.Logger(trt.Logger.WARNING)
        runtime = trt.Runtime(self.logger)
        blob = np.memmap(Path(root) / record["weights"], dtype=np.uint8, mode="r")
        self.engines, self.contexts = {}, {}
        for key, entry in record["engines"].items():
            if keys is not None and key not in keys:
                continue
            path = Path(root) / entry["file"]
            if not path.is_file():
                raise ArtifactError(
                    f"TensorRT engine {entry['file']!r} is missing; rebuild the artifact with --backend tensorrt"
                )
            engine = runtime.deserialize_cuda_engine(path.read_bytes())
            if engine is None:
                raise ArtifactError(
                    f"TensorRT could not load engine {entry['file']!r} (corrupted, or built by another "
                    "TensorRT); rebuild the artifact with --backend tensorrt"
                )
            self._refit(engine, Path(root) / record["graphs"][key]["file"], record, blob, entry["file"])
            self.engines[key], self.contexts[key] = engine, self._contexts(engine)

    def _contexts(self, engine) -> list:
        """One execution context per optimization profile, on this object's stream."""
        contexts = []
        for index in range(engine.num_optimization_profiles):
            context = engine.create_execution_context()
            context.set_optimization_profile_async(index, self.memory.stream_handle)
            contexts.append(context)
        return contexts

    def with_memory(self, memory) -> "TensorRTEngines":
        """The same engines (weights on the device once) with new execution contexts on ``memory``'s
        stream: what a replica needs to run concurrently."""
        other = TensorRTEngines(None, {}, memory)
        other.trt, other.logger, other.memory, other.engines = self.trt, self.logger, memory, self.engines
        other.contexts = {key: other._contexts(engine) for key, engine in self.engines.items()}
        return other

    def _refit(self, engine, onnx_path: Path, record: dict, blob: np.ndarray, name: str) -> None:
        trt = self.trt
        refitter = trt.Refitter(engine, self.logger)
        arrays, missing = refit_weights(refitter.get_all_weights(), record, blob)
        for weight, array in arrays.items():
            if not refitter.set_named_weights(weight, trt.Weights(np.ascontiguousarray(array))):
                raise ArtifactError(
                    f"TensorRT refused weight {weight!r} for engine {name!r} (shape or type differs); "
                    "rebuild the artifact with --backend tensorrt"
                )
        if missing or refitter.get_missing_weights():
            # Weights the ONNX parser named itself (constants it made refittable): the graph file has them.
            if not trt.OnnxParserRefitter(refitter, self.logger).refit_from_file(str(onnx_path)):
                raise ArtifactError(
                    f"TensorRT could not refit engine {name!r} from {onnx_path.name}; rebuild the "
                    "artifact with --backend tensorrt"
                )
        left = refitter.get_missing_weights()
        if left or not refitter.refit_cuda_engine():
            raise ArtifactError(
                f"TensorRT engine {name!r} could not be refitted (missing weights: {list(left)[:3]}); "
                "rebuild the artifact with --backend tensorrt"
            )

    def run(self, key: str, profile: int, shapes: dict[str, tuple], addresses: dict[str, int]) -> None:
        context = self.contexts[key][profile]
        for name, shape in shapes.items():
            if not context.set_input_shape(name, shape):
                raise InputError(
                    f"input {name} of shape {shape} is outside engine {key!r}'s profile; rebuild the "
                    "artifact with --backend tensorrt for longer contexts"
                )
        for name, address in addresses.items():
            context.set_tensor_address(name, address)
        if not context.execute_async_v3(self.memory.stream_handle):
            raise ArtifactError(f"TensorRT engine {key!r} failed to run; rerun with --debug for the TensorRT log")


class TensorRTBackend(Backend):
    name = "tensorrt"

    def __init__(
        self,
        root: Path,
        record: dict[str, Any],
        config: ArchConfig,
        device: str = "cuda",
        engines=None,
        memory=None,
        plans: dict[str, DraftPlan] | None = None,
    ):
        """``record`` is the manifest's ``backends["tensorrt"]``. ``device`` "cuda:N" picks the GPU
        ("cpu", the CLI's default, and "cuda" mean GPU 0: TensorRT runs nowhere else)."""
        self.root, self.record, self.config = Path(root), record, config
        try:
            self.graphs: dict[str, dict] = record["graphs"]
            self.context_len = int(record["context"])
            full_split = set(record["full_split"]) if record.get("full_split") else None
            engines_built = set(self.graphs) - {"verify"} if full_split else set(self.graphs)
            self.index = GraphIndex(record, plans or {}, config.num_layers, opened=engines_built)
            self.step_tokens = int(record["profiles"]["step"]["max_tokens"])
            self.chunk = int(record["profiles"]["prefill"]["max_tokens"])
            self.dtype = np.dtype(_NP[record.get("dtype", "float32")])
        except (KeyError, TypeError, ValueError) as exc:
            raise ArtifactError(
                f"manifest backends['tensorrt'] is malformed ({exc}); rebuild the artifact with --backend tensorrt"
            ) from None
        if engines is None:
            tensorrt_module()  # the install hint first, before any CUDA call
        if memory is None:
            from .cuda import CudaMemory

            index = int(device.partition(":")[2] or 0) if device.startswith("cuda") else 0
            memory = CudaMemory(index)
        self.memory = memory
        self.engines = engines if engines is not None else TensorRTEngines(self.root, record, memory)
        self.max_len = 0
        self._allocated = 0
        self.buffers: dict[str, int] = {}

    @classmethod
    def from_artifact(cls, root: Path, manifest, plans: dict, device: str = "cuda", **kwargs) -> "TensorRTBackend":
        """``plans``: the manifest's plans read (``drafting.check_plans``)."""
        if "tensorrt" not in manifest.backends:
            raise BackendUnavailableError("this artifact has no 'tensorrt' backend; rebuild with --backend tensorrt")
        return cls(Path(root), manifest.backends["tensorrt"], manifest.config, device=device, plans=plans, **kwargs)

    def replica(self) -> "TensorRTBackend":
        """Another backend over the same engines (weights on the device once) with its own stream,
        execution contexts and KV buffers: one per concurrent sequence."""
        memory = type(self.memory)(getattr(self.memory, "index", 0))
        other = TensorRTBackend(
            self.root, self.record, self.config, engines=self.engines.with_memory(memory), memory=memory
        )
        other.index = self.index
        return other

    # -- buffers -----------------------------------------------------------------------------------
    def _row(self) -> int:
        return self.config.head_dim * self.dtype.itemsize

    def reserve(self, max_len: int, slots: int = 1) -> None:
        """Device buffers for ``max_len`` positions: cache, past / present staging per layer and kind,
        early-exit hidden states, token ids, positions and logits; reused across requests. One sequence
        (``slots`` is for batched backends; a batch runs on replicas, ``slots.ReplicaSlots``)."""
        if max_len > self.context_len:
            raise InputError(
                f"this TensorRT artifact's engines cover {self.context_len} positions, the request "
                f"needs {max_len}; ask for fewer tokens or rebuild with --backend tensorrt"
            )
        if max_len > self._allocated:
            c, m = self.config, self.memory
            kv_bytes = c.num_kv_heads * max_len * self._row()
            for layer in range(c.num_layers):
                for kind in ("key", "value"):
                    for role in ("cache", "past", "present"):
                        self.buffers[f"{role}.{layer}.{kind}"] = m.alloc(kv_bytes)
            self.buffers["hidden"] = m.alloc(max_len * c.hidden_size * self.dtype.itemsize)
            self.buffers["input_ids"] = m.alloc(max_len * 8)
            self.buffers["position_ids"] = m.alloc(max_len * 8)
            rows = min(max_len, max(self.chunk, self.step_tokens))
            self.buffers["logits"] = m.alloc(rows * c.vocab_size * self.dtype.itemsize)
            self._allocated = max_len
        self.max_len = max_len

    def _hidden_at(self, pos: int) -> int:
        return self.buffers["hidden"] + pos * self.config.hidden_size * self.dtype.itemsize

    # -- one engine call ---------------------------------------------------------------------------
    def _run(
        self,
        key: str,
        pos: int,
        t: int,
        ids: Sequence[int] | None = None,
        hidden_at: int | None = None,
        hidden_out_at: int | None = None,
        logits: bool = True,
    ) -> np.ndarray | None:
        """Run engine ``key`` on ``t`` tokens at ``pos`` (past = cache[:pos]); the logits ``[t, V]`` if asked."""
        c, m, b = self.config, self.memory, self.buffers
        if pos + t > self._allocated:
            raise InputError(
                f"positions {pos}..{pos + t - 1} are past the reserved cache ({self._allocated}); "
                "reserve() a longer cache first"
            )
        row, kv_heads = self._row(), c.num_kv_heads
        full_pitch = self._allocated * row
        shapes, addresses, presents = {}, {}, []
        for spec in self.graphs[key]["inputs"]:
            name = spec["name"]
            if name == "input_ids":
                m.to_device(b["input_ids"], np.asarray(ids, dtype=np.int64))
                shapes[name], addresses[name] = (1, t), b["input_ids"]
            elif name == "position_ids":
                m.to_device(b["position_ids"], np.arange(pos, pos + t, dtype=np.int64))
                shapes[name], addresses[name] = (1, t), b["position_ids"]
            elif name == "hidden":
                shapes[name], addresses[name] = (1, t, c.hidden_size), hidden_at
            elif name.startswith("past_key_values."):
                _, layer, kind = name.split(".")
                past = b[f"past.{layer}.{kind}"]
                m.copy_2d(past, pos * row, b[f"cache.{layer}.{kind}"], full_pitch, pos * row, kv_heads)
                shapes[name], addresses[name] = (1, kv_heads, pos, c.head_dim), past
        for spec in self.graphs[key]["outputs"]:
            name = spec["name"]
            if name == "logits":
                addresses[name] = b["logits"]
            elif name == "hidden":
                addresses[name] = hidden_out_at
            elif name.startswith("present."):
                _, layer, kind = name.split(".")
                addresses[name] = b[f"present.{layer}.{kind}"]
                presents.append((b[f"cache.{layer}.{kind}"], b[f"present.{layer}.{kind}"]))
        profile = 0 if t <= self.step_tokens else 1
        self.engines.run(key, profile, shapes, addresses)
        for cache, present in presents:  # the new entries pos..pos+t-1 back into the cache
            m.copy_2d(cache + pos * row, full_pitch, present + pos * row, (pos + t) * row, t * row, kv_heads)
        if not logits:
            return None
        out = np.empty((t, c.vocab_size), dtype=self.dtype)
        return m.to_host(out, b["logits"]).astype(np.float32, copy=False)

    # -- the backend interface ---------------------------------------------------------------------
    def run(self, segment: Segment, pos: int, tokens: Sequence[int] | None = None, count: int = 0) -> np.ndarray | None:
        """The segment's engines in turn (``graph_index``); hidden states go through the device buffer at
        their positions. Token runs longer than the step profile (prompts) run in chunks of the prefill
        profile: the same logits, one engine shape."""
        t = len(tokens) if segment.from_tokens else count
        if t > max(self.step_tokens, self.chunk) and segment.from_tokens:
            parts = [
                self.run(segment, pos + s, tokens=list(tokens[s : s + self.chunk])) for s in range(0, t, self.chunk)
            ]
            return None if segment.head is None else np.concatenate(parts)
        calls = self.index.calls(segment)
        if calls is None:
            raise ArtifactError(
                f"the TensorRT engines have no engine for {segment.describe()}; rebuild the artifact "
                "with --backend tensorrt"
            )
        ids = list(tokens) if segment.from_tokens else None
        hidden_at = None if segment.from_tokens else self._hidden_at(pos)
        out = None
        for i, key in enumerate(calls):
            last = i == len(calls) - 1
            out = self._run(
                key,
                pos,
                t,
                ids=ids,
                hidden_at=hidden_at,
                hidden_out_at=self._hidden_at(pos),
                logits=last and segment.head is not None,
            )
            ids, hidden_at = None, self._hidden_at(pos)
        return out

    def unsupported(self, segment: Segment) -> str | None:
        if segment.head not in (None, FINAL_HEAD):
            return "TensorRT engines have no draft heads (exit adapters, reduced vocabularies) yet; use another plan"
        reason = self.index.check(segment)
        return None if reason is None else f"{reason}; rebuild the artifact with --backend tensorrt"

    def load_draft_head(self, head_file: str, root: Path | None) -> None:
        raise ArtifactError(
            f"draft head {head_file!r}: TensorRT engines have no draft heads (exit adapters, reduced "
            "vocabularies) yet; use another plan or the onnx backend"
        )


__all__ = ["TensorRTBackend", "TensorRTEngines", "check_target", "refit_weights", "tensorrt_module"]
