"""The CPU product forms chosen per weight shape (``cpu_linear.py``), kept per machine so that every load chooses alike.

Why: the forms are timed at load, in a few seconds, and such timings on a shared or busy machine differ from one load
to the next; three loads of one artifact on one machine chose differently, and plain decoding's speed moved by half
between them (docs/history.md, 'Figures behind the code's constants'). A speed that depends on the load's luck is
neither a product nor a benchmark. So the first load's choice for each weight shape is written to a JSON file under
the machine's key (the processor, its cache and vector extensions and the cores the process may use, the torch build
and its thread count: what the timing depends on) and later loads read it instead of timing.

``SPECCOMPILE_CPU_LINEAR_STORE``: the file (default ``$XDG_CACHE_HOME/speccompile/cpu_linear.json``, ``~/.cache``
without it); ``0`` or an empty value keeps nothing (every load times, as the tests do). Deleting the file, or a
machine whose key differs, times again. A file that cannot be read or parsed is timed over and rewritten; one that
cannot be written leaves the load as it is (a warning).
"""

from __future__ import annotations

import json
import os
import tempfile
import warnings
from pathlib import Path

import torch

from ...machine import cpu_description

ENV = "SPECCOMPILE_CPU_LINEAR_STORE"
VERSION = 1


def store_path() -> Path | None:
    """Where the choices are kept, or None (``SPECCOMPILE_CPU_LINEAR_STORE=0``)."""
    value = os.environ.get(ENV)
    if value is not None:
        return None if value.strip() in ("", "0") else Path(value)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "speccompile" / "cpu_linear.json"


def machine_entry_key() -> str:
    """What a timing of the product forms depends on besides the shape."""
    return f"{cpu_description()}; torch {torch.__version__}, {torch.get_num_threads()} threads"


def shape_key(shape: tuple[int, ...], dtype: torch.dtype) -> str:
    return "x".join(str(d) for d in shape) + f" {str(dtype).removeprefix('torch.')}"


class FormsStore:
    """The kept choices of this machine: ``get(shape, dtype)`` -> (streaming rows, packed rows, pack kind name or None),
    ``put`` for a new shape, ``save`` once after a load's choices."""

    def __init__(self, path: Path | None = None):
        self.path = store_path() if path is None else path
        self.machine = machine_entry_key()
        self.data: dict = {"version": VERSION, "machines": {}}
        self.changed = False
        if self.path is not None and self.path.exists():
            try:
                data = json.loads(self.path.read_text())
                if data.get("version") == VERSION and isinstance(data.get("machines"), dict):
                    self.data = data
            except (OSError, ValueError, AttributeError):
                pass  # unreadable: timed over and rewritten

    @property
    def entries(self) -> dict:
        return self.data["machines"].setdefault(self.machine, {})

    def get(
        self, shape: tuple[int, ...], dtype: torch.dtype
    ) -> tuple[frozenset[int], frozenset[int], str | None] | None:
        entry = self.entries.get(shape_key(shape, dtype)) if self.path is not None else None
        if not isinstance(entry, dict):
            return None
        try:
            return frozenset(map(int, entry["streaming"])), frozenset(map(int, entry["packed"])), entry.get("pack")
        except (KeyError, TypeError, ValueError):
            return None

    def put(self, shape: tuple[int, ...], dtype: torch.dtype, streaming, packed, pack: str | None) -> None:
        if self.path is None:
            return
        self.entries[shape_key(shape, dtype)] = {"streaming": sorted(streaming), "packed": sorted(packed), "pack": pack}
        self.changed = True

    def save(self) -> None:
        """Write the file if a choice was added (atomically: a concurrent load reads the old file or the new one)."""
        if self.path is None or not self.changed:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=self.path.parent, delete=False, suffix=".tmp") as handle:
                json.dump(self.data, handle, indent=1, sort_keys=True)
            os.replace(handle.name, self.path)
            self.changed = False
        except OSError as error:
            warnings.warn(f"could not keep the CPU product forms in {self.path} ({error}); set {ENV}=0 to stop trying")


__all__ = ["ENV", "FormsStore", "store_path"]
