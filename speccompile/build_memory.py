"""The resident memory a build used at its peak: what ``inspect`` and the build's last line report.

``resource.getrusage``'s ``ru_maxrss`` is the process's high-water mark of resident memory (kilobytes on Linux,
bytes on macOS): the figure ``/usr/bin/time -v`` prints, and what a machine must have for the build to run.
"""

from __future__ import annotations

import resource
import sys


def peak_resident_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def describe_peak(peak: int, weights: int | None) -> str:
    """ "1.23 GB (2.3x the model's 0.54 GB of fp32 weights)"."""
    text = f"{peak / 1e9:.2f} GB"
    if weights:
        text += f" ({peak / weights:.1f}x the model's {weights / 1e9:.2f} GB of fp32 weights)"
    return text


__all__ = ["describe_peak", "peak_resident_bytes"]
