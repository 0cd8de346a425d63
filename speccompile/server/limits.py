"""The server's defaults and bounds, each written once: the CLI's ``serve`` options (and ``serve --ray``'s),
``create_app`` and its ``Scheduler``, and the Ray application's arguments (``ServeArgs``) all read them here, so
a default changed here changes everywhere at once. It imports neither FastAPI nor Ray: the CLI reads it to
build its options whether or not the server's extras are installed."""

from __future__ import annotations

from speccompile.runtime.errors import InputError

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000

DEFAULT_MAX_BATCH = 8
MAX_BATCH_BOUNDS = (1, 256)
"""Least and most requests decoding at once that ``--max-batch`` takes. The Python API and Ray's arguments
refuse only fewer than the least: a bigger batch is bounded by memory, which they cannot know in advance."""

DEFAULT_MAX_QUEUE = 16
DEFAULT_PREFILL_CHUNK = 256

DEFAULT_SCALE_DOWN_AFTER_S = 60.0
DEFAULT_REPLICA_CPUS = 1.0


def check_capacity(max_batch: int, max_queue: int) -> None:
    """An InputError (one line: the value that is wrong and what it must be) unless ``max_batch`` and
    ``max_queue`` are sizes the server can run with."""
    least = MAX_BATCH_BOUNDS[0]
    if max_batch < least:
        raise InputError(f"max_batch must be at least {least} (got {max_batch})")
    if max_queue < 0:
        raise InputError(f"max_queue must be 0 or more (got {max_queue})")
