"""Which machine a timing was taken on, in one line: what decides whether a stored timing may be reused.

Why: call costs timed by the build (``runtime/decoding/load.py``, ``CallCosts``) are worth reusing at load only
on the machine they describe. The processor's model name alone does not say it: this project's machines
report "AMD EPYC" for a Zen 2 with 16 MB of L3 and AVX2 and for a Zen 4 with 32 MB and AVX-512 VNNI, whose
batched calls cost differently. So the key adds the cache size, the vector extensions the kernels pick
between, and the cores the process may use; a backend off the CPU adds its device string (not the GPU's
model: a stored timing from another GPU model under the same device string would be reused).
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

KERNEL_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "asimd", "sve")


def _first_processor() -> dict[str, str]:
    """The first processor's block of /proc/cpuinfo (it says it for all), {} where there is none."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if not line.strip():
                    break
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def cpu_model_name(fields: dict[str, str] | None = None) -> str:
    """The CPU's model name ("AMD EPYC"); ``platform`` names the architecture where /proc/cpuinfo has none."""
    fields = _first_processor() if fields is None else fields
    return fields.get("model name") or platform.processor() or platform.machine()


def cpu_description() -> str:
    """ "<model name>, <cache size> cache, <vector extensions>, <n> cores" from /proc/cpuinfo (where there is one)."""
    fields = _first_processor()
    flags = set((fields.get("flags") or fields.get("Features") or "").split())
    parts = [cpu_model_name(fields)]
    if fields.get("cache size"):
        parts.append(f"{fields['cache size']} cache")
    parts.append("+".join(f for f in KERNEL_FLAGS if f in flags) or "no listed vector extensions")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    parts.append(f"{cores} cores")
    return ", ".join(parts)


def last_level_cache_bytes() -> int | None:
    """Bytes of the largest CPU cache (the last level: L3 on this project's machines, which /proc/cpuinfo's
    "cache size" does not give on AMD), from sysfs; None where it is not readable."""
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip().upper()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * scale)
    return max(sizes) if sizes else None


def machine_key(backend) -> str:
    """What a timing on ``backend`` depends on besides the model: backend, device and processor."""
    device = str(getattr(backend, "device", "cpu") or "cpu")
    return f"{backend.name} on {device}: {cpu_description()}"


__all__ = ["cpu_description", "cpu_model_name", "last_level_cache_bytes", "machine_key"]
