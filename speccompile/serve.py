"""``speccompile serve``: an OpenAI-compatible HTTP endpoint for a compiled artifact.

Why this shape:
- One copy of the weights, N *slots*: each slot is a ``model.replica()`` (its own KV cache, shared
  weights and sessions) that one request owns while it decodes. Decoding runs in a worker thread per slot,
  so the event loop keeps answering ``/health`` and ``/metrics`` while every slot is busy.
- Requests beyond the slots wait in a bounded queue; past ``max_queue`` they get 429 with Retry-After
  instead of piling up, so a load balancer can send them to another replica.
- A streaming client that disconnects sets a flag the worker checks after every verify round, so its slot
  is free again one round later, not after the whole generation.
- Every bad request gets a 4xx with the OpenAI error body ``{"error": {"message", "type", "param",
  "code"}}``; the message names the problem and the fix, as the CLI's errors do.

The app is a plain FastAPI (ASGI) object from ``create_app``, so any ASGI server or process manager can
run it; ``run_server`` runs it with uvicorn, ``serve_in_thread`` on a free loopback port (tests, benchmarks).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import math
import secrets
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Iterator, Literal, Union

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from speccompile.runtime import InputError, SpeculativeModel, load

DEFAULT_MAX_BODY_BYTES = 1 << 20
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # the OpenAI API's default for /v1/completions
MAX_STOP_STRINGS = 8


# -- errors --------------------------------------------------------------------------------------------

class APIError(Exception):
    """A request the server refuses: HTTP status plus an OpenAI-style error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers or {}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   kind: str = "invalid_request_error", headers: dict[str, str] | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def _validation_message(exc: ValidationError) -> tuple[str, str | None]:
    """The first pydantic error as one line naming the field, and the field (the error's ``param``)."""
    err = exc.errors()[0]
    loc = [str(part) for part in err.get("loc", ())]
    name = ".".join(loc) or None
    if err["type"] == "extra_forbidden":
        return f"unrecognized request argument '{name}'; remove it (this server does not support it)", name
    if err["type"] == "missing":
        return f"missing required field '{name}'", name
    if not loc:
        return f"the request body must be a JSON object ({err['msg']})", None
    return f"field '{name}': {err['msg']}", name


# -- request bodies --------------------------------------------------------------------------------------

