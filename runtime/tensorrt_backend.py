"""Moved to ``runtime/backends/tensorrt_backend.py``; this name stays importable."""

from .backends.tensorrt_backend import *  # noqa: F401,F403
