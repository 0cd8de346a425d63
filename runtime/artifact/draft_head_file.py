"""Draft heads: a trained exit adapter and a reduced draft vocabulary, in one safetensors file (numpy only).

An early exit through the model's shared final norm and lm_head drafts poorly on a model that was never
trained for it. A *draft head* fixes the draft without touching the target (Kangaroo, EESD):

- an **exit adapter**: one gated MLP of the model's width on the hidden state after block E, added to
  the residual stream, ``h + down(act(gate(norm(h))) * up(norm(h)))``, followed by the model's own final
  norm and lm_head (frozen, shared). A gated MLP needs no KV cache of its own, so the draft's KV and
  hidden states for blocks 0..E-1 stay exactly the verifier's (prefix reuse unchanged) and nothing has
  to be computed for verified positions; an attention block would need its own KV for every position,
  verified ones included. ``down`` starts at zero, so an untrained adapter *is* the shared-head exit.
- a **reduced vocabulary**: the draft scores only ``draft_vocab`` token ids (the tokens the target
  produces most often); the verifier always uses the full head, so greedy output is unchanged, and for
  sampling the draft's q is zero outside the subset, which the rejection rule handles like any q.

The file (``draft_heads/<plan>.safetensors``, hashed in the manifest like every artifact file) holds
``adapter.norm.weight`` (+ ``.bias`` for LayerNorm models), ``adapter.gate.weight`` ``[I, d]``,
``adapter.up.weight`` ``[I, d]``, ``adapter.down.weight`` ``[d, I]`` when there is an adapter, and ``vocab.ids``
(int64, ``[N]``) when the vocabulary is reduced; its metadata names the format and the exit layer. Backends build
their own kernels from these arrays (``runtime/backends/torch/backend.TorchDraftHead``, the ONNX ``draft_head.*``
graphs of ``speccompile/exporters/onnx_blocks.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import ArtifactError

FORMAT = "speccompile-draft-head"
FORMAT_VERSION = "1"
ADAPTER_KEYS = ("adapter.gate.weight", "adapter.up.weight", "adapter.down.weight", "adapter.norm.weight")
VOCAB_KEY = "vocab.ids"


@dataclass
class DraftHead:
    """What a draft head file holds: adapter weights (``adapter.*``, float32) and/or reduced-vocabulary ids."""

    adapter: dict[str, np.ndarray] = field(default_factory=dict)
    vocab: np.ndarray | None = None  # int64 token ids the draft scores, in the order its logits come out
    exit_layer: int | None = None

    @property
    def has_adapter(self) -> bool:
        return bool(self.adapter)

    def save(self, path: Path) -> None:
        from safetensors.numpy import save_file

        tensors = {f"{name}": np.ascontiguousarray(a, dtype=np.float32) for name, a in self.adapter.items()}
        if self.vocab is not None:
            tensors[VOCAB_KEY] = np.ascontiguousarray(self.vocab, dtype=np.int64)
        metadata = {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "exit_layer": "" if self.exit_layer is None else str(self.exit_layer),
        }
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path), metadata=metadata)

    @classmethod
    def load(cls, path: Path, hidden_size: int, vocab_size: int) -> "DraftHead":
        """Read and check a draft head file against the model's geometry; problems are one-line ArtifactErrors."""
        from safetensors import safe_open

        path = Path(path)
        if not path.is_file():
            raise ArtifactError(f"draft head file {str(path)!r} is missing; rebuild the artifact")
        try:
            with safe_open(str(path), framework="numpy") as handle:
                metadata = handle.metadata() or {}
                tensors = {name: handle.get_tensor(name) for name in handle.keys()}
        except Exception as exc:  # safetensors raises its own error types for damaged headers
            raise ArtifactError(
                f"draft head file {path.name!r} cannot be read ({str(exc)[:120]}); rebuild the artifact"
            ) from None
        if metadata.get("format") != FORMAT or metadata.get("version") != FORMAT_VERSION:
            raise ArtifactError(
                f"{path.name!r} is not a speccompile draft head (format {metadata.get('format')!r}, "
                f"version {metadata.get('version')!r}); rebuild the artifact"
            )
        adapter = {name: a.astype(np.float32, copy=False) for name, a in tensors.items() if name.startswith("adapter.")}
        if adapter:
            missing = [k for k in ADAPTER_KEYS if k not in adapter]
            width = adapter.get("adapter.gate.weight", np.zeros((0, 0))).shape
            if (
                missing
                or width[1:] != (hidden_size,)
                or adapter["adapter.down.weight"].shape != (hidden_size, width[0])
            ):
                raise ArtifactError(
                    f"draft head {path.name!r} does not fit this model (missing {missing}, gate {width}, "
                    f"hidden size {hidden_size}); rebuild the artifact"
                )
        vocab = tensors.get(VOCAB_KEY)
        if vocab is not None:
            vocab = vocab.astype(np.int64, copy=False)
            if vocab.ndim != 1 or not len(vocab) or vocab.min() < 0 or vocab.max() >= vocab_size:
                raise ArtifactError(
                    f"draft head {path.name!r} has vocabulary ids outside 0..{vocab_size - 1}; rebuild the artifact"
                )
        exit_layer = metadata.get("exit_layer") or None
        return cls(adapter=adapter, vocab=vocab, exit_layer=int(exit_layer) if exit_layer else None)


def expand_logits(reduced: np.ndarray, vocab: np.ndarray | None, vocab_size: int) -> np.ndarray:
    """Full-vocabulary logits from a reduced head's: ``-inf`` outside the subset, so argmax, softmax and
    every sampling transform see a distribution that is exactly zero there."""
    if vocab is None:
        return reduced
    full = np.full(reduced.shape[:-1] + (vocab_size,), -np.inf, dtype=np.float32)
    full[..., vocab] = reduced
    return full


_CACHE: dict[tuple, DraftHead] = {}


def load_draft_head(path: Path, hidden_size: int, vocab_size: int) -> DraftHead:
    """``DraftHead.load``, once per file version (path, size, mtime): every replica and request shares it."""
    path = Path(path).resolve()
    try:
        stat = path.stat()
    except OSError:
        raise ArtifactError(f"draft head file {str(path)!r} is missing; rebuild the artifact") from None
    key = (str(path), stat.st_size, stat.st_mtime_ns, hidden_size, vocab_size)
    if key not in _CACHE:
        _CACHE[key] = DraftHead.load(path, hidden_size, vocab_size)
    return _CACHE[key]


__all__ = ["DraftHead", "expand_logits", "load_draft_head"]
