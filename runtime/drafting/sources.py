"""The draft sources' registry: source name -> its class, imported on first use.

Its own module so that the plan reader (``plan.py``) and the package's conveniences (``__init__.py``) share it
without importing each other. A new source is one module (a ``LookupSource`` subclass with an ``Options``
dataclass) plus one line here.
"""

from __future__ import annotations

from ..registry import Registry

SOURCES = Registry(
    "draft source",
    __package__,
    {
        "model": ".model_draft:ModelDrafter",
        "ngram": ".ngram:NgramDrafter",
        "retrieval": ".retrieval:RetrievalDrafter",
        "lookahead": ".lookahead:LookaheadDrafter",
        "logitspec": ".logitspec:LogitSpecDrafter",
        "recycling": ".recycling:RecyclingDrafter",
    },
)
"""Source name -> ``"module:Class"``. ``model`` is the plan's model part; the others may be named in
``plan.lookup``."""


__all__ = ["SOURCES"]
