"""Draft-and-verify decoding of one request: the request, its statistics, and the batch round with one sequence.

A backend (``runtime/backends/base.py``) runs segments of the model on its static KV cache; a plan's
draft kind (``runtime/drafting/kinds/``) turns a draft step and a verify into segments (an early exit's
verify reuses the draft's prefix). Rollback after a rejection is only a smaller ``pos`` for the next call.

The round itself is written once, over a batch of sequences (``batch.py``); a request alone is a batch of
one. Each round asks a drafter (``runtime/drafting/drafter.py``) for candidates and verifies them in one call;
the acceptance rule (``runtime/acceptance.py``) decides what is committed. A backend may keep a lone sequence's
round on its device instead (``device_round``: the torch backend on CUDA with a model draft,
``runtime/backends/torch/device_round.py``: one host read per round, none per drafted token).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

from ..artifact.manifest import DraftPlan
from ..backends.base import Backend
from .batch import BatchDecoder
from .request import DecodeRequest, Stats, backend_drafter, cache_length, draft_room


def decode(
    backend: Backend, request: DecodeRequest, drafter, stats: Stats, prefill_chunk: int | None = None
) -> Iterator[list[int]]:
    """Yield the new tokens of each step (plain, ``drafter`` None) or round (speculative) until a stop: the
    batch round of ``batch.py`` with one sequence in it (``drafter`` built on ``backend``). ``prefill_chunk``: prompt
    tokens read per call (None: the whole prompt in one; ``prefill_chunk.py``)."""
    engine = BatchDecoder(backend, prefill_chunk=prefill_chunk)
    sequence = engine.add(request, drafter=drafter, stats=stats)
    while not sequence.finished:
        for _, new in engine.step():
            if new:
                yield new


def reserve_cache(
    backend: Backend, request: DecodeRequest, plan: DraftPlan | None, max_draft: int | None = None
) -> None:
    """Size the backend's static cache for ``request`` alone (``cache_length``)."""
    backend.reserve(cache_length(backend, request, plan, max_draft))


def decode_all(
    backend: Backend, request: DecodeRequest, plan: DraftPlan | None = None, root: Path | None = None
) -> tuple[list[int], Stats]:
    """Decode ``request`` to the end (plain when ``plan`` is None); the new tokens and the stats.
    ``root`` is the artifact folder, for plans whose drafters read files (a retrieval datastore)."""
    stats = Stats()
    reserve_cache(backend, request, plan)
    produced: list[int] = []
    for new in decode(backend, request, backend_drafter(backend, plan, root), stats):
        produced.extend(new)
    return produced, stats


__all__ = [
    "DecodeRequest",
    "Stats",
    "backend_drafter",
    "cache_length",
    "decode",
    "decode_all",
    "draft_room",
    "reserve_cache",
]