class _Request(BaseModel):
    """Fields shared by both endpoints. Unknown fields are refused (400), as the OpenAI API does, so a
    misspelt parameter is not silently ignored."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # extension (as in vLLM); 0 = no top-k cut
    seed: int | None = None
    stop: Union[str, list[str], None] = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None


class CompletionRequest(_Request):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: Union[str, list[dict[str, Any]], None] = None


class ChatRequest(_Request):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None


def _refuse_unsupported(req: _Request) -> None:
    """400 for OpenAI parameters this server does not implement, instead of silently ignoring them."""
    unsupported = {
        "n": req.n != 1, "presence_penalty": req.presence_penalty != 0, "frequency_penalty": req.frequency_penalty != 0,
        "logit_bias": bool(req.logit_bias), "logprobs": bool(getattr(req, "logprobs", None)),
        "top_logprobs": bool(getattr(req, "top_logprobs", None)), "echo": bool(getattr(req, "echo", False)),
        "best_of": (getattr(req, "best_of", None) or 1) != 1, "suffix": getattr(req, "suffix", None) is not None,
    }
    for name, used in unsupported.items():
        if used:
            hint = "; send one request per completion" if name in ("n", "best_of") else ""
            raise APIError(400, f"'{name}' is not supported by this server{hint}", param=name, code="unsupported_parameter")


@dataclass
class SamplingOptions:
    """Checked sampling parameters, as keyword arguments for ``model.stream``."""

    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stops: list[str]

    def stream_kwargs(self) -> dict:
        return dict(max_new_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p,
                    top_k=self.top_k, seed=self.seed)


def check_sampling(req: _Request, max_tokens: int | None, prompt_tokens: int, context: int) -> SamplingOptions:
    """Range checks with messages naming the value and the fix; max_tokens defaults to the rest of the context."""
    if not 0.0 <= req.temperature <= 2.0:
        raise APIError(400, f"temperature must be between 0 and 2 (got {req.temperature}); use 0 for greedy", "temperature")
    if not 0.0 < req.top_p <= 1.0:
        raise APIError(400, f"top_p must be in (0, 1] (got {req.top_p})", "top_p")
    if req.top_k < 0:
        raise APIError(400, f"top_k must be 0 (no cut) or positive (got {req.top_k})", "top_k")
    if req.seed is not None and not 0 <= req.seed < 2**63:
        raise APIError(400, f"seed must be an integer in 0..2**63-1 (got {req.seed})", "seed")
    if prompt_tokens >= context:
        raise APIError(400, f"the prompt is {prompt_tokens} tokens but the model's context is {context}; shorten "
                            "the prompt", "prompt", code="context_length_exceeded")
    room = context - prompt_tokens
    if max_tokens is None:
        max_tokens = room
    if max_tokens < 1:
        raise APIError(400, f"max_tokens must be at least 1 (got {max_tokens})", "max_tokens")
    if max_tokens > room:
        raise APIError(400, f"the prompt is {prompt_tokens} tokens and max_tokens is {max_tokens}: together "
                            f"{prompt_tokens + max_tokens}, over the model's context of {context} tokens; "
                            f"lower max_tokens to at most {max(room, 0)} or shorten the prompt", "max_tokens",
                       code="context_length_exceeded")
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stops) > MAX_STOP_STRINGS:
        raise APIError(400, f"at most {MAX_STOP_STRINGS} stop strings are supported (got {len(stops)})", "stop")
    return SamplingOptions(max_tokens, req.temperature, req.top_p, req.top_k, req.seed, [s for s in stops if s])


# -- prompts: plain text, token ids, chat ----------------------------------------------------------------

def completion_prompt_ids(model: SpeculativeModel, prompt) -> list[int]:
    """One prompt (text or token ids) -> token ids; batches are refused, not silently truncated."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise APIError(400, f"batched prompts ({len(prompt)}) are not supported; send one request per prompt",
                           "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt.strip():
            raise APIError(400, "the prompt is empty; send some text", "prompt")
        ids = model.tokenizer.encode(prompt)
    else:
        ids = [int(t) for t in prompt]
    if not ids:
        raise APIError(400, "the prompt is empty; send some text or token ids", "prompt")
    vocab = model.manifest.config.vocab_size
    if any(not 0 <= t < vocab for t in ids):
        raise APIError(400, f"prompt token ids must be in 0..{vocab - 1}", "prompt")
    return ids


class ChatTemplate:
    """The artifact tokenizer's Jinja chat template, rendered in a sandbox as transformers renders it
    (``apply_chat_template`` with ``add_generation_prompt=True``), then tokenized without adding special
    tokens, since the template writes them itself. No transformers needed at serve time."""

    def __init__(self, source: str, tokenizer_json: Path, special_tokens: dict[str, str]):
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment
        from tokenizers import Tokenizer

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                              sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self._template = env.from_string(source)
        self._tokenizer = Tokenizer.from_file(str(tokenizer_json))
        self._special_tokens = special_tokens

    @classmethod
    def from_artifact(cls, root: Path) -> "ChatTemplate | None":
        """The template from ``tokenizer/chat_template.jinja`` or ``tokenizer_config.json``, or None."""
        folder = root / "tokenizer"
        config_path = folder / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        source = config.get("chat_template")
        if isinstance(source, list):  # named templates: [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
        if not source and (folder / "chat_template.jinja").is_file():
            source = (folder / "chat_template.jinja").read_text()
        if not source:
            return None
        special = {}
        for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
            value = config.get(key)
            value = value.get("content") if isinstance(value, dict) else value
            if isinstance(value, str):
                special[key] = value
        return cls(source, folder / "tokenizer.json", special)

    def render(self, messages: list[dict]) -> str:
        import jinja2

        try:
            return self._template.render(messages=messages, add_generation_prompt=True, tools=None, documents=None,
                                         **self._special_tokens)
        except jinja2.exceptions.TemplateError as exc:
            raise APIError(400, f"the model's chat template refused these messages: {exc}", "messages") from None

    def prompt_ids(self, messages: list[ChatMessage]) -> list[int]:
        if not messages:
            raise APIError(400, "messages is empty; send at least one message", "messages")
        plain = [_message_dict(m, i) for i, m in enumerate(messages)]
        ids = self._tokenizer.encode(self.render(plain), add_special_tokens=False).ids
        if not ids:
            raise APIError(400, "the rendered chat prompt is empty", "messages")
        return ids


