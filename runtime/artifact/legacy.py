"""Manifests written before draft sources kept their own options: the one conversion, applied on load.

Schema version 1 held every source's options flat on the plan (``ngram_min``, ``lookahead_window``,
``datastore``, ``max_draft``, ...). Version 2 keeps them under the source's name in ``sources``, so that a
source's options belong to its module. ``upgrade_plan`` moves each old field to its place, for the sources
the plan uses (the others had no effect), keeping every value as written: a converted plan drafts exactly
as it did. The old defaults are frozen here, so a field that a version-1 plan omitted converts to the
value it meant then.
"""

from __future__ import annotations

from typing import Any

LEGACY_FIELDS: dict[str, tuple[str, str, Any]] = {
    "ngram_min": ("ngram", "min", 2),
    "ngram_max": ("ngram", "max", 4),
    "short_ngram": ("ngram", "short", 0),
    "datastore": ("retrieval", "datastore", None),
    "lookahead_window": ("lookahead", "window", 4),
    "lookahead_ngram": ("lookahead", "ngram", 2),
    "logitspec_top_k": ("logitspec", "top_k", 4),
    "max_draft": ("model", "max_draft", 6),
    "threshold": ("model", "threshold", 0.0),
    "adaptive": ("model", "adaptive", True),
    "target_acceptance": ("model", "target_acceptance", 0.6),
    "draft_branches": ("model", "branches", 1),
}
"""Version-1 plan field -> (source, option, the version-1 default)."""

USES_NGRAM_OPTIONS = ("ngram", "retrieval", "logitspec")
"""Sources that read the n-gram sizes (retrieval and LogitSpec match suffixes from ``ngram.min``)."""


def is_legacy_plan(data: dict[str, Any]) -> bool:
    return "sources" not in data and any(key in data for key in LEGACY_FIELDS)


def _used_sources(data: dict[str, Any]) -> set[str]:
    lookup = data.get("lookup") if isinstance(data.get("lookup"), list) else []
    used = {source for source in lookup if isinstance(source, str)}
    if used & set(USES_NGRAM_OPTIONS):
        used.add("ngram")
    has_model_part = (
        data.get("exit_layer") is not None
        or bool(data.get("skip_attn"))
        or bool(data.get("skip_mlp"))
        or data.get("kind") not in (None, "lookup")
    )
    if has_model_part:
        used.add("model")
    return used


def upgrade_plan(data: dict[str, Any]) -> dict[str, Any]:
    """A version-1 plan's JSON in version 2's form (a version-2 plan is returned as it is)."""
    if not is_legacy_plan(data):
        return data
    used = _used_sources(data)
    upgraded = {key: value for key, value in data.items() if key not in LEGACY_FIELDS}
    sources: dict[str, dict[str, Any]] = {}
    for key, (source, option, default) in LEGACY_FIELDS.items():
        if source in used:
            sources.setdefault(source, {})[option] = data.get(key, default)
    upgraded["sources"] = sources
    return upgraded


__all__ = ["LEGACY_FIELDS", "is_legacy_plan", "upgrade_plan"]
