"""``load(path)``: an artifact on disk -> a model that generates, speculatively or not.

This module imports neither torch nor transformers; the torch backend is imported only when an
artifact is opened with it, so an ONNX/TensorRT artifact runs with numpy + tokenizers + its engine.
"""

from __future__ import annotations

import math
import numbers
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from .artifact.manifest import Manifest, read_manifest
from .artifact.tokenizer import TextTokenizer
from .backends import BACKENDS, BackendDescriptor
from .backends.weights_check import check_after_open, check_before_open
from .decoding.prefill_chunk import chunk_for
from .decoding.speculative import DecodeRequest, Stats, backend_drafter, decode, reserve_cache
from .drafting import ReadPlan, check_plans
from .errors import BackendUnavailableError, InputError, opening_artifact
from .sampling import SamplingParams

TOKENIZER_FILE = "tokenizer/tokenizer.json"


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    prompt_ids: list[int]
    stats: Stats

    def as_dict(self) -> dict:
        return {"text": self.text, "token_ids": self.token_ids, **self.stats.as_dict()}


@dataclass
class Chunk:
    """What one step (plain) or one verify round (speculative) added."""

    text: str
    token_ids: list[int]


@dataclass
class Stream:
    """Iterate for chunks; ``result`` is filled in when the iteration ends."""

    _chunks: Iterator[Chunk]
    result: GenerationResult | None = field(default=None)

    def __iter__(self) -> Iterator[Chunk]:
        return self._chunks


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_request(prompt, max_new_tokens, temperature, top_k, top_p, seed, max_draft) -> None:
    """Refuse generation arguments that would crash deep in decoding or, worse, decode wrongly (a nan
    temperature samples the same token forever) with one InputError naming the argument."""
    if isinstance(prompt, str):
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError:
            raise InputError("the prompt is not valid UTF-8 text (it holds lone surrogates); pass UTF-8 text") from None
    elif isinstance(prompt, (list, tuple)) and not all(_is_int(t) for t in prompt):
        raise InputError("the prompt must be text or a list of integer token ids")
    if not _is_int(max_new_tokens) or max_new_tokens < 1:
        raise InputError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if not isinstance(temperature, numbers.Real) or not math.isfinite(temperature) or temperature < 0:
        raise InputError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
    if not _is_int(top_k) or top_k < 0:
        raise InputError(f"top_k must be an integer >= 0 (0 = no cut), got {top_k!r}")
    if not isinstance(top_p, numbers.Real) or not 0.0 < top_p <= 1.0:  # also refuses nan
        raise InputError(f"top_p must be in (0, 1], got {top_p!r}")
    if seed is not None and (not _is_int(seed) or seed < 0):
        raise InputError(f"seed must be a non-negative integer, got {seed!r}")
    if max_draft is not None and (not _is_int(max_draft) or max_draft < 1):
        raise InputError(f"max_draft must be an integer >= 1, got {max_draft!r}")


def _descriptor(manifest: Manifest, backend: str | None) -> BackendDescriptor:
    """The descriptor of the backend to open: ``backend``, else the artifact's first; a one-line error when this
    artifact has none of that backend or the runtime does not know it."""
    available = list(manifest.backends)
    name = backend or available[0]
    if name not in manifest.backends:
        raise BackendUnavailableError(
            f"this artifact has no '{name}' backend (it has: {', '.join(available)}); rebuild with --backend {name}"
        )
    return BACKENDS.descriptor(name)


