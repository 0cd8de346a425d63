"""Errors the toolkit raises for bad input.

Every message is one line that names the problem and the fix; the CLI prints it as
``error: <message>`` and exits non-zero, with no traceback.
"""


class SpeccompileError(Exception):
    """Base class: a problem the user can fix (bad input, missing file, wrong setup)."""


class ArtifactError(SpeccompileError):
    """An artifact on disk is missing a file, corrupted, or of an unknown schema."""


class InputError(SpeccompileError):
    """A prompt or argument the runtime cannot use (empty prompt, prompt over the context)."""


class BackendUnavailableError(SpeccompileError):
    """The backend an artifact needs is not installed or not built into the artifact."""
