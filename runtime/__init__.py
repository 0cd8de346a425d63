"""speccompile.runtime: load an artifact and run lossless draft-and-verify decoding.

Imports numpy and tokenizers only; torch is imported when a torch-backend artifact is opened.
"""

from .artifact.manifest import SCHEMA_VERSION, ArchConfig, DraftPlan, Manifest, read_manifest
from .errors import ArtifactError, BackendUnavailableError, InputError, SpeccompileError
from .model import GenerationResult, SpeculativeModel, load, read_artifact

__all__ = [
    "ArchConfig",
    "ArtifactError",
    "BackendUnavailableError",
    "DraftPlan",
    "GenerationResult",
    "InputError",
    "Manifest",
    "SCHEMA_VERSION",
    "SpeccompileError",
    "SpeculativeModel",
    "load",
    "read_artifact",
    "read_manifest",
]