class SpeculativeModel:
    """A loaded artifact: tokenizer, backend and draft plans."""

    def __init__(
        self,
        root: Path,
        manifest: Manifest,
        backend,
        tokenizer: TextTokenizer,
        refused: str | None = None,
        plans: dict[str, ReadPlan] | None = None,
    ):
        """``refused``: why this backend must not speculate here (``BackendDescriptor.speculation_refusal``);
        ``plans``: the manifest's plans read once (``drafting.check_plans``; read here when not given)."""
        self.root, self.manifest, self.backend, self.tokenizer = root, manifest, backend, tokenizer
        self.plans = plans if plans is not None else check_plans(manifest)
        self.context = manifest.config.max_position_embeddings
        self.eos_ids = manifest.eos_ids
        self.refused = refused
        # prompt tokens a request alone reads per call: the build's measured chunk on this machine (prefill_chunk.py)
        self.prefill_chunk = chunk_for(manifest.tuning, backend)

    def replica(self) -> "SpeculativeModel":
        """The same artifact with its own KV cache, sharing weights, sessions and tokenizer: one per
        concurrent sequence (a server's slots). Each replica must be used by one thread at a time."""
        return SpeculativeModel(
            self.root, self.manifest, self.backend.replica(), self.tokenizer, self.refused, self.plans
        )

    def plan(self, name: str | None = None) -> ReadPlan:
        """The plan ``name`` (default: the manifest's default plan), read; a one-line error naming the known
        plans for an unknown name."""
        return self.plans[self.manifest.plan(name).name]

    def draft_plan(self, name: str | None = None) -> ReadPlan | None:
        """The plan to draft with: ``name``, else the manifest's default; None (plain decoding) when the
        artifact has no default plan because none beat plain decoding where it was tuned, or when speculation
        is refused on this machine (``refused``)."""
        if self.refused is not None or (name is None and self.manifest.default_plan is None):
            return None
        return self.plan(name)

    @property
    def plain_reason(self) -> str | None:
        """Why speculative requests decode plainly, or None when a default plan exists."""
        if self.refused is not None:
            return self.refused
        if self.manifest.default_plan is not None:
            return None
        best = self.manifest.tuning.get("best_confirmed_speedup")
        where = self.manifest.tuning.get("device", "the build machine")
        figure = f" (best confirmed {best:.2f}x)" if isinstance(best, (int, float)) else ""
        return f"no draft plan beat plain decoding on {where}{figure}, so this artifact decodes plainly"

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        if not ids or (isinstance(prompt, str) and not prompt.strip()):
            raise InputError("the prompt is empty; pass some text with --prompt")
        vocab = self.manifest.config.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise InputError(f"prompt token ids must be in 0..{vocab - 1}")
        if len(ids) >= self.context:
            raise InputError(
                f"the prompt is {len(ids)} tokens but the model's context is {self.context}; shorten the prompt"
            )
        return ids

    def stream(
        self,
        prompt: str | list[int],
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        speculate: bool = True,
        plan: str | None = None,
        max_draft: int | None = None,
    ) -> Stream:
        check_request(prompt, max_new_tokens, temperature, top_k, top_p, seed, max_draft)
        prompt_ids = self.encode_prompt(prompt)
        draft_plan = self.draft_plan(plan) if speculate else None
        request = DecodeRequest(
            prompt_ids=prompt_ids,
            max_new_tokens=max_new_tokens,
            params=SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p),
            eos_ids=self.eos_ids,
            seed=seed,
        )
        reserve_cache(self.backend, request, draft_plan, max_draft)
        drafter = backend_drafter(self.backend, draft_plan, self.root, max_draft)
        stats = Stats()
        stream = Stream(iter(()))

        def chunks() -> Iterator[Chunk]:
            produced: list[int] = []
            text = ""
            start = time.perf_counter()
            try:
                for new in decode(self.backend, request, drafter, stats, self.prefill_chunk):
                    produced.extend(new)
                    full = self.tokenizer.decode(produced)
                    # Hold back text that ends in an incomplete UTF-8 sequence until it completes.
                    delta = full[len(text) :] if not full.endswith("\ufffd") else ""
                    text += delta
                    yield Chunk(text=delta, token_ids=new)
            finally:
                # Also when the caller stops early (a stop string, a client that hung up): the result
                # then holds what was produced so far, with its round statistics.
                if stream.result is None and not stats.seconds:
                    stats.seconds = time.perf_counter() - start
                if stream.result is None:
                    if stats.stop_reason == "length" and stats.new_tokens < request.max_new_tokens:
                        stats.stop_reason = "cancelled"
                    stream.result = GenerationResult(
                        text=self.tokenizer.decode(produced), token_ids=produced, prompt_ids=prompt_ids, stats=stats
                    )

        stream._chunks = chunks()
        return stream

    def generate(self, prompt: str | list[int], **kwargs) -> GenerationResult:
        """Generate to completion. Keyword arguments as for ``stream``."""
        stream = self.stream(prompt, **kwargs)
        for _ in stream:
            pass
        return stream.result


def read_artifact(path: str | Path, verify: bool = True, backends: list[str] | None = None) -> Manifest:
    """Everything loading checks short of opening a backend: the manifest and its files' hashes, every plan's
    draft kind and sources (``drafting.check_plans``), and the geometry against the headers of the weights of
    ``backends`` (default: every backend the artifact lists; the torch decoder's tensor names only where torch is
    installed). ``inspect`` reports through this, so an artifact it summarises is one ``load`` opens."""
    return _read_checked(Path(path), verify, backends)[0]


def _read_checked(root: Path, verify: bool, backends: list[str] | None) -> tuple[Manifest, dict[str, ReadPlan]]:
    """``read_artifact``'s checks; the manifest and its plans read once."""
    with opening_artifact(root):
        manifest = read_manifest(root, verify_files=verify)
        plans = check_plans(manifest)
        for name in manifest.backends if backends is None else backends:
            if name in manifest.backends:  # (an unknown name: _descriptor's one-line error)
                check_before_open(root, manifest, name)
    return manifest, plans


def load(path: str | Path, backend: str | None = None, device: str = "cpu", verify: bool = True) -> SpeculativeModel:
    """Open an artifact: check its manifest and file hashes, its plans, its geometry against the weights'
    headers, then load tokenizer and backend. Whatever goes wrong is a SpeccompileError (one line)."""
    root = Path(path)
    with opening_artifact(root):
        manifest, plans = _read_checked(root, verify, backends=[])
        descriptor = _descriptor(manifest, backend)
        descriptor.check_before_open(root, manifest)  # only the backend opened
        tokenizer = TextTokenizer(root / TOKENIZER_FILE)
        opened = descriptor.open(root, manifest, plans, device)
        check_after_open(manifest, opened)
        opened.prepare_plans(plans)  # not inside the first request (the torch int8 twin)
        refused = descriptor.speculation_refusal(opened)  # a quantized target whose verify rounds unlike its steps
    return SpeculativeModel(root, manifest, opened, tokenizer, refused, plans)
