"""The build times how a request alone should read a long prompt (``runtime/decoding/prefill_chunk.py``) and stores it.

Why here: the build has the backend open on the machine it tuned on, so it times a prompt of up to ``LENGTH``
tokens read in chunks of each candidate length once (a few seconds on a 135M model) and stores the fastest in
``tuning["prefill_chunk"]``; loads on the same machine read long prompts in those chunks.
"""

from __future__ import annotations

from typing import Callable

from speccompile.runtime.decoding.prefill_chunk import CANDIDATES, measure, stored

LENGTH = 1024  # the prompt timed: long enough that a one-call read loses to chunks where it does
REPEATS = 1  # each way read once: the chunks' gains are tens of percent, far above a call's noise


def estimated_seconds(step_seconds: float, length: int) -> float:
    """About what ``measure`` takes: each way of reading the prompt costs about a step per 16 prompt tokens (a
    prompt's tokens share each weight read, so they cost far less than steps), times the repeats."""
    ways = len([c for c in CANDIDATES if c < length]) + 1
    return ways * REPEATS * step_seconds * length / 16


def needed_seconds(step_seconds: float, context: int) -> float:
    """What timing the prompt chunks of a model with ``context`` positions takes (0: none of its prompts is long
    enough to read in chunks): the share of the budget a build keeps for it."""
    length = min(LENGTH, context - 2)
    return 0.0 if length <= min(CANDIDATES) else estimated_seconds(step_seconds, length)


def time_prefill_chunk(runner, ir, seconds_left: float | None, step_seconds: float, log: Callable[[str], None]) -> None:
    """Time the prompt chunks on the runner's backend into ``ir.tuning["prefill_chunk"]`` when ``seconds_left`` (None:
    no budget) allows; a log line either way."""
    ir.tuning.pop("prefill_chunk", None)
    needed = needed_seconds(step_seconds, ir.config.max_position_embeddings)
    if not needed:
        return  # no prompt of this model is long enough to read in chunks
    length = min(LENGTH, ir.config.max_position_embeddings - 2)
    if seconds_left is not None and needed > seconds_left:
        log(
            f"prompt chunks not timed (about {needed:.0f}s needed, {max(seconds_left, 0):.0f}s left): long prompts are read in one call"
        )
        return
    backend = runner.plain_backend()
    seconds = measure(backend, length, REPEATS)
    ir.tuning["prefill_chunk"] = stored(seconds, backend)
    timed = ", ".join(f"{c} tokens {s:.2f}s" for c, s in sorted(seconds.items()))
    log(
        f"a {length}-token prompt read in chunks of {timed}: long prompts are read {ir.tuning['prefill_chunk']['tokens']} tokens a call"
    )


__all__ = ["LENGTH", "estimated_seconds", "needed_seconds", "time_prefill_chunk"]
