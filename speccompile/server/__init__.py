"""``speccompile serve``: the OpenAI-compatible server (``app.py``) and the OpenAI wire format it speaks
(``openai_api.py``: request bodies and their checks, prompts, chat template, stop strings, responses)."""

from .app import create_app, run_server, serve_in_thread

__all__ = ["create_app", "run_server", "serve_in_thread"]
