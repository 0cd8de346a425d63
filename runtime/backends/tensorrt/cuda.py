"""The few CUDA runtime calls the TensorRT backend needs, on cuda-python (no torch, no pycuda).

One stream per device object; every copy is queued on it, and ``to_host`` synchronises (the one host
sync of a call). ``copy_2d`` is ``cudaMemcpy2DAsync``: ``height`` rows of ``width`` bytes from a
source with row pitch ``spitch`` to a destination with row pitch ``dpitch`` (how a KV cache laid out
``[kv_heads, max_len, head_dim]`` is sliced into the contiguous ``[kv_heads, pos, head_dim]`` that a
TensorRT input needs, and back).

``HostMemory`` in ``tests/test_tensorrt.py`` implements the same five calls on host memory, so the
backend's buffer bookkeeping runs on a machine without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...errors import BackendUnavailableError

INSTALL = 'pip install tensorrt "cuda-python>=12.6.1,<13"'


def cuda_runtime():
    """cuda-python's runtime module (``cuda.bindings.runtime`` from 12.6.1, ``cuda.cudart`` before)."""
    try:
        from cuda.bindings import runtime
    except ImportError:
        try:
            from cuda import cudart as runtime
        except ImportError:
            raise BackendUnavailableError(
                f"the tensorrt backend needs cuda-python; install it ({INSTALL}) or use --backend onnx"
            ) from None
    return runtime


@dataclass(frozen=True)
class GpuInfo:
    name: str
    compute_capability: str  # "8.7" (Orin), "9.0" (H100/H200)
    total_memory: int


class CudaMemory:
    """Device allocations and stream-ordered copies on GPU ``index``."""

    def __init__(self, index: int = 0):
        self.rt = cuda_runtime()
        self.index = index
        self._check(self.rt.cudaSetDevice(index), f"select GPU {index}")
        self.stream = self._check(self.rt.cudaStreamCreate(), "create a CUDA stream")
        self._allocations: list[int] = []
        self._pending: list[np.ndarray] = []

    def _check(self, result, what: str):
        err, *rest = result if isinstance(result, tuple) else (result,)
        if int(err) != 0:
            _, text = self.rt.cudaGetErrorString(err)
            message = text.decode() if isinstance(text, bytes) else str(text)
            raise BackendUnavailableError(
                f"CUDA could not {what} ({message}); the tensorrt backend needs an NVIDIA GPU "
                "with a working driver, or use --backend onnx"
            )
        return rest[0] if len(rest) == 1 else (rest or None)

    def info(self) -> GpuInfo:
        props = self._check(self.rt.cudaGetDeviceProperties(self.index), "read the GPU's properties")
        name = props.name.decode(errors="replace") if isinstance(props.name, bytes) else str(props.name)
        return GpuInfo(name.rstrip("\x00").strip(), f"{props.major}.{props.minor}", int(props.totalGlobalMem))

    @property
    def stream_handle(self) -> int:
        return int(self.stream)

    def alloc(self, nbytes: int) -> int:
        ptr = int(self._check(self.rt.cudaMalloc(max(int(nbytes), 1)), f"allocate {nbytes} bytes"))
        self._allocations.append(ptr)
        return ptr

    def copy_2d(self, dst: int, dpitch: int, src: int, spitch: int, width: int, height: int) -> None:
        if width and height:
            kind = self.rt.cudaMemcpyKind.cudaMemcpyDeviceToDevice
            self._check(
                self.rt.cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, height, kind, self.stream), "copy KV entries"
            )

    def to_device(self, dst: int, array: np.ndarray) -> None:
        array = np.ascontiguousarray(array)
        kind = self.rt.cudaMemcpyKind.cudaMemcpyHostToDevice
        self._check(self.rt.cudaMemcpyAsync(dst, array.ctypes.data, array.nbytes, kind, self.stream), "copy inputs")
        self._pending.append(array)  # the copy may still read it: kept until the next synchronisation

    def to_host(self, array: np.ndarray, src: int) -> np.ndarray:
        kind = self.rt.cudaMemcpyKind.cudaMemcpyDeviceToHost
        self._check(self.rt.cudaMemcpyAsync(array.ctypes.data, src, array.nbytes, kind, self.stream), "copy outputs")
        self._check(self.rt.cudaStreamSynchronize(self.stream), "finish the step")
        self._pending.clear()
        return array

    def close(self) -> None:
        for ptr in self._allocations:
            self.rt.cudaFree(ptr)
        self._allocations = []

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown: the runtime module may be gone
            pass


__all__ = ["CudaMemory", "GpuInfo", "INSTALL", "cuda_runtime"]
