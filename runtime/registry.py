"""A table of named classes imported on first use: the one mechanism behind the draft sources
(``drafting/__init__.py``'s ``SOURCES``) and the draft kinds (``drafting/kinds/__init__.py``'s ``KINDS``).

A name maps to ``"module:Class"``, the module relative to the table's package (``.ngram``) or absolute
(``tests.demo_source``), so adding an entry is one line and importing the table imports none of them.
"""

from __future__ import annotations

import importlib

from .errors import ArtifactError


class Registry(dict):
    """name -> ``"module:Class"`` (a plain dict, so tests register entries with ``monkeypatch.setitem``);
    ``load(name)`` imports the class."""

    def __init__(self, what: str, package: str, entries: dict[str, str]):
        super().__init__(entries)
        self.what, self.package = what, package

    def load(self, name: str) -> type:
        if name not in self:
            raise ArtifactError(
                f"{self.what} {name[:64]!r} is not known to this runtime (known: {', '.join(self)}); "
                "upgrade speccompile or rebuild the artifact"
            )
        module, _, cls = self[name].partition(":")
        return getattr(importlib.import_module(module, self.package if module.startswith(".") else None), cls)


__all__ = ["Registry"]
