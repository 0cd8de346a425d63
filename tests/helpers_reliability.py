"""Shared by the manifest fuzz test and ``tests/manifest_fuzz.py``: hypothesis strategies that mutate a
real artifact's manifest at every depth, and the one question asked of each mutation: what does ``load``
do with it? (Loads, refuses with the runtime's own error, or lets another exception escape.)"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from hypothesis import strategies as st

from speccompile.runtime import errors, load
from speccompile.runtime.errors import SpeccompileError

ArtifactOpenError = getattr(errors, "ArtifactOpenError", ())  # () on a runtime without that boundary: never "net"

SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
    | st.sampled_from(
        [
            "",
            "..",
            "/etc/passwd",
            "../x",
            "a//b",
            "./a",
            "weights/model.safetensors",
            "tokenizer/tokenizer.json",
            "torch",
            "onnx",
            "float16",
            "0" * 64,
            "\ud800",
            "x" * 5000,
            "layer",
            "plain",
            "gelu",
            "learned",
            "generic",
        ]
    )
)
JSON = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
DEEP = st.integers(1, 400).map(lambda depth: f"\0DEEP:{depth}")
"""A list nested ``depth`` deep: a placeholder string until ``to_text`` writes it (so that mutating and
copying a document never recurses that deep)."""
_DEEP = re.compile(r'"\\u0000DEEP:(\d+)"')


def to_text(data: Any) -> str:
    """``data`` as JSON text (NaN and Infinity as Python writes them), deep placeholders written out."""
    text = json.dumps(data, allow_nan=True)
    return _DEEP.sub(lambda m: "[" * int(m.group(1)) + "]" * int(m.group(1)), text)


OPENED = {
    ("config",),
    ("plans",),
    ("backends",),
    ("files",),
    ("tokens",),
    ("default_plan",),
    ("dtype",),
    ("schema_version",),
}
"""Top-level fields the runtime acts on when it opens an artifact: two edits in three land under them
(the rest anywhere, ``tuning`` and ``source`` included)."""


def paths(document: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path in a JSON document (the root included), depth first."""
    found = [prefix]
    if isinstance(document, dict):
        for key, value in document.items():
            found += paths(value, prefix + (key,))
    elif isinstance(document, list):
        for i, value in enumerate(document):
            found += paths(value, prefix + (i,))
    return found


def nearby(value: Any) -> st.SearchStrategy:
    """Values a careless edit or a damaged byte would put in place of ``value``: numbers a little or a lot
    off (a geometry that no longer fits the weights), the other type, an empty or huge container."""
    if isinstance(value, bool):
        return st.just(not value) | SCALARS
    if isinstance(value, int):
        near = [value + 1, value - 1, value * 2, value // 2, 0, -value, 2**31, 2**63, 10**30]
        return st.sampled_from(near) | st.integers(-5, 300) | st.floats(allow_nan=True) | SCALARS
    if isinstance(value, float):
        near = [0.0, -value, value * 1e300, 1e-320, math.inf, math.nan, 1.0]
        return st.sampled_from(near) | st.integers(-5, 5) | SCALARS
    if isinstance(value, str):
        return st.sampled_from([value + "x", value[:-1], value.upper(), value * 2000, value + "\ud800"]) | SCALARS
    if isinstance(value, list):
        variants = [value[:-1], value + value[-1:], value[::-1], [], [value], value + [None]]
        return st.sampled_from(variants) | JSON | DEEP
    if isinstance(value, dict):
        return st.sampled_from([{}, {k: v for k, v in list(value.items())[:-1]}]) | JSON | DEEP
    return JSON


@st.composite
def mutations(draw, document: Any, max_edits: int = 3) -> Any:
    """``document`` (a manifest) with 1..max_edits edits, each at a path drawn from every path of the
    document (so every depth, and every config field, is reached; see ``OPENED``): a value replaced by a nearby or any
    value, a key removed, or a key added."""
    data = json.loads(json.dumps(document))
    for _ in range(draw(st.integers(1, max_edits))):
        every = paths(data)
        opened = [p for p in every if p[:1] in OPENED] or every
        path = draw(st.sampled_from(opened) | st.sampled_from(opened) | st.sampled_from(every))
        parent = data
        for key in path[:-1]:
            parent = parent[key]
        value = parent[path[-1]] if path else data
        action = draw(st.sampled_from(["replace", "replace", "replace", "remove", "add"]))
        if action == "replace":
            new = draw(nearby(value))
            if path:
                parent[path[-1]] = new
            else:
                data = new
        elif action == "remove" and path and isinstance(parent, dict):
            del parent[path[-1]]
        elif action == "add" and isinstance(value, dict):
            key = draw(st.text(max_size=10) | st.sampled_from(["file", "weights", "datastore", "x_file", "k" * 400]))
            value[key] = draw(JSON | DEEP)
    return data


def write_manifest(folder: Path, data: Any) -> None:
    (Path(folder) / "manifest.json").write_text(to_text(data))


def load_outcome(folder: Path, backend: str | None = None) -> str:
    """``load`` the artifact: "loaded", "refused" (an error of the runtime's own type from its checks), or
    "net" (its own type, but from the boundary that wraps an exception no check foresaw). Any other
    exception propagates: that is an escape."""
    try:
        load(folder, backend=backend)
    except ArtifactOpenError:
        return "net"
    except SpeccompileError:
        return "refused"
    return "loaded"


# A ChatML-style template (the tiny tokenizer has none): written into an artifact's tokenizer config.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ '<|' + message['role'] + '|>\n' + message['content'] + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


def copy_with_chat_template(artifact: Path, root: Path) -> Path:
    """A copy of ``artifact`` at ``root`` with ``CHAT_TEMPLATE`` in its tokenizer_config.json (and that
    file's manifest hash updated), for the chat endpoint's tests."""
    import shutil

    from speccompile.runtime.artifact.manifest import file_record

    shutil.copytree(artifact, root)
    config_path = root / "tokenizer" / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(json.dumps(config, indent=2))
    manifest = json.loads((root / "manifest.json").read_text())
    manifest["files"]["tokenizer/tokenizer_config.json"] = file_record(root, "tokenizer/tokenizer_config.json")
    (root / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return root
