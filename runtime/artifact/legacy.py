"""Plans in the forms of older schemas: the one conversion to today's form, applied on load.

Schema version 1 held every source's options flat on the plan (``ngram_min``, ``lookahead_window``,
``datastore``, ``max_draft``, ...); version 2 keeps them under the source's name in ``sources``, so that a
source's options belong to its module. Versions 1 and 2 also held the model part in two shapes: first-class
fields (``exit_layer``, ``skip_attn``, ``skip_mlp``, ``head``, ``draft_vocab``, ``draft_head_file``) beside an
optional ``kind`` (None: inferred from those fields) and ``params``. Version 3 has one shape: the ``kind``,
always named, and its options in ``params``.

``upgrade_plan`` takes a plan of any readable version to version 3, keeping every value as written: a converted
plan drafts exactly as it did. The old defaults are frozen here, so a field that an old plan omitted converts
to the value it meant then. ``model_part`` (the second step) is also how ``DraftPlan.of`` folds model fields
into a plan built in code, so the kind a plan without one gets is inferred in this one place.
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
    """A plan's JSON in version 3's form, whatever readable version it is in (a version-3 plan is returned as
    it is)."""
    return model_part(sources_part(data))


def sources_part(data: dict[str, Any]) -> dict[str, Any]:
    """A version-1 plan's JSON with its sources' options under ``sources`` (other plans are returned as they are)."""
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


MODEL_FIELDS: dict[str, Any] = {
    "skip_attn": [],
    "skip_mlp": [],
    "exit_layer": None,
    "head": "final",
    "draft_vocab": None,
    "draft_head_file": None,
}
"""The model part's first-class fields of versions 1 and 2 -> the value each means when absent. Version 3 keeps
them in ``params`` (``manifest.MODEL_PARAMS``), and only where they differ from that value: an absent option
reads as the same value there (``DraftPlan.param``), so a converted plan drafts as it did."""

NO_MODEL_PART = "lookup"
"""The kind of a plan that drafts with lookup sources alone: it reads none of ``MODEL_FIELDS``."""


def has_model_fields(data: dict[str, Any]) -> bool:
    """Whether a plan's JSON still holds its model part in the old shape: first-class fields, or no named kind."""
    return data.get("kind") is None or any(key in data for key in MODEL_FIELDS)


def inferred_kind(data: dict[str, Any]) -> str:
    """The kind an old plan that named none drafted with: the first of early exit, layer skip and lookup only whose
    fields it has (the order versions 1 and 2 tried them in; a precision draft was always named)."""
    if data.get("exit_layer") is not None:
        return "early_exit"
    if data.get("skip_attn") or data.get("skip_mlp"):
        return "layer_skip"
    return NO_MODEL_PART


def model_part(data: dict[str, Any]) -> dict[str, Any]:
    """A plan's JSON with its kind named and its model fields in ``params`` (a plan in that form already is
    returned as it is). A field at the value it meant when absent is left out, as are the model fields of a
    lookup-only plan, which never read them: either way the plan drafts as before."""
    if not has_model_fields(data):
        return data
    kind = data.get("kind")
    kind = inferred_kind(data) if kind is None else kind
    params = data.get("params", {})
    if isinstance(params, dict) and kind != NO_MODEL_PART:  # damaged params are left to the schema check
        moved = {key: data[key] for key, absent in MODEL_FIELDS.items() if key in data and data[key] != absent}
        params = {**params, **moved}
    upgraded = {key: value for key, value in data.items() if key not in MODEL_FIELDS}
    return {**upgraded, "kind": kind, "params": params}


__all__ = ["LEGACY_FIELDS", "MODEL_FIELDS", "inferred_kind", "is_legacy_plan", "model_part", "upgrade_plan"]
