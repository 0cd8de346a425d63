"""Prompts a batch has read, kept in spare cache slots, so that a later prompt that begins alike copies that KV.

Requests to one service mostly begin alike: a chat template's system prompt (a fair share of a short chat prompt's
tokens; measured: docs/history.md, 'Figures behind the code's constants'), a shared instruction or document, the
earlier turns of a conversation, a retried request. Under load a prompt's prefill is about half the work of a short
request, so a batch keeps the KV of the prompts it has read (``PromptCache.remember``) in slots after its sequences'
slots, and a joining sequence copies the longest kept prefix of its prompt (``match``; at least ``MIN_TOKENS``,
never the prompt's last token, whose logits it needs) instead of computing it. Kept prompts are evicted least
recently used first; a kept prompt that a new one extends (the next turn of a conversation) is replaced in place.

Why slots: the KV cache already has a slot dimension and ``Backend.move_slot`` copies a slot's positions (one
copy per layer), so a kept prompt needs no new storage code on any backend; the price is one slot of cache per
kept prompt (``capacity``). Only backends whose slots are one buffer (``Backend.slots_copy``: ONNX Runtime, the
canonical torch decoder) keep prompts; replicas trade places instead of copying.

The copied KV was computed within another prompt's prefill (another call, so a kernel may round it differently
than this prompt's own prefill would): the near-tie rule of lossless greedy covers it (docs/design.md section
6), as it covers chunked prefill.
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_TOKENS = 8  # a shorter shared prefix is computed again, not copied


@dataclass
class KeptPrompt:
    tokens: list[int]
    slot: int
    last_used: int


def common_length(a, b) -> int:
    """How many first tokens ``a`` and ``b`` share."""
    n, limit = 0, min(len(a), len(b))
    while n < limit and a[n] == b[n]:
        n += 1
    return n


class PromptCache:
    """Up to ``capacity`` prompts' KV in spare slots of ``backend`` (a batched backend whose ``move_slot`` copies).
    Slots below ``busy`` (the batch's sequences) are never used; a kept prompt in a slot a sequence needs moves."""

    def __init__(self, backend, capacity: int):
        self.backend, self.capacity = backend, capacity
        self.kept: list[KeptPrompt] = []
        self._clock = 0

    def _touch(self, entry: KeptPrompt) -> None:
        self._clock += 1
        entry.last_used = self._clock

    def _free_slot(self, busy: int) -> int:
        """The lowest slot at or above ``busy`` that no kept prompt holds (the cache grows to hold it)."""
        taken = {e.slot for e in self.kept}
        slot = busy
        while slot in taken:
            slot += 1
        if slot >= self.backend.slots:
            self.backend.reserve(self.backend.max_len, slots=slot + 1)
        return slot

    def match(self, prompt) -> tuple[int | None, int]:
        """(slot, n): the kept prompt sharing the most first tokens with ``prompt`` and how many to copy (n at
        least ``MIN_TOKENS`` and below ``len(prompt)``), or (None, 0)."""
        best, shared = None, 0
        for entry in self.kept:
            n = min(common_length(prompt, entry.tokens), len(prompt) - 1)
            if n > shared:
                best, shared = entry, n
        if best is None or shared < MIN_TOKENS:
            return None, 0
        self._touch(best)
        return best.slot, shared

    def vacate(self, slot: int, busy: int) -> None:
        """Make ``slot`` free for a sequence: a kept prompt there moves to a free slot at or above ``busy``."""
        for entry in self.kept:
            if entry.slot == slot:
                target = self._free_slot(max(busy, slot + 1))
                self.backend.move_slot(slot, target, len(entry.tokens))
                entry.slot = target

    def remember(self, source: int, prompt: list[int], busy: int) -> None:
        """Keep the KV of ``prompt``, just read into slot ``source``: replaces a kept prompt it extends (or the
        least recently used one when the cache is full), or takes a new slot at or above ``busy``."""
        if self.capacity < 1 or len(prompt) < MIN_TOKENS:
            return
        for entry in self.kept:
            if entry.tokens == prompt:
                self._touch(entry)
                return
        extended = [e for e in self.kept if len(e.tokens) < len(prompt) and prompt[: len(e.tokens)] == e.tokens]
        if extended:
            entry = extended[0]
        elif len(self.kept) >= self.capacity:
            entry = min(self.kept, key=lambda e: e.last_used)
        else:
            entry = KeptPrompt([], self._free_slot(busy), 0)
            self.kept.append(entry)
        self.backend.move_slot(source, entry.slot, len(prompt))
        entry.tokens = list(prompt)
        self._touch(entry)


__all__ = ["MIN_TOKENS", "KeptPrompt", "PromptCache", "common_length"]
