"""Lookup only: no model part. Model-free sources draft (``runtime/drafting/ngram.py``, ``runtime/drafting/retrieval.py``)
and the full model verifies; a round without a hit is a plain step."""

from __future__ import annotations

from .draft_kind import DraftKind


class LookupOnly(DraftKind):
    name = "lookup"
    has_model_part = False
    param_keys = ()

    @property
    def draft_segment(self):
        raise RuntimeError(f"plan {self.plan.name!r} has no model draft; its drafts come from lookups")

    def segments(self):
        return []

    def draft_calls(self):
        return []


__all__ = ["LookupOnly"]
