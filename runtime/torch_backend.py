"""Moved to ``runtime/backends/torch_backend.py``; this name stays importable."""

from .backends.torch_backend import *  # noqa: F401,F403
from .backends.torch_backend import DTYPES, GRAPH_CACHE_STEP, GRAPH_TOKENS, TorchBackend, TorchDraftHead  # noqa: F401