def _message_dict(message: ChatMessage, index: int) -> dict:
    """A message for the template: content parts joined into one string (text parts only)."""
    content = message.content
    if isinstance(content, list):
        texts = []
        for part in content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise APIError(400, f"messages[{index}]: only text content parts are supported "
                                    f"(got type {part.get('type')!r})", "messages")
            texts.append(part["text"])
        content = "".join(texts)
    return {**message.model_dump(exclude_none=True), "content": content or ""}


# -- stop strings ----------------------------------------------------------------------------------------

class StopCutter:
    """Cut streamed text at the first stop string, as OpenAI clients expect: the stop string itself is
    not returned, and text that may still turn into a stop string is held back until it cannot."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""
        self.stopped = False

    def feed(self, delta: str) -> str:
        """The part of ``delta`` (plus held-back text) that is safe to send now."""
        if self.stopped:
            return ""
        self.pending += delta
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            out, self.pending = self.pending[: min(hits)], ""
            return out
        hold = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(self.pending)), hold, -1):
                if self.pending.endswith(stop[:k]):
                    hold = k
                    break
        cut = len(self.pending) - hold
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


# -- decoding in a slot ----------------------------------------------------------------------------------

@dataclass
class Outcome:
    """What one request produced: the text sent (stop strings cut), every generated token and the stats."""

    text: str
    token_ids: list[int]
    prompt_tokens: int
    finish_reason: str  # "stop" | "length" | "cancelled"
    seconds: float
    rounds: int | None
    mean_accepted: float | None
    acceptance_rate: float | None
    stop_reason: str  # the runtime's: eos | length | context | stop_string | cancelled
    drafted: int | None = None  # known when decoding ran to the end
    accepted: int | None = None

    def usage(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": len(self.token_ids),
                "total_tokens": self.prompt_tokens + len(self.token_ids)}

    def extension(self) -> dict:
        """The ``speccompile`` field of a response: round statistics, ignored by standard clients."""
        return {"mean_accepted": self.mean_accepted, "acceptance_rate": self.acceptance_rate, "rounds": self.rounds,
                "stop_reason": self.stop_reason, "token_ids": self.token_ids,
                "tokens_per_s": len(self.token_ids) / self.seconds if self.seconds > 0 else None}


def decode_in_slot(replica: SpeculativeModel, prompt_ids: list[int], options: SamplingOptions, stream_kwargs: dict,
                   emit: Callable[[str, list[int]], None] | None, cancelled: threading.Event) -> Outcome:
    """Run one request on ``replica`` (in a worker thread). ``emit(text, token_ids)`` gets each round's
    sendable text; decoding stops after the round in which a stop string appears or ``cancelled`` is set."""
    start = time.perf_counter()
    stream = replica.stream(prompt_ids, **options.stream_kwargs(), **stream_kwargs)
    cutter = StopCutter(options.stops)
    chunks = iter(stream)
    produced: list[int] = []
    raw_text, sent = "", []
    ended_by = None
    try:
        for chunk in chunks:
            produced.extend(chunk.token_ids)
            raw_text += chunk.text
            piece = cutter.feed(chunk.text)
            sent.append(piece)
            if emit is not None:
                emit(piece, list(chunk.token_ids))
            if cutter.stopped:
                ended_by = "stop_string"
                break
            if cancelled.is_set():
                ended_by = "cancelled"
                break
    finally:
        if hasattr(chunks, "close"):
            chunks.close()
    seconds = time.perf_counter() - start
    if ended_by is None:  # ran to the end: the runtime's own stats
        result = stream.result
        tail = cutter.feed(result.text[len(raw_text):]) if result.text.startswith(raw_text) else ""
        tail += cutter.flush()
        if tail:
            sent.append(tail)
            if emit is not None:
                emit(tail, [])
        s = result.stats
        finish = "stop" if cutter.stopped or s.stop_reason == "eos" else "length"
        return Outcome("".join(sent), list(result.token_ids), len(prompt_ids), finish, seconds,
                       s.rounds if s.speculative else None, s.mean_accepted, s.acceptance_rate,
                       "stop_string" if cutter.stopped else s.stop_reason,
                       drafted=s.drafted if s.speculative else None, accepted=s.accepted if s.speculative else None)
    # Stopped early (stop string, client gone): the runtime publishes its stats only when a stream runs to
    # the end, so the round statistics of this request are unknown (null), not guessed.
    return Outcome("".join(sent), produced, len(prompt_ids), "stop" if ended_by == "stop_string" else "cancelled",
                   seconds, None, None, None, ended_by)


class SlotPool:
    """N replicas handed out one request at a time, with a bounded wait queue (asyncio side).

    ``release`` must run on the event loop; worker threads call it through ``call_soon_threadsafe``."""

    def __init__(self, replicas: list[SpeculativeModel], max_queue: int):
        self.size = len(replicas)
        self.max_queue = max_queue
        self._free: asyncio.Queue | None = None
        self._replicas = replicas
        self.waiting = 0

    def _queue(self) -> asyncio.Queue:
        if self._free is None:  # created lazily, on the server's event loop
            self._free = asyncio.Queue()
            for replica in self._replicas:
                self._free.put_nowait(replica)
        return self._free

    @property
    def busy(self) -> int:
        return self.size - (self._free.qsize() if self._free is not None else self.size)

    async def acquire(self, retry_after: int) -> SpeculativeModel:
        free = self._queue()
        if not free.empty():
            return free.get_nowait()
        if self.waiting >= self.max_queue:
            raise APIError(429, f"all {self.size} slots are busy and {self.waiting} requests are queued "
                                f"(--max-queue {self.max_queue}); retry later", code="rate_limit_exceeded",
                           kind="rate_limit_error", headers={"Retry-After": str(retry_after)})
        self.waiting += 1
        try:
            return await free.get()
        finally:
            self.waiting -= 1

    def release(self, replica: SpeculativeModel) -> None:
        self._queue().put_nowait(replica)


# -- metrics ---------------------------------------------------------------------------------------------

class ServerMetrics:
    """Prometheus metrics in the app's own registry (several apps can live in one process)."""

    def __init__(self, pool: SlotPool):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("speccompile_requests", "HTTP requests answered, by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.rejected = Counter("speccompile_rejected_requests", "Requests refused with 429 (queue full)", registry=r)
        self.prompt_tokens = Counter("speccompile_prompt_tokens", "Prompt tokens of decoded requests", registry=r)
        self.completion_tokens = Counter("speccompile_completion_tokens", "Tokens generated", registry=r)
        self.decode_seconds = Counter("speccompile_decode_seconds", "Seconds slots spent decoding", registry=r)
        self.rounds = Counter("speccompile_verify_rounds", "Speculative verify rounds", registry=r)
        self.drafted = Counter("speccompile_drafted_tokens", "Tokens drafted (requests that ran to the end)",
                               registry=r)
        self.accepted = Counter("speccompile_accepted_tokens", "Drafted tokens the verifier accepted", registry=r)
        self.cancelled = Counter("speccompile_cancelled_requests", "Streams whose client went away", registry=r)
        self.last_tokens_per_s = Gauge("speccompile_tokens_per_second", "Tokens/s of the last finished request",
                                       registry=r)
        self._totals = {"rounds": 0, "round_tokens": 0.0, "drafted": 0, "accepted": 0}
        self._lock = threading.Lock()
        Gauge("speccompile_mean_accepted_tokens", "Tokens per verify round over all requests (verifier's included)",
              registry=r).set_function(lambda: self._ratio("round_tokens", "rounds"))
        Gauge("speccompile_acceptance_rate", "Accepted / drafted tokens over requests that ran to the end",
              registry=r).set_function(lambda: self._ratio("accepted", "drafted"))
        Gauge("speccompile_queue_depth", "Requests waiting for a slot", registry=r).set_function(lambda: pool.waiting)
        Gauge("speccompile_slots_busy", "Slots decoding a request", registry=r).set_function(lambda: pool.busy)
        Gauge("speccompile_slots", "Slots (concurrent sequences)", registry=r).set(pool.size)

    def _ratio(self, numerator: str, denominator: str) -> float:
        with self._lock:
            d = self._totals[denominator]
            return self._totals[numerator] / d if d else math.nan

    def record(self, outcome: Outcome) -> None:
        """Called from the worker thread when a request finishes (prometheus-client is thread-safe)."""
        self.prompt_tokens.inc(outcome.prompt_tokens)
        self.completion_tokens.inc(len(outcome.token_ids))
        self.decode_seconds.inc(outcome.seconds)
        if outcome.seconds > 0:
            self.last_tokens_per_s.set(len(outcome.token_ids) / outcome.seconds)
        if outcome.stop_reason == "cancelled":
            self.cancelled.inc()
        with self._lock:
            if outcome.rounds and outcome.mean_accepted is not None:
                self.rounds.inc(outcome.rounds)
                self._totals["rounds"] += outcome.rounds
                self._totals["round_tokens"] += outcome.rounds * outcome.mean_accepted
            if outcome.drafted is not None:
                self.drafted.inc(outcome.drafted)
                self.accepted.inc(outcome.accepted)
                self._totals["drafted"] += outcome.drafted
                self._totals["accepted"] += outcome.accepted


# -- the guard at the door: API key, body size, request counts -----------------------------------------

class RequestGuard:
    """Pure ASGI middleware (it never buffers a response, so streaming and disconnects pass through):
    401 for a wrong API key on /v1/*, 413 for a body over the limit, and per-status request counts."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int, metrics: ServerMetrics):
        self.app, self.api_key, self.max_body_bytes, self.metrics = app, api_key, max_body_bytes, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        endpoint = path if path in ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health",
                                    "/metrics") else "other"
        status_seen = {}

        async def counting_send(message):
            if message["type"] == "http.response.start":
                status_seen["status"] = message["status"]
                self.metrics.requests.labels(endpoint, str(message["status"])).inc()
            await send(message)

        if self.api_key and path.startswith("/v1/") and not self._authorized(scope):
            return await error_response(401, "invalid or missing API key; send 'Authorization: Bearer <key>'",
                                        code="invalid_api_key")(scope, receive, counting_send)
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            return await self._too_large(scope, receive, counting_send)
        if scope["method"] in ("POST", "PUT", "PATCH"):
            body, more = b"", True
            while more:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return
                body += message.get("body", b"")
                more = message.get("more_body", False)
                if len(body) > self.max_body_bytes:
                    return await self._too_large(scope, receive, counting_send)
            receive = _replay(body, receive)
        await self.app(scope, receive, counting_send)

    def _authorized(self, scope) -> bool:
        header = dict(scope.get("headers") or []).get(b"authorization", b"").decode("latin-1")
        scheme, _, token = header.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.api_key.encode())

    async def _too_large(self, scope, receive, send):
        response = error_response(413, f"the request body is over {self.max_body_bytes} bytes; send a shorter "
                                       f"prompt", code="request_too_large")
        await response(scope, receive, send)


def _replay(body: bytes, receive):
    """A receive() that returns the already-read body once, then defers to the client's (disconnects)."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


# -- the app ---------------------------------------------------------------------------------------------

@dataclass
class ServerState:
    model: SpeculativeModel
    model_name: str
    pool: SlotPool
    metrics: ServerMetrics
    executor: ThreadPoolExecutor
    chat: ChatTemplate | None
    stream_kwargs: dict
    created: int = field(default_factory=lambda: int(time.time()))
    durations: list[float] = field(default_factory=list)  # recent requests' decode seconds

    def retry_after(self) -> int:
        """Seconds a refused client should wait: about one recent request's duration, at least 1."""
        recent = self.durations[-20:]
        return max(1, min(60, math.ceil(sum(recent) / len(recent)))) if recent else 1


def create_app(artifact_or_model: str | Path | SpeculativeModel, *, slots: int = 1, max_queue: int = 16,
               plan: str | None = None, api_key: str | None = None, backend: str | None = None, device: str = "cpu",
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, model_name: str | None = None,
               speculate: bool = True) -> FastAPI:
    """An OpenAI-compatible ASGI app serving one artifact with ``slots`` concurrent sequences that share
    one copy of the weights. Pass an artifact folder (loaded with ``load``) or an already loaded model."""
    if slots < 1:
        raise InputError(f"slots must be at least 1 (got {slots})")
    if max_queue < 0:
        raise InputError(f"max_queue must be 0 or more (got {max_queue})")
    model = artifact_or_model if isinstance(artifact_or_model, SpeculativeModel) else load(
        artifact_or_model, backend=backend, device=device)
    if plan is not None:
        model.plan(plan)  # unknown plan names fail now, not on the first request
    pool = SlotPool([model] + [model.replica() for _ in range(slots - 1)], max_queue)
    metrics = ServerMetrics(pool)
    state = ServerState(model=model, model_name=model_name or model.root.resolve().name, pool=pool, metrics=metrics,
                        executor=ThreadPoolExecutor(max_workers=slots, thread_name_prefix="speccompile-slot"),
                        chat=ChatTemplate.from_artifact(model.root), stream_kwargs=dict(speculate=speculate, plan=plan))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        state.executor.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="speccompile", lifespan=lifespan)
    app.state.speccompile = state
    app.add_middleware(RequestGuard, api_key=api_key, max_body_bytes=max_body_bytes, metrics=metrics)

    @app.exception_handler(APIError)
    async def on_api_error(request, exc: APIError):
        if exc.status == 429:
            metrics.rejected.inc()
        return error_response(exc.status, exc.message, exc.param, exc.code, exc.kind, exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request, exc: StarletteHTTPException):
        return error_response(exc.status_code, f"{exc.detail}: {request.method} {request.url.path}",
                              kind="invalid_request_error" if exc.status_code < 500 else "server_error")

    @app.exception_handler(Exception)
    async def on_crash(request, exc: Exception):
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}", kind="server_error")

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": state.model_name, "slots": pool.size, "busy": pool.busy,
                "queued": pool.waiting}

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [_model_card(state)]}

    @app.get("/v1/models/{name}")
    async def get_model(name: str):
        _check_model(state, name)
        return _model_card(state)

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = await _parse(request, CompletionRequest)
        _check_model(state, req.model)
        _refuse_unsupported(req)
        ids = completion_prompt_ids(model, req.prompt)
        max_tokens = req.max_tokens
        if max_tokens is None:  # the OpenAI default, shortened to fit the context
            max_tokens = max(1, min(COMPLETIONS_DEFAULT_MAX_TOKENS, model.context - len(ids)))
        options = check_sampling(req, max_tokens, len(ids), model.context)
        return await _respond(state, req, ids, options, CompletionFormat(state.model_name))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = await _parse(request, ChatRequest)
        _check_model(state, req.model)
        _refuse_unsupported(req)
        if state.chat is None:
            raise APIError(400, f"the tokenizer of '{state.model_name}' has no chat template, so /v1/chat/completions "
                                "cannot build a prompt; use /v1/completions, or add a chat_template to the artifact's "
                                "tokenizer_config.json", "messages", code="no_chat_template")
        ids = state.chat.prompt_ids(req.messages)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        options = check_sampling(req, max_tokens, len(ids), model.context)
        return await _respond(state, req, ids, options, ChatFormat(state.model_name))

    return app


