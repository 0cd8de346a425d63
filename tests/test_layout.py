"""The runtime's layout holds: layers import downward only, nothing imports in a cycle, no module is a shim
left after a move, and the round reads drafters' capabilities as declared attributes, never by probing."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RUNTIME = REPO / "runtime"
PACKAGE = "speccompile.runtime"
LAYERS = [
    "errors",
    "registry",
    "machine",
    "memory",
    "segments",
    "sampling",
    "tree",
    "artifact",
    "acceptance",
    "backends",
    "drafting",
    "decoding",
    "model",
]
"""Lowest first: a module may import from its own layer and the layers before it, never after. Backends sit
below drafting: they run segments and know nothing of plans (a plan's kind calls them)."""


def module_name(path: Path) -> str:
    parts = list(path.relative_to(RUNTIME).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join([PACKAGE, *parts])


def runtime_modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(RUNTIME.rglob("*.py"))}


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """Every runtime module ``name`` imports, at module level or inside functions (a lazy import is an edge too)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            candidates = [target] + [f"{target}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        else:
            continue
        found |= {c for c in candidates if c in known and c != name}
    return found


def graph() -> dict[str, set[str]]:
    modules = runtime_modules()
    return {name: imports_of(name, path, set(modules)) for name, path in modules.items()}


def layer(name: str) -> int:
    first = name[len(PACKAGE) + 1 :].split(".")[0] if name != PACKAGE else ""
    return LAYERS.index(first) if first in LAYERS else len(LAYERS)


def test_the_runtime_import_graph_is_acyclic():
    edges = graph()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt) :] + [nxt]
                raise AssertionError("import cycle: " + " -> ".join(m[len(PACKAGE) + 1 :] for m in cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node)


def test_layers_import_downward_only():
    upward = [
        f"{name} imports {target}"
        for name, targets in graph().items()
        for target in sorted(targets)
        if name != PACKAGE and layer(target) > layer(name)
    ]
    assert not upward, "\n".join(upward)


def test_the_manifest_imports_nothing_of_drafting():
    edges = graph()
    manifest = {name for name in edges if name.startswith(f"{PACKAGE}.artifact")}
    assert manifest, "runtime/artifact/ is where the manifest lives"
    leaks = [
        f"{name} imports {target}"
        for name in manifest
        for target in edges[name]
        if not target.startswith(f"{PACKAGE}.artifact") and target != f"{PACKAGE}.errors"
    ]
    assert not leaks, "\n".join(leaks)


def test_torch_is_imported_only_under_the_torch_backend():
    offenders = []
    for name, path in runtime_modules().items():
        if name.startswith(f"{PACKAGE}.backends.torch"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom) and not node.level
                else []
            )
            offenders += [f"{name} imports {n}" for n in names if n.split(".")[0] in ("torch", "transformers")]
    assert not offenders, "\n".join(offenders)


def is_shim(path: Path) -> bool:
    """A module whose whole body is a docstring and imports (re-exports of another module), beside a package's
    ``__init__``, which may gather its public names."""
    body = ast.parse(path.read_text()).body
    if path.name == "__init__.py" or not body:
        return False
    rest = [node for node in body if not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant))]
    return bool(rest) and all(isinstance(node, (ast.Import, ast.ImportFrom)) for node in rest)


def test_no_module_is_a_shim():
    shims = [
        str(path.relative_to(REPO))
        for folder in ("runtime", "passes", "speccompile")
        for path in sorted((REPO / folder).rglob("*.py"))
        if is_shim(path)
    ]
    assert not shims, f"modules that only re-export another module: {shims}"


def test_the_round_probes_no_capability():
    """The decode loop and the device round read what a drafter or backend can do from declared attributes
    (``Drafter.drafts_trees``, ``observes``, ``model_part``, ``lookup_part``; ``Backend.device_round``)."""
    probes = []
    for path in [
        *sorted((RUNTIME / "decoding").rglob("*.py")),
        RUNTIME / "backends/torch/device_round.py",
        *sorted((RUNTIME / "drafting").glob("*.py")),
    ]:
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr")
            ):
                probes.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not probes, f"getattr/hasattr probes in the round: {probes}"


def layer_of(path: Path) -> str:
    """The layer a module sits in: its first folder under ``runtime/`` (``runtime/backends``), else its top folder
    (``passes``, ``speccompile``, ``speccompile/families``...: the toolkit's packages)."""
    parts = path.relative_to(REPO).parts
    return "/".join(parts[:2]) if parts[0] == "runtime" and len(parts) > 2 else "/".join(parts[:-1])


def test_no_module_name_is_used_in_two_layers():
    """A name says which layer a module is in: the same file name in two layers (the writer's ``artifact.py`` beside
    the reader's ``runtime/artifact/``, two ``base.py``) is refused; siblings of one layer (each backend package's
    ``backend.py`` and ``descriptor.py``) may share a name, being the same role."""
    by_name: dict[str, set[str]] = {}
    for folder in ("runtime", "passes", "speccompile"):
        for path in sorted((REPO / folder).rglob("*.py")):
            if path.name != "__init__.py":
                by_name.setdefault(path.name, set()).add(layer_of(path))
    twice = {name: sorted(layers) for name, layers in by_name.items() if len(layers) > 1}
    assert not twice, f"module names used in several layers: {twice}"
