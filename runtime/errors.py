"""Errors the toolkit raises for bad input.

Every message is one line that names the problem and the fix; the CLI prints it as
``error: <message>`` and exits non-zero, with no traceback. A message is bounded however long the input
it quotes: ``quote`` shows a prefix of a user-supplied value, and every error's message is folded onto
one line and, past ``MAX_MESSAGE`` characters, cut in the middle (the problem at its start and the fix at
its end both survive).
"""

from __future__ import annotations

import contextlib

MAX_MESSAGE = 600
"""Longest message an error carries (characters)."""
QUOTE_PREFIX = 60
"""Characters of a user-supplied value that a message quotes."""


def quote(value, limit: int = QUOTE_PREFIX) -> str:
    """``repr(value)`` of at most ``limit`` characters of it, its start and its end:
    ``'weights/aaaa...aaaa.safetensors' (1048576 characters)``.
    Surrogates and control characters come out escaped, so the quote is printable on one line."""
    if isinstance(value, str):
        if len(value) <= limit:
            return ascii_safe(repr(value))
        head, tail = value[: limit - limit // 3], value[-(limit // 3) :]  # a path's file name is at its end
        return f"{ascii_safe(repr(head))[:-1]}...{ascii_safe(repr(tail))[1:]} ({len(value)} characters)"
    if isinstance(value, int) and abs(value) >= 10**limit:  # (repr of an int over 4300 digits raises)
        return f"<{value.bit_length()}-bit integer>"
    text = ascii_safe(repr(value))
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def ascii_safe(text: str) -> str:
    """``text`` with lone surrogates escaped (they cannot be printed or encoded as UTF-8)."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def one_line(message, limit: int = MAX_MESSAGE) -> str:
    """``message`` on one line, at most ``limit`` characters (the middle cut out when longer)."""
    text = ascii_safe(" ".join(str(message).split()))
    if len(text) <= limit:
        return text
    keep = (limit - 5) // 2
    return f"{text[:keep]} ... {text[-keep:]}"


class SpeccompileError(Exception):
    """Base class: a problem the user can fix (bad input, missing file, wrong setup). Its message is
    folded onto one bounded line (``one_line``), whatever it quotes."""

    def __init__(self, message: str = "", *args):
        super().__init__(one_line(message), *args)


class ArtifactError(SpeccompileError):
    """An artifact on disk is missing a file, corrupted, or of an unknown schema."""


class InputError(SpeccompileError):
    """A prompt or argument the runtime cannot use (empty prompt, prompt over the context)."""


class BackendUnavailableError(SpeccompileError):
    """The backend an artifact needs is not installed or not built into the artifact."""


class ArtifactOpenError(ArtifactError):
    """An artifact that passed every check still failed to open (a backend's own exception): reported as
    an ArtifactError by ``opening_artifact``, its own class so that fuzzing can count what the checks missed."""


@contextlib.contextmanager
def opening_artifact(root):
    """The runtime's boundary while it opens an artifact: a SpeccompileError passes through, any other
    exception (a backend's RuntimeError, ValueError, ...) becomes one ArtifactOpenError line."""
    try:
        yield
    except SpeccompileError:
        raise
    except Exception as exc:
        raise ArtifactOpenError(
            f"artifact {quote(str(root), 200)} could not be opened ({type(exc).__name__}: {quote(str(exc), 200)}); it "
            "is damaged or was built by another speccompile version: rebuild it (--debug shows the traceback)"
        ) from exc