async def _parse(request: Request, schema: type[BaseModel]):
    """The JSON body as ``schema``, with 400s that name the problem (FastAPI's default is a 422 list)."""
    raw = await request.body()
    if not raw.strip():
        raise APIError(400, "the request body is empty; send a JSON object")
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(400, f"the request body is not valid JSON ({exc}); send a JSON object") from None
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, not {type(data).__name__}")
    try:
        return schema.model_validate(data)
    except ValidationError as exc:
        message, param = _validation_message(exc)
        raise APIError(400, message, param) from None


def _check_model(state: ServerState, name: str | None) -> None:
    if name is not None and name != state.model_name:
        raise APIError(404, f"model '{name}' is not served here; this server serves '{state.model_name}'",
                       "model", code="model_not_found")


def _model_card(state: ServerState) -> dict:
    return {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "speccompile"}


# -- response formats ------------------------------------------------------------------------------------

@dataclass
class CompletionFormat:
    model_name: str
    id: str = field(default_factory=lambda: "cmpl-" + secrets.token_hex(12))
    created: int = field(default_factory=lambda: int(time.time()))

    def _base(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model_name}

    def full(self, outcome: Outcome) -> dict:
        choice = {"index": 0, "text": outcome.text, "logprobs": None, "finish_reason": outcome.finish_reason}
        return {**self._base("text_completion"), "choices": [choice], "usage": outcome.usage(),
                "speccompile": outcome.extension()}

    def first_chunk(self) -> dict | None:
        return None

    def chunk(self, text: str, token_ids: list[int]) -> dict:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": None}
        return {**self._base("text_completion"), "choices": [choice], "speccompile": {"token_ids": token_ids}}

    def last_chunk(self, outcome: Outcome) -> dict:
        choice = {"index": 0, "text": "", "logprobs": None, "finish_reason": outcome.finish_reason}
        return {**self._base("text_completion"), "choices": [choice], "speccompile": outcome.extension()}

    def usage_chunk(self, outcome: Outcome) -> dict:
        return {**self._base("text_completion"), "choices": [], "usage": outcome.usage()}


