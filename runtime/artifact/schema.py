"""Check JSON data against a dataclass's annotated field types, and build the dataclass from it.

The manifest's schema *is* its dataclasses (``ArchConfig``, ``DraftPlan``, ``Manifest``): a field added
to one of them is checked by its annotation with no second list to keep in step. Every problem is an
``ArtifactError`` naming the field (``plans['x'].max_draft``), never a ``TypeError`` or ``KeyError``
from deep inside the runtime.

Supported annotations: ``Any``, ``str``, ``int`` (not bool), ``float`` (finite; an int is accepted),
``bool``, ``None``, unions (``int | None``), ``Literal[...]``, ``list[T]``, ``tuple[T, ...]``,
``dict[str, T]``, and nested dataclasses (built from a JSON object). An annotation outside that set is
not checked, so a new kind of field never makes a valid manifest unreadable.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from functools import lru_cache
from typing import Any

from ..errors import ArtifactError, quote

MAX_DEPTH = 32
"""Deepest nesting of objects and lists a manifest may hold (a real one nests 6 deep)."""
MAX_STRING = 4096
"""Longest string value a manifest may hold (a path is at most 4096 bytes on Linux)."""
MAX_KEY = 256
"""Longest object key a manifest may hold (plan, tensor, graph and file names)."""

REJECT_UNKNOWN = "__reject_unknown_fields__"
"""A dataclass with this class attribute set to True refuses JSON keys it has no field for; others
ignore them, so a manifest written by a newer toolkit still loads (forward compatibility)."""


def json_type(value: Any) -> str:
    """The JSON name of a value's type, for messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def describe(annotation: Any) -> str:
    """A readable name for an annotation, for messages."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(describe(arm) for arm in typing.get_args(annotation))
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(v) for v in typing.get_args(annotation))
    if origin in (list, tuple) or annotation in (list, tuple):
        return "a list"
    if origin is dict or annotation is dict or dataclasses.is_dataclass(annotation):
        return "an object"
    names = {str: "a string", int: "an integer", float: "a finite number", bool: "a boolean", type(None): "null"}
    return names.get(annotation, getattr(annotation, "__name__", str(annotation)))


def _wrong(value: Any, annotation: Any, where: str) -> ArtifactError:
    return ArtifactError(
        f"manifest field {where} must be {describe(annotation)}, got {json_type(value)}; the manifest is damaged or "
        "was edited: rebuild the artifact"
    )


@lru_cache(maxsize=None)
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def check_json_shape(
    data: Any,
    where: str,
    max_depth: int = MAX_DEPTH,
    max_string: int = MAX_STRING,
    max_key: int = MAX_KEY,
    error: type[Exception] = ArtifactError,
    fix: str = "rebuild the artifact",
    what: str = "",
) -> None:
    """Refuse JSON data nested deeper than ``max_depth``, holding a string longer than ``max_string`` (an
    object key: ``max_key``), or a string that is not Unicode text (a lone surrogate such as ``"\\ud800"``,
    which JSON allows but no file system, tokenizer or UTF-8 encoder takes), before anything recursive
    reads it. Written without recursion, so any depth ``json.loads`` returned is answered with ``error``
    (one line, naming the place), never a RecursionError. The manifest's check and the server's request
    check share it."""

    def refuse(path: tuple, problem: str) -> Exception:
        exc = error(f"{what}{json_path(where, path)} {problem}; {fix}")
        exc.field = json_path(where, path) or None  # the place, for a server's error ``param``
        return exc

    stack: list[tuple[Any, tuple]] = [(data, ())]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            if len(value) > max_string:
                raise refuse(path, f"is a string of {len(value)} characters (at most {max_string})")
            if (bad := _surrogate(value)) is not None:
                raise refuse(path, bad)
            continue
        if not isinstance(value, (dict, list)):
            continue
        if len(path) >= max_depth:
            raise refuse(path, f"is nested more than {max_depth} levels deep")
        if isinstance(value, dict):
            for key, item in value.items():
                if isinstance(key, str):
                    if len(key) > max_key:
                        raise refuse(path, f"has a key of {len(key)} characters (at most {max_key}): {quote(key)}")
                    if (bad := _surrogate(key)) is not None:
                        raise refuse(path + (key,), bad)
                stack.append((item, path + (key,)))
        else:
            stack.extend((item, path + (i,)) for i, item in enumerate(value))


def _surrogate(value: str) -> str | None:
    """What makes ``value`` not Unicode text (a lone surrogate), or None."""
    if value.isascii():
        return None
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"is not valid Unicode text (a lone surrogate {quote(exc.object[exc.start : exc.end])} at character {exc.start})"
    return None


def json_path(where: str, path: tuple) -> str:
    """``where['key'][3]`` (``key[3]`` when ``where`` is empty), each key quoted with a bounded prefix."""
    if not where and path and isinstance(path[0], str):
        where, path = path[0] if path[0].isidentifier() and len(path[0]) <= 40 else quote(path[0], 40), path[1:]
    parts = [f"[{i}]" if isinstance(i, int) else f"[{quote(i, 40)}]" for i in path]
    return where + "".join(parts if len(parts) <= 8 else parts[:6] + ["...", parts[-1]])


def check_value(value: Any, annotation: Any, where: str) -> Any:
    """``value`` if it fits ``annotation`` (nested dataclasses built, ints widened to float), else an
    ArtifactError naming ``where``."""
    if annotation is Any:
        return value
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        for arm in args:
            try:
                return check_value(value, arm, where)
            except ArtifactError:
                continue
        raise _wrong(value, annotation, where)
    if origin is typing.Literal:
        if any(type(value) is type(option) and value == option for option in args):
            return value
        raise _wrong(value, annotation, where)
    if annotation is type(None):
        if value is None:
            return None
        raise _wrong(value, annotation, where)
    if origin in (list, tuple) or annotation in (list, tuple):
        if not isinstance(value, list):
            raise _wrong(value, annotation, where)
        item = args[0] if args else Any
        return [check_value(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict or annotation is dict:
        if not isinstance(value, dict):
            raise _wrong(value, annotation, where)
        if any(not isinstance(key, str) for key in value):
            raise ArtifactError(f"manifest field {where} has a key that is not a string; rebuild the artifact")
        item = args[1] if len(args) == 2 else Any
        return {key: check_value(v, item, f"{where}[{key!r}]") for key, v in value.items()}
    if dataclasses.is_dataclass(annotation) and isinstance(annotation, type):
        if isinstance(value, annotation):  # built already (e.g. with its own from_dict)
            return value
        return build_dataclass(annotation, value, where)
    if annotation is bool:
        if isinstance(value, bool):
            return value
        raise _wrong(value, annotation, where)
    if annotation is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise _wrong(value, annotation, where)
    if annotation is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            return float(value)
        raise _wrong(value, annotation, where)
    if annotation is str:
        if isinstance(value, str):
            return value
        raise _wrong(value, annotation, where)
    return value  # an annotation this checker does not know: not checked (see the module docstring)


def build_dataclass(cls: type, data: Any, where: str):
    """``cls(**data)`` after checking ``data`` is an object with every required field, no unknown field
    where ``cls`` refuses them, and every value of its field's annotated type."""
    if not isinstance(data, dict):
        raise ArtifactError(f"manifest field {where} must be an object, got {json_type(data)}; rebuild the artifact")
    fields = [f for f in dataclasses.fields(cls) if f.init]
    names = {f.name for f in fields}
    if getattr(cls, REJECT_UNKNOWN, False):
        unknown = sorted(set(data) - names)
        if unknown:
            raise ArtifactError(
                f"manifest field {where} has unknown fields {unknown}; rebuild the artifact with this version of "
                "speccompile"
            )
    required = [f.name for f in fields if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    missing = [name for name in required if name not in data]
    if missing:
        raise ArtifactError(f"manifest field {where} lacks {missing}; the manifest is damaged: rebuild the artifact")
    hints = _hints(cls)
    kwargs = {name: check_value(value, hints[name], f"{where}.{name}") for name, value in data.items() if name in names}
    return cls(**kwargs)


__all__ = [
    "MAX_DEPTH",
    "MAX_KEY",
    "MAX_STRING",
    "REJECT_UNKNOWN",
    "build_dataclass",
    "check_json_shape",
    "check_value",
    "describe",
    "json_path",
    "json_type",
]
