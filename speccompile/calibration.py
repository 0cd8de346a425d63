"""Calibration text: a small built-in default set, or the user's own file (text or JSONL).

The autotuners only need prompts the target will continue greedily; a few hundred tokens of text
like the deployment traffic is enough. The built-in set is mostly Python (the reference model's
domain) with some English prose.
"""

from __future__ import annotations

import json
from pathlib import Path

from speccompile.runtime.errors import SpeccompileError

DEFAULT_CALIBRATION = [
    'def read_config(path):\n    """Read a JSON configuration file and return it as a dict."""\n',
    "import os\nimport sys\n\n\ndef main(argv=None):\n    if argv is None:\n        argv = sys.argv[1:]\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "    for index, value in enumerate(values):\n        if value is None:\n            continue\n",
    'def parse_args(args):\n    parser = argparse.ArgumentParser(description="Process some files.")\n',
    "    try:\n        with open(filename, encoding='utf-8') as f:\n            data = f.read()\n    except OSError as exc:\n",
    'class Error(Exception):\n    """Base class for exceptions in this module."""\n\n    def __init__(self, msg):\n',
    "    def __repr__(self):\n        return '%s(%r)' % (self.__class__.__name__, self.",
    "The quick brown fox jumps over the lazy dog. Speculative decoding drafts several tokens",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "    result = []\n    for line in lines:\n        line = line.strip()\n        if not line or line.startswith('#'):\n",
    "    @property\n    def name(self):\n        return self._name\n\n    @name.setter\n",
]


def load_calibration(path: str | None, kind: str = "calibration") -> list[str]:
    """Texts from ``path`` (JSONL with a "text" or "prompt" field per line, or plain UTF-8 text split on
    blank lines), or the built-in set. ``kind`` names the file in messages ("calibration" for
    ``--calibration``, "prompts" for bench's ``--prompts``); JSONL errors give the line number."""
    if path is None:
        return list(DEFAULT_CALIBRATION)
    file = Path(path)
    what = f"{kind} file '{path}'"
    if not file.exists():
        raise SpeccompileError(f"{what} does not exist; check the path")
    if not file.is_file():
        raise SpeccompileError(f"{what} is a folder, not a file; pass a .jsonl or text file")
    try:
        data = file.read_bytes()
    except OSError as exc:
        raise SpeccompileError(f"cannot read {what} ({exc.strerror}); check its permissions") from None
    try:
        raw = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise SpeccompileError(
            f"{kind} file {path}:{line} is not UTF-8 text (byte 0x{data[exc.start]:02x}); save it as UTF-8"
        ) from None
    texts: list[str] = []
    if file.suffix in (".jsonl", ".json"):
        for number, line in enumerate(raw.split("\n"), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except (json.JSONDecodeError, RecursionError):
                raise SpeccompileError(
                    f"{kind} file {path}:{number} is not valid JSON; use one JSON object per line"
                ) from None
            text = record.get("text", record.get("prompt")) if isinstance(record, dict) else None
            if not isinstance(text, str):
                raise SpeccompileError(f'{kind} file {path}:{number} has no "text" or "prompt" string field')
            texts.append(text)
    else:
        texts = [block for block in raw.split("\n\n") if block.strip()]
    if not texts:
        raise SpeccompileError(f"{what} holds no text")
    return texts