@dataclass
class ChatFormat(CompletionFormat):
    id: str = field(default_factory=lambda: "chatcmpl-" + secrets.token_hex(12))

    def full(self, outcome: Outcome) -> dict:
        choice = {"index": 0, "message": {"role": "assistant", "content": outcome.text}, "logprobs": None,
                  "finish_reason": outcome.finish_reason}
        return {**self._base("chat.completion"), "choices": [choice], "usage": outcome.usage(),
                "speccompile": outcome.extension()}

    def first_chunk(self) -> dict:
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        return {**self._base("chat.completion.chunk"), "choices": [choice]}

    def chunk(self, text: str, token_ids: list[int]) -> dict:
        choice = {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": None}
        return {**self._base("chat.completion.chunk"), "choices": [choice], "speccompile": {"token_ids": token_ids}}

    def last_chunk(self, outcome: Outcome) -> dict:
        choice = {"index": 0, "delta": {}, "logprobs": None, "finish_reason": outcome.finish_reason}
        return {**self._base("chat.completion.chunk"), "choices": [choice], "speccompile": outcome.extension()}

    def usage_chunk(self, outcome: Outcome) -> dict:
        return {**self._base("chat.completion.chunk"), "choices": [], "usage": outcome.usage()}


def _sse(payload: dict | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


async def _respond(state: ServerState, req: _Request, prompt_ids: list[int], options: SamplingOptions,
                   fmt: CompletionFormat):
    """Take a slot (or 429), decode in the slot's worker thread, answer as one JSON body or as SSE."""
    loop = asyncio.get_running_loop()
    replica = await state.pool.acquire(state.retry_after())
    cancelled = threading.Event()
    events: asyncio.Queue = asyncio.Queue()

    def emit(text: str, token_ids: list[int]) -> None:
        loop.call_soon_threadsafe(events.put_nowait, ("chunk", text, token_ids))

    def job() -> Outcome:
        try:
            outcome = decode_in_slot(replica, prompt_ids, options, state.stream_kwargs, emit if req.stream else None,
                                     cancelled)
            state.durations.append(outcome.seconds)
            del state.durations[:-100]
            state.metrics.record(outcome)
            return outcome
        finally:
            with contextlib.suppress(RuntimeError):  # the loop is gone when the server shuts down
                loop.call_soon_threadsafe(state.pool.release, replica)

    try:
        future = loop.run_in_executor(state.executor, job)
    except BaseException:
        state.pool.release(replica)
        raise
    if not req.stream:
        try:
            outcome = await future
        except InputError as exc:
            raise APIError(400, str(exc)) from None
        return JSONResponse(fmt.full(outcome))

    def on_done(fut: asyncio.Future) -> None:
        events.put_nowait(("done", fut))

    future.add_done_callback(on_done)
    include_usage = bool((req.stream_options or {}).get("include_usage"))

    async def sse() -> AsyncIterator[bytes]:
        try:
            first = fmt.first_chunk()
            if first is not None:
                yield _sse(first)
            while True:
                event = await events.get()
                if event[0] == "chunk":
                    yield _sse(fmt.chunk(event[1], event[2]))
                    continue
                fut = event[1]
                if fut.exception() is not None:
                    exc = fut.exception()
                    kind = "invalid_request_error" if isinstance(exc, InputError) else "server_error"
                    yield _sse({"error": {"message": str(exc), "type": kind, "param": None, "code": None}})
                else:
                    outcome = fut.result()
                    yield _sse(fmt.last_chunk(outcome))
                    if include_usage:
                        yield _sse(fmt.usage_chunk(outcome))
                yield _sse("[DONE]")
                return
        finally:
            cancelled.set()  # a no-op when decoding already ended; otherwise the slot frees after this round

    return StreamingResponse(sse(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


# -- running it ------------------------------------------------------------------------------------------

def run_server(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> None:
    """Serve ``app`` with uvicorn until interrupted."""
    import uvicorn

    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)


@contextlib.contextmanager
def serve_in_thread(app: FastAPI, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning") -> Iterator[str]:
    """Run ``app`` with uvicorn in a background thread on ``host`` (a free port by default); yields the
    base URL (``http://127.0.0.1:PORT``) once the server accepts connections, and stops it on exit."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True, name="speccompile-serve")
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the server did not start")
        time.sleep(0.02)
    try:
        yield f"http://{host}:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
