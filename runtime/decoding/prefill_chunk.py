"""How many prompt tokens a request alone reads per call: measured where the artifact was built, kept per machine.

Why: one call over a long prompt is slower than the same prompt read in chunks on both backends (ONNX Runtime's
GroupQueryAttention and the products of a very long row cost more per token than those of a few hundred; measured:
docs/history.md, 'Figures behind the code's constants'), and the best chunk differs by backend and machine, so the
build times a prompt in chunks of each candidate length (``measure``) and stores the fastest with the machine it
was timed on (``tuning["prefill_chunk"]``); a request alone on that machine reads its prompt in such chunks
(``chunk_for``), elsewhere in one call as before. Chunks change when the KV is written, not what it holds: every
token attends to the same past, so outputs are the verifier's as always (floating-point near-ties aside:
docs/design.md section 6).
"""

from __future__ import annotations

import time

from ..errors import ArtifactError
from ..machine import machine_key
from ..segments import Row, full_model

CANDIDATES = (256, 512, 1024)  # chunk lengths timed; a prompt as long as the timed one is also read in one call


def measure(backend, length: int, repeats: int = 2) -> dict[int, float]:
    """Seconds to read a prompt of ``length`` tokens in chunks of each candidate below it and in one call (the
    best of ``repeats``), on slot 0 of ``backend``."""
    full = full_model(backend.config.num_layers)
    backend.reserve(length + 2, slots=1)
    prompt = [1 + (7 * i) % max(backend.config.vocab_size - 2, 1) for i in range(length)]
    seconds = {}
    for chunk in sorted({c for c in CANDIDATES if c < length} | {length}):
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            for first in range(0, length, chunk):
                backend.run_rows(full, [Row(0, first, prompt[first : first + chunk], last_only=True)])
            times.append(time.perf_counter() - start)
        seconds[chunk] = min(times)
    return seconds


def stored(seconds: dict[int, float], backend) -> dict:
    """What the build writes into ``tuning["prefill_chunk"]``: the fastest chunk, the timings, the machine."""
    best = min(seconds, key=seconds.get)
    return {
        "tokens": best,
        "seconds": {str(k): float(f"{v:.6g}") for k, v in sorted(seconds.items())},
        "machine": machine_key(backend),
    }


def chunk_for(tuning: dict, backend) -> int | None:
    """The prompt chunk a request alone reads per call on ``backend``: the build's when it was timed on this machine
    and backend, else None (the whole prompt in one call). A one-line ``ArtifactError`` when it is malformed."""
    data = tuning.get("prefill_chunk")
    if data is None:
        return None
    tokens = data.get("tokens") if isinstance(data, dict) else None
    if (
        not isinstance(tokens, int)
        or isinstance(tokens, bool)
        or tokens < 1
        or not isinstance(data.get("machine"), str)
    ):
        raise ArtifactError(
            'the manifest\'s tuning.prefill_chunk is malformed (need {"tokens": int >= 1, "machine": str}); rebuild the '
            "artifact"
        )
    return tokens if data["machine"] == machine_key(backend) else None


__all__ = ["CANDIDATES", "chunk_for", "measure", "stored"]
