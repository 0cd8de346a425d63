"""Continuous batching for ``speccompile serve``: every request in flight decodes in one batch.

Why: with one decoder per request (the earlier slot threads), N concurrent requests each read all the
weights once per step and fight for the same cores, so 4 clients got 1.1x the throughput of one. Here one
decode thread owns a ``BatchDecoder`` (``runtime/decoding/batch.py``): requests join at round boundaries
(their prompts read in chunks beside the running sequences, so those keep their pace), leave when they
finish or their client goes away, and every round reads the weights once for the whole batch. How much each
sequence drafts follows the load (``runtime/decoding/load.py``): speculation where it pays, plain batched
decoding when the batch is full.

What stays per request: its sampling parameters and seed, its stop strings (cut here, as the text
streams), streaming or not, cancellation (checked every round), and its own failure: a request that cannot
decode is answered with its error and leaves the batch; the others go on.

Admission: at most ``max_batch`` sequences decode at once, and fewer when ``kv_budget_bytes`` cannot hold
their caches; past that, up to ``max_queue`` requests wait; beyond, ``submit`` raises ``QueueFull`` (the app
answers 429 with Retry-After).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from speccompile.runtime import SpeculativeModel
from speccompile.runtime.decoding.batch import BatchDecoder
from speccompile.runtime.decoding.load import call_costs, draft_step_segment, longest_draft
from speccompile.runtime.decoding.speculative import DecodeRequest, cache_length
from speccompile.runtime.errors import InputError
from speccompile.runtime.sampling import SamplingParams
from speccompile.server.limits import DEFAULT_MAX_BATCH, DEFAULT_MAX_QUEUE, DEFAULT_PREFILL_CHUNK, check_capacity
from speccompile.server.openai_api import Outcome, SamplingOptions, StopCutter

log = logging.getLogger("speccompile.server")


class QueueFull(Exception):
    """Every batch place is taken and the wait queue is full."""


@dataclass
class Job:
    """One request on its way through the batch. ``emit(text, token_ids)`` gets each round's sendable text
    (streaming); ``done(outcome or exception)`` is called once, from the decode thread."""

    prompt_ids: list[int]
    options: SamplingOptions
    emit: Callable[[str, list[int]], None] | None
    done: Callable[[object], None]
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    # set while decoding
    sequence: object | None = None
    cutter: StopCutter | None = None
    produced: list[int] = field(default_factory=list)
    text: str = ""
    sent: list[str] = field(default_factory=list)
    ended_by: str | None = None


class Scheduler:
    """The decode thread and its queue (see the module docstring)."""

    def __init__(
        self,
        model: SpeculativeModel,
        max_batch: int = DEFAULT_MAX_BATCH,
        max_queue: int = DEFAULT_MAX_QUEUE,
        prefill_chunk: int | None = DEFAULT_PREFILL_CHUNK,
        kv_budget_bytes: int | None = None,
        speculate: bool = True,
        plan: str | None = None,
        measure_costs: bool = True,
        observe: Callable[[dict], None] | None = None,
        keep_prompts: int | None = None,
        token_budget: int | None = None,
    ):
        check_capacity(max_batch, max_queue)
        self.model, self.max_batch, self.max_queue = model, max_batch, max_queue
        self.kv_budget_bytes, self.observe = kv_budget_bytes, observe
        self.plan = model.draft_plan(plan) if speculate else None
        self.decoder = BatchDecoder(
            model.backend,
            max_batch=max_batch,
            prefill_chunk=prefill_chunk,
            root=model.root,
            keep_prompts=keep_prompts,
            token_budget=token_budget,
        )
        if self.plan is not None and max_batch > 1 and measure_costs:
            # what the load policy prices drafts with: the build's timings on this machine, or timed now (seconds)
            width = longest_draft(self.plan) + 1
            stored = model.manifest.tuning.get("call_costs")
            self.decoder.costs = call_costs(
                self.decoder.backend, stored, max_rows=max_batch, max_width=width, draft=draft_step_segment(self.plan)
            )
        self.costs = self.decoder.costs
        self.waiting: collections.deque[Job] = collections.deque()
        self.running: list[Job] = []
        self._lock = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="speccompile-batch", daemon=True)
        self._thread.start()

    # -- the app's side ------------------------------------------------------------------------------
    def set_plan(self, plan: str | None, speculate: bool = True) -> None:
        """Draft with ``plan`` (None: the manifest's default), or decode plainly, from the next request on
        (Ray's ``reconfigure``). Call costs are timed at start only: a server started plain and switched to a
        plan drafts without the load policy's cuts."""
        self.plan = self.model.draft_plan(plan) if speculate else None

    @property
    def busy(self) -> int:
        return len(self.running)

    @property
    def queued(self) -> int:
        return len(self.waiting)

    def submit(self, job: Job) -> None:
        with self._lock:
            if len(self.running) + len(self.waiting) >= self.max_batch + self.max_queue:
                raise QueueFull(
                    f"all {self.max_batch} batch places are taken and {len(self.waiting)} requests are queued "
                    f"(--max-queue {self.max_queue}); retry later"
                )
            self.waiting.append(job)
            self._lock.notify()

    def close(self) -> None:
        with self._lock:
            self._stop = True
            self._lock.notify()
        self._thread.join(timeout=10)

    # -- the decode thread ---------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._stop and not self.waiting and not self.running:
                    self._lock.wait()
                if self._stop:
                    for job in list(self.waiting) + self.running:
                        job.done(InputError("the server is shutting down; retry on another replica"))
                    return
                self._admit()
            if not self.running:
                continue
            try:
                produced = self.decoder.step()
            except Exception as exc:  # a backend failure: the batch's requests get the error, the server goes on
                log.exception("a decode step failed; its %d requests get the error", len(self.running))
                for job in list(self.running):
                    self._leave(job, exc)
                continue
            by_sequence = {id(job.sequence): job for job in self.running}
            for sequence, new in produced:
                job = by_sequence.get(id(sequence))
                if job is not None:
                    self._deliver(job, new)
            if self.observe is not None:
                self.observe(dict(self.decoder.last_round, batch=len(self.running)))
            for job in list(self.running):
                if job.sequence.finished or job.ended_by is not None or job.cancelled.is_set():
                    self._finish(job)

    def _admit(self) -> None:
        """Move waiting jobs into the batch while it has room (places and KV budget)."""
        while self.waiting and len(self.running) < self.max_batch:
            job = self.waiting[0]
            if job.cancelled.is_set():
                self.waiting.popleft()
                job.done(_cancelled(job))
                continue
            request = DecodeRequest(
                job.prompt_ids,
                job.options.max_tokens,
                SamplingParams(job.options.temperature, job.options.top_k, job.options.top_p),
                self.model.eos_ids,
                job.options.seed,
            )
            if not self._fits(request):
                break
            self.waiting.popleft()
            try:
                job.sequence = self.decoder.add(request, self.plan)
            except Exception as exc:  # this request alone cannot decode (too long for the cache, ...)
                job.done(exc)
                continue
            job.cutter = StopCutter(job.options.stops)
            self.running.append(job)

    def _fits(self, request: DecodeRequest) -> bool:
        """Whether the KV budget holds one more sequence (every slot is as long as the longest request)."""
        if self.kv_budget_bytes is None or not self.running:
            return True
        length = max(cache_length(self.model.backend, request, self.plan), self.decoder.backend.max_len)
        return (len(self.running) + 1) * length * _kv_bytes_per_position(self.model) <= self.kv_budget_bytes

    def _deliver(self, job: Job, new: list[int]) -> None:
        if not new or job.ended_by is not None:
            return
        if job.first_token is None:
            job.first_token = time.perf_counter()
        job.produced.extend(new)
        full = self.model.tokenizer.decode(job.produced)
        delta = full[len(job.text) :] if not full.endswith("\ufffd") else ""  # hold back a split UTF-8 character
        job.text += delta
        piece = job.cutter.feed(delta)
        job.sent.append(piece)
        if job.emit is not None:
            job.emit(piece, list(new))
        if job.cutter.stopped:
            job.ended_by = "stop_string"

    def _finish(self, job: Job) -> None:
        sequence, stats = job.sequence, job.sequence.stats
        if job.ended_by is None and job.cancelled.is_set() and not sequence.finished:
            job.ended_by = "cancelled"
        if job.ended_by is None:  # ran to the end: the rest of the text, then the runtime's stats
            full = self.model.tokenizer.decode(job.produced)
            tail = job.cutter.feed(full[len(job.text) :]) + job.cutter.flush()
            if tail:
                job.sent.append(tail)
                if job.emit is not None:
                    job.emit(tail, [])
            finish = "stop" if job.cutter.stopped or stats.stop_reason == "eos" else "length"
            speculative = stats.speculative
            outcome = Outcome(
                "".join(job.sent),
                list(job.produced),
                len(job.prompt_ids),
                finish,
                time.perf_counter() - job.submitted,
                stats.rounds if speculative else None,
                stats.mean_accepted,
                stats.acceptance_rate,
                "stop_string" if job.cutter.stopped else stats.stop_reason,
                drafted=stats.drafted if speculative else None,
                accepted=stats.accepted if speculative else None,
            )
        else:
            outcome = Outcome(
                "".join(job.sent),
                list(job.produced),
                len(job.prompt_ids),
                "stop" if job.ended_by == "stop_string" else "cancelled",
                time.perf_counter() - job.submitted,
                None,
                None,
                None,
                job.ended_by,
            )
        outcome.ttft = None if job.first_token is None else job.first_token - job.submitted
        outcome.cached_tokens = job.sequence.reused if job.sequence is not None else 0
        self._leave(job, outcome)

    def _leave(self, job: Job, result: object) -> None:
        if job in self.running:
            self.running.remove(job)
        if job.sequence is not None and job.sequence in self.decoder.sequences:
            self.decoder.remove(job.sequence)
        try:
            job.done(result)
        except Exception:  # a caller's callback must not stop the batch
            log.exception("a request's completion callback failed")


def _cancelled(job: Job) -> Outcome:
    return Outcome(
        "", [], len(job.prompt_ids), "cancelled", time.perf_counter() - job.submitted, None, None, None, "cancelled"
    )


def _kv_bytes_per_position(model: SpeculativeModel) -> int:
    c = model.manifest.config
    itemsize = 2 if model.manifest.dtype in ("float16", "bfloat16") else 4
    return 2 * c.num_layers * c.num_kv_heads * c.head_dim * itemsize


__all__ = ["Job", "QueueFull", "Scheduler"]
