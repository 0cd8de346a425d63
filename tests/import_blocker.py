"""Make packages unimportable in a test subprocess, before anything else imports them.

``block("torch", "transformers")`` installs a ``sys.meta_path`` finder that raises ImportError for those
top-level packages. Subprocess scripts start with ``preamble(...)``, which puts this folder on the path
and calls ``block``.
"""

import sys
from pathlib import Path


class _Blocker:
    def __init__(self, names):
        self.names = frozenset(names)

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in self.names:
            raise ImportError(f"{name} is blocked in this process")
        return None


def block(*names: str) -> None:
    sys.meta_path.insert(0, _Blocker(names))


def preamble(*names: str) -> str:
    """Python source that blocks ``names`` first thing in a ``python -c`` script."""
    return (
        f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import import_blocker; "
        f"import_blocker.block(*{list(names)!r})\n"
    )
