"""The artifact's tokenizer through the ``tokenizers`` library alone (no transformers at run time)."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer


class TextTokenizer:
    def __init__(self, path: Path):
        self._tok = Tokenizer.from_file(str(path))

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)
