"""``speccompile serve``: the OpenAI-compatible server (``app.py``), the OpenAI wire format it speaks
(``openai_api.py``: request bodies and their checks, prompts, chat template, stop strings, responses) and its
defaults and bounds (``limits.py``).

The app's names are imported on first use, not with the package: the CLI reads ``limits.py`` when it starts,
and that must work, and stay quick, without FastAPI installed."""

from importlib import import_module

__all__ = ["create_app", "run_server", "serve_in_thread"]


def __getattr__(name: str):
    if name in __all__:
        return getattr(import_module(".app", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
