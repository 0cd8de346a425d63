"""Resident memory the process no longer needs, given back: clean pages of a mapped weights file that nothing
reads any more, and heap freed by closed sessions.

Used by the runtime (the torch backend drops the pages of the projections it re-stores concatenated) and by the
build (the torch decoder's weights and ONNX Runtime's packed copy are not both in memory at once,
``speccompile/runners.py``).
"""

from __future__ import annotations

import ctypes
import mmap
import sys
from collections.abc import Iterable
from contextlib import contextmanager

import numpy as np

_MADV_DONTNEED = 4
_FILE_PAGE, _PRESENT = np.uint64(1 << 61), np.uint64(1 << 63)  # /proc/PID/pagemap entry bits


def drop_file_pages(tensors: Iterable, whole_storage: bool = True) -> int:
    """Take the pages of ``tensors`` (torch tensors or numpy arrays) that are unmodified pages of a mapped file
    out of this process's resident set; returns the bytes dropped (0 where the system cannot tell).

    Why: transformers maps a model's safetensors file and the canonical decoder reads its weights from that
    mapping, so they are resident once the build has read them. While ONNX Runtime holds its own packed copy
    of the same weights (its sessions time and confirm plans), the build's torch copy is not read: dropping
    its pages keeps the build at about one copy of the weights, not two. A page the torch side reads again is
    mapped back from the page cache (or read from the file), byte for byte the same. Only clean file pages are
    dropped (``/proc/self/pagemap``'s file-page bit): a page the process wrote to is anonymous memory, whose
    contents ``MADV_DONTNEED`` would discard, and is left alone.

    ``whole_storage`` False: only the bytes of each torch tensor itself (a contiguous tensor; others are
    skipped), not the rest of its storage: the torch backend drops the projections it has re-stored as one
    concatenated product while the other weights of the same mapped file stay in use (a page at either end
    that a neighbour shares comes back from the page cache when the neighbour is read)."""
    if not sys.platform.startswith("linux"):
        return 0
    page = mmap.PAGESIZE
    spans = []
    for t in tensors:
        if hasattr(t, "untyped_storage"):  # a torch tensor (no torch import here): its whole storage, the mapped
            # file for weights transformers loaded, so that tensors the decoder replaced by packed copies go too
            if t.device.type != "cpu":
                continue
            if whole_storage:
                storage = t.untyped_storage()
                start, size = storage.data_ptr(), storage.nbytes()
            elif t.is_contiguous():
                start, size = t.data_ptr(), t.numel() * t.element_size()
            else:
                continue
            if size == 0:
                continue
        else:
            arr = np.asarray(t)
            if arr.size == 0:
                continue
            start, size = arr.__array_interface__["data"][0], arr.nbytes
        first, last = start // page, (start + size - 1) // page  # the pages the tensor touches, whole
        spans.append((first, last + 1))
    if not spans:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    dropped = 0
    try:
        pagemap = open("/proc/self/pagemap", "rb", buffering=0)
    except OSError:
        return 0
    with pagemap:
        for first, stop in _merged(spans):
            pagemap.seek(first * 8)
            raw, need = bytearray(), (stop - first) * 8
            while len(raw) < need:  # the kernel answers a large read in parts
                part = pagemap.read(need - len(raw))
                if not part:
                    break
                raw += part
            entries = np.frombuffer(bytes(raw[: len(raw) // 8 * 8]), dtype=np.uint64)
            stop = first + len(entries)
            clean = (entries & _FILE_PAGE != 0) & (entries & _PRESENT != 0)
            edges = np.flatnonzero(np.diff(np.concatenate(([0], clean.view(np.int8), [0]))))
            for lo, hi in zip(edges[::2], edges[1::2]):
                if libc.madvise((first + int(lo)) * page, int(hi - lo) * page, _MADV_DONTNEED) == 0:
                    dropped += int(hi - lo) * page
    return dropped


def _merged(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for lo, hi in sorted(spans):
        if out and lo <= out[-1][1]:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return [(lo, hi) for lo, hi in out]


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
LARGE_BLOCK_BYTES = 4 << 20  # inside ``large_blocks_returned``: blocks this big get mappings of their own
HEAP_BLOCK_BYTES = 32 << 20  # after it: the largest threshold glibc's own adjustment reaches (64-bit)


@contextmanager
def large_blocks_returned():
    """Inside: every allocation of at least ``LARGE_BLOCK_BYTES`` is a mapping of its own, given back to the
    system when freed; after: blocks under ``HEAP_BLOCK_BYTES`` come from the heap again (fast to reuse), and
    the heap's free pages are given back. No effect where glibc is not the allocator.

    Why: making many long-lived small tensors from big temporaries (a weight's fp32 copies while it is
    encoded) on the heap leaves the freed temporaries between the kept tensors, resident: several times the
    kept tensors' bytes. Not for the whole build: a temporary that is made on every call (a de-quantized weight
    per product) would then be a fresh mapping, zeroed, each time, and each call much slower (both measured:
    docs/history.md, 'Figures behind the code's constants')."""
    mallopt = _glibc("mallopt")
    if mallopt is not None:
        mallopt(M_MMAP_THRESHOLD, LARGE_BLOCK_BYTES)
    try:
        yield
    finally:
        if mallopt is not None:
            mallopt(M_MMAP_THRESHOLD, HEAP_BLOCK_BYTES)
        return_freed_memory()


def _glibc(name: str):
    if not sys.platform.startswith("linux"):
        return None
    try:
        return getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError):  # not glibc (musl has neither mallopt's parameter nor malloc_trim)
        return None


def return_freed_memory() -> None:
    """Collect unreachable objects (ONNX Runtime sessions sit in reference cycles) and hand the C heap's free memory
    back to the system (glibc keeps freed blocks of a large allocation for reuse otherwise: a build that closed its
    sessions still held much of their packed weights; measured: docs/history.md, 'Figures behind the code's
    constants')."""
    import gc

    gc.collect()
    malloc_trim = _glibc("malloc_trim")
    if malloc_trim is not None:
        malloc_trim(0)


__all__ = ["drop_file_pages", "large_blocks_returned", "return_freed_memory"]
