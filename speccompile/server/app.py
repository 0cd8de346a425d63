"""``speccompile serve``: an OpenAI-compatible HTTP endpoint for a compiled artifact.

Why this shape:
- One copy of the weights and continuous batching (``scheduler.py``): up to ``max_batch`` requests decode
  in one batch, each round reading the weights once for all of them, with speculation sized to the load.
  The batch runs in its own thread, so the event loop keeps answering ``/health`` and ``/metrics``.
- Requests beyond the batch wait in a bounded queue; past ``max_queue`` they get 429 with Retry-After
  instead of piling up, so a load balancer can send them to another replica.
- A streaming client that disconnects sets a flag the batch checks after every round, so its place is
  free again one round later, not after the whole generation.
- Every bad request gets a 4xx with the OpenAI error body ``{"error": {"message", "type", "param",
  "code"}}``; the message names the problem and the fix, as the CLI's errors do. The wire format (request
  checks, chat template, stop strings, response bodies) lives in ``speccompile.server.openai_api``.

The app is a plain FastAPI (ASGI) object from ``create_app``, so any ASGI server or process manager can
run it; ``run_server`` runs it with uvicorn, ``serve_in_thread`` on a free loopback port (tests, benchmarks).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hmac
import logging
import math
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator, Callable, Iterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from speccompile.runtime import InputError, SpeculativeModel, load
from speccompile.runtime.errors import SpeccompileError, quote
from speccompile.server.limits import (
    DEFAULT_HOST,
    DEFAULT_MAX_BATCH,
    DEFAULT_MAX_QUEUE,
    DEFAULT_PORT,
    DEFAULT_PREFILL_CHUNK,
    check_capacity,
)
from speccompile.server.openai_api import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    APIError,
    BaseRequest,
    ChatFormat,
    ChatRequest,
    ChatTemplate,
    CompletionFormat,
    CompletionRequest,
    Outcome,
    SamplingOptions,
    check_sampling,
    completion_prompt_ids,
    error_response,
    parse_request,
    refuse_unsupported,
    sse_event,
)
from speccompile.server.scheduler import Job, QueueFull, Scheduler

DEFAULT_MAX_BODY_BYTES = 1 << 20
log = logging.getLogger("speccompile.server")


# -- metrics ---------------------------------------------------------------------------------------------


class ServerMetrics:
    """Prometheus metrics in the app's own registry (several apps can live in one process)."""

    def __init__(self, scheduler):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "speccompile_requests", "HTTP requests answered, by endpoint and status", ["endpoint", "status"], registry=r
        )
        self.rejected = Counter("speccompile_rejected_requests", "Requests refused with 429 (queue full)", registry=r)
        self.prompt_tokens = Counter("speccompile_prompt_tokens", "Prompt tokens of decoded requests", registry=r)
        self.cached_prompt_tokens = Counter(
            "speccompile_cached_prompt_tokens",
            "Prompt tokens whose KV was copied from an earlier prompt with the same first tokens, not computed",
            registry=r,
        )
        self.completion_tokens = Counter("speccompile_completion_tokens", "Tokens generated", registry=r)
        self.decode_seconds = Counter("speccompile_decode_seconds", "Seconds requests spent in the server", registry=r)
        self.rounds = Counter("speccompile_verify_rounds", "Speculative verify rounds", registry=r)
        self.drafted = Counter(
            "speccompile_drafted_tokens", "Tokens drafted (requests that ran to the end)", registry=r
        )
        self.accepted = Counter("speccompile_accepted_tokens", "Drafted tokens the verifier accepted", registry=r)
        self.cancelled = Counter("speccompile_cancelled_requests", "Streams whose client went away", registry=r)
        self.last_tokens_per_s = Gauge(
            "speccompile_tokens_per_second", "Tokens/s of the last finished request", registry=r
        )
        self.batch_size = Histogram(
            "speccompile_batch_size", "Sequences in a decode round", registry=r, buckets=(1, 2, 4, 8, 16, 32, 64)
        )
        self.rows_per_call = Histogram(
            "speccompile_rows_per_round",
            "Rows a round verified (every sequence's input token and drafted tokens)",
            registry=r,
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
        )
        self.draft_length = Histogram(
            "speccompile_draft_length",
            "Tokens drafted for one sequence in one round, as the load policy chose (0: a plain step)",
            registry=r,
            buckets=(0, 1, 2, 3, 4, 6, 8, 12, 16),
        )
        self.time_to_first_token = Histogram(
            "speccompile_time_to_first_token_seconds",
            "Seconds from a request's arrival to its first token",
            registry=r,
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32),
        )
        self._totals = {"rounds": 0, "round_tokens": 0.0, "drafted": 0, "accepted": 0}
        self._lock = threading.Lock()
        Gauge(
            "speccompile_mean_accepted_tokens",
            "Tokens per verify round over all requests (verifier's included)",
            registry=r,
        ).set_function(lambda: self._ratio("round_tokens", "rounds"))
        Gauge(
            "speccompile_acceptance_rate", "Accepted / drafted tokens over requests that ran to the end", registry=r
        ).set_function(lambda: self._ratio("accepted", "drafted"))
        Gauge("speccompile_queue_depth", "Requests waiting for a place in the batch", registry=r).set_function(
            lambda: scheduler.queued
        )
        Gauge("speccompile_slots_busy", "Requests decoding in the batch", registry=r).set_function(
            lambda: scheduler.busy
        )
        Gauge("speccompile_slots", "Most requests decoding at once (--max-batch)", registry=r).set(scheduler.max_batch)

    def observe_round(self, round_: dict) -> None:
        """Called by the batch thread after every round (prometheus-client is thread-safe)."""
        if not round_.get("sequences"):
            return
        self.batch_size.observe(round_["sequences"])
        self.rows_per_call.observe(round_["rows"])
        for drafted in round_["drafted"]:
            self.draft_length.observe(drafted)

    def _ratio(self, numerator: str, denominator: str) -> float:
        with self._lock:
            d = self._totals[denominator]
            return self._totals[numerator] / d if d else math.nan

    def record(self, outcome: Outcome) -> None:
        """Called from the batch thread when a request finishes (prometheus-client is thread-safe)."""
        self.prompt_tokens.inc(outcome.prompt_tokens)
        self.cached_prompt_tokens.inc(outcome.cached_tokens)
        self.completion_tokens.inc(len(outcome.token_ids))
        if outcome.ttft is not None:
            self.time_to_first_token.observe(outcome.ttft)
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


# -- the guard at the door: API key, body size, request counts, the last line against crashes ---------


class RequestGuard:
    """Pure ASGI middleware (it never buffers a response, so streaming and disconnects pass through):
    401 for a wrong API key on /v1/*, 413 for a body over the limit, and per-status request counts.

    It is also the catch-all: an exception no handler answered (a bug) is logged with its traceback and
    answered with a 500 OpenAI error body, and is *not* re-raised, so the server does not drop the
    connection and keeps serving every other request (Starlette's own last handler re-raises, which makes
    uvicorn close the connection)."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int, metrics: ServerMetrics):
        self.app, self.api_key, self.max_body_bytes, self.metrics = app, api_key, max_body_bytes, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        endpoint = (
            path
            if path in ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")
            else "other"
        )
        status_seen = {}

        async def counting_send(message):
            if message["type"] == "http.response.start":
                status_seen["status"] = message["status"]
                self.metrics.requests.labels(endpoint, str(message["status"])).inc()
            await send(message)

        if self.api_key and path.startswith("/v1/") and not self._authorized(scope):
            return await error_response(
                401, "invalid or missing API key; send 'Authorization: Bearer <key>'", code="invalid_api_key"
            )(scope, receive, counting_send)
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
        try:
            await self.app(scope, receive, counting_send)
        except Exception as exc:
            log.error(
                "%s %s failed: %s: %s", scope["method"], path, type(exc).__name__, quote(str(exc), 200), exc_info=exc
            )
            if "status" in status_seen:  # a stream already under way: end it (the client sees it cut short)
                with contextlib.suppress(Exception):
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                return
            await error_response(
                500,
                f"internal error ({type(exc).__name__}); the server logged it and keeps serving: please report it",
                kind="server_error",
                code="internal_error",
            )(scope, receive, counting_send)

    def _authorized(self, scope) -> bool:
        header = dict(scope.get("headers") or []).get(b"authorization", b"").decode("latin-1")
        scheme, _, token = header.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.api_key.encode())

    async def _too_large(self, scope, receive, send):
        response = error_response(
            413,
            f"the request body is over {self.max_body_bytes} bytes; send a shorter prompt",
            code="request_too_large",
        )
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
    scheduler: Scheduler
    metrics: ServerMetrics
    chat: ChatTemplate | None
    created: int = field(default_factory=lambda: int(time.time()))
    durations: list[float] = field(default_factory=list)  # recent requests' decode seconds
    on_outcome: Callable[[Outcome], None] | None = None  # also told of every finished request (Ray's metrics)

    def retry_after(self) -> int:
        """Seconds a refused client should wait: about one recent request's duration, at least 1."""
        recent = self.durations[-20:]
        return max(1, min(60, math.ceil(sum(recent) / len(recent)))) if recent else 1

    @property
    def capacity(self) -> tuple[int, int]:
        """(requests decoding at once, requests that may wait): what a front (Ray Serve's
        ``max_ongoing_requests``, a load balancer) should match so that its back-pressure and the 429 agree."""
        return self.scheduler.max_batch, self.scheduler.max_queue


def create_app(
    artifact_or_model: str | Path | SpeculativeModel,
    *,
    max_batch: int = DEFAULT_MAX_BATCH,
    max_queue: int = DEFAULT_MAX_QUEUE,
    plan: str | None = None,
    api_key: str | None = None,
    backend: str | None = None,
    device: str = "cpu",
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    model_name: str | None = None,
    speculate: bool = True,
    prefill_chunk: int | None = DEFAULT_PREFILL_CHUNK,
    kv_budget_bytes: int | None = None,
    keep_prompts: int | None = None,
    slots: int | None = None,
    on_outcome: Callable[[Outcome], None] | None = None,
    token_budget: int | None = None,
) -> FastAPI:
    """An OpenAI-compatible ASGI app serving one artifact: up to ``max_batch`` requests decode together in one
    batch (one copy of the weights, each round reading them once), ``max_queue`` more wait. Pass an artifact
    folder (loaded with ``load``) or an already loaded model. ``prefill_chunk``: prompt tokens read per round
    beside the running requests, in the round's call; ``token_budget``: tokens per round in all (running rows
    first, prompt chunks in what is left; None: no cap beyond ``prefill_chunk``); ``kv_budget_bytes``: admit fewer requests when their caches would not fit;
    ``keep_prompts``: prompts whose KV is kept for later prompts that begin alike (None: ``max_batch``; 0: none;
    each takes one more slot of cache, beyond ``kv_budget_bytes``).
    ``slots``: the earlier name of ``max_batch``. ``on_outcome`` also gets every finished request's figures
    (from the batch thread): the Ray replicas feed Ray's metrics with it."""
    if slots is not None:
        max_batch = slots
    check_capacity(max_batch, max_queue)  # before the weights load, so a bad size fails at once
    model = (
        artifact_or_model
        if isinstance(artifact_or_model, SpeculativeModel)
        else load(artifact_or_model, backend=backend, device=device)
    )
    if plan is not None:
        model.plan(plan)  # unknown plan names fail now, not on the first request
    scheduler, metrics = _start_batch(
        model,
        max_batch=max_batch,
        max_queue=max_queue,
        prefill_chunk=prefill_chunk,
        kv_budget_bytes=kv_budget_bytes,
        keep_prompts=keep_prompts,
        speculate=speculate,
        plan=plan,
        token_budget=token_budget,
    )
    state = ServerState(
        model=model,
        model_name=model_name or model.root.resolve().name,
        scheduler=scheduler,
        metrics=metrics,
        chat=ChatTemplate.from_artifact(model.root),
        on_outcome=on_outcome,
    )
    app = FastAPI(title="speccompile", lifespan=_closing(scheduler))
    app.state.speccompile = state
    app.add_middleware(RequestGuard, api_key=api_key, max_body_bytes=max_body_bytes, metrics=metrics)
    _add_error_handlers(app, metrics)
    _add_status_routes(app, state)
    _add_completion_routes(app, state)
    return app


def _start_batch(model: SpeculativeModel, **options) -> tuple[Scheduler, ServerMetrics]:
    """The scheduler (its decode thread starts here) and the metrics that watch it. Each needs the other: the
    metrics' gauges read the scheduler, and the scheduler reports every round to the metrics, through a box
    filled once they exist."""
    metrics_box: list[ServerMetrics] = []
    scheduler = Scheduler(model, **options, observe=lambda round_: metrics_box and metrics_box[0].observe_round(round_))
    metrics = ServerMetrics(scheduler)
    metrics_box.append(metrics)
    return scheduler, metrics


def _closing(scheduler: Scheduler):
    """The app's lifespan: nothing to do at startup (the batch thread already runs); at shutdown, stop it."""

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        scheduler.close()

    return lifespan


def _add_error_handlers(app: FastAPI, metrics: ServerMetrics) -> None:
    """Answer the app's own refusals (``APIError``) and Starlette's (404, 405...) with the OpenAI error body;
    what no handler answers, ``RequestGuard`` does."""

    @app.exception_handler(APIError)
    async def on_api_error(request, exc: APIError):
        if exc.status == 429:
            metrics.rejected.inc()
        return error_response(exc.status, exc.message, exc.param, exc.code, exc.kind, exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request, exc: StarletteHTTPException):
        return error_response(
            exc.status_code,
            f"{exc.detail}: {request.method} {request.url.path}",
            kind="invalid_request_error" if exc.status_code < 500 else "server_error",
        )


def _add_status_routes(app: FastAPI, state: ServerState) -> None:
    """What a load balancer, Prometheus and an OpenAI client ask before they send work: /health, /metrics,
    /v1/models. None waits for the batch."""
    scheduler = state.scheduler

    @app.get("/health")
    async def health():
        return {
            "status": "ok",
            "model": state.model_name,
            "max_batch": scheduler.max_batch,
            "slots": scheduler.max_batch,  # the earlier name, kept for health checks written against it
            "busy": scheduler.busy,
            "queued": scheduler.queued,
        }

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [_model_card(state)]}

    @app.get("/v1/models/{name}")
    async def get_model(name: str):
        _check_model(state, name)
        return _model_card(state)


def _add_completion_routes(app: FastAPI, state: ServerState) -> None:
    """/v1/completions and /v1/chat/completions: each checks its body and builds the prompt, then both queue
    the request for the batch the same way (``_respond``)."""
    model = state.model

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = parse_request(await request.body(), CompletionRequest)
        _check_model(state, req.model)
        refuse_unsupported(req)
        ids = completion_prompt_ids(model, req.prompt)
        max_tokens = req.max_tokens
        if max_tokens is None:  # the OpenAI default, shortened to fit the context
            max_tokens = max(1, min(COMPLETIONS_DEFAULT_MAX_TOKENS, model.context - len(ids)))
        options = check_sampling(req, max_tokens, len(ids), model.context)
        return await _respond(state, req, ids, options, CompletionFormat(state.model_name))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = parse_request(await request.body(), ChatRequest)
        _check_model(state, req.model)
        refuse_unsupported(req)
        if state.chat is None:
            raise APIError(
                400,
                f"the tokenizer of '{state.model_name}' has no chat template, so /v1/chat/completions "
                "cannot build a prompt; use /v1/completions, or add a chat_template to the artifact's "
                "tokenizer_config.json",
                "messages",
                code="no_chat_template",
            )
        ids = state.chat.prompt_ids(req.messages)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        options = check_sampling(req, max_tokens, len(ids), model.context)
        return await _respond(state, req, ids, options, ChatFormat(state.model_name))


def _check_model(state: ServerState, name: str | None) -> None:
    if name is not None and name != state.model_name:
        raise APIError(
            404,
            f"model {quote(name)} is not served here; this server serves '{state.model_name}'",
            "model",
            code="model_not_found",
        )


def _model_card(state: ServerState) -> dict:
    return {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "speccompile"}


async def _respond(
    state: ServerState, req: BaseRequest, prompt_ids: list[int], options: SamplingOptions, fmt: CompletionFormat
):
    """Queue the request for the batch (or 429), answer as one JSON body or as SSE."""
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()
    future: asyncio.Future = loop.create_future()

    def emit(text: str, token_ids: list[int]) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is gone when the server shuts down
            loop.call_soon_threadsafe(events.put_nowait, ("chunk", text, token_ids))

    def finish(result: object) -> None:  # from the batch thread, once
        if isinstance(result, Outcome):
            state.durations.append(result.seconds)
            del state.durations[:-100]
            state.metrics.record(result)
            if state.on_outcome is not None:
                state.on_outcome(result)

        def settle() -> None:
            if future.done():
                return
            if isinstance(result, BaseException):
                future.set_exception(result)
            else:
                future.set_result(result)

        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(settle)

    job = Job(prompt_ids, options, emit if req.stream else None, finish)
    try:
        state.scheduler.submit(job)
    except QueueFull as exc:
        raise APIError(
            429,
            str(exc),
            code="rate_limit_exceeded",
            kind="rate_limit_error",
            headers={"Retry-After": str(state.retry_after())},
        ) from None
    cancelled = job.cancelled
    if not req.stream:
        try:
            outcome = await future
        except InputError as exc:
            raise APIError(400, str(exc)) from None
        except asyncio.CancelledError:  # the client went away before the answer
            cancelled.set()
            raise
        return JSONResponse(fmt.full(outcome))

    def on_done(fut: asyncio.Future) -> None:
        events.put_nowait(("done", fut))

    future.add_done_callback(on_done)
    include_usage = bool((req.stream_options or {}).get("include_usage"))

    async def sse() -> AsyncIterator[bytes]:
        try:
            first = fmt.first_chunk()
            if first is not None:
                yield sse_event(first)
            while True:
                event = await events.get()
                if event[0] == "chunk":
                    yield sse_event(fmt.chunk(event[1], event[2]))
                    continue
                fut = event[1]
                if fut.exception() is not None:
                    exc = fut.exception()
                    kind = "invalid_request_error" if isinstance(exc, InputError) else "server_error"
                    yield sse_event({"error": {"message": str(exc), "type": kind, "param": None, "code": None}})
                else:
                    outcome = fut.result()
                    yield sse_event(fmt.last_chunk(outcome))
                    if include_usage:
                        yield sse_event(fmt.usage_chunk(outcome))
                yield sse_event("[DONE]")
                return
        finally:
            cancelled.set()  # a no-op when decoding already ended; otherwise the slot frees after this round

    return StreamingResponse(
        sse(), media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )


# -- running it ------------------------------------------------------------------------------------------


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host``:``port`` (not yet listening), or an InputError naming the problem and
    the fix: a host that is not an address of this machine, a port already taken or reserved."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except (socket.gaierror, UnicodeError, OverflowError, ValueError) as exc:
        raise InputError(
            f"cannot listen on --host {quote(host)} ({getattr(exc, 'strerror', None) or exc}); use an "
            "address of this machine, e.g. 127.0.0.1 or 0.0.0.0"
        ) from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as exc:
        sock.close()
        hints = {
            errno.EADDRINUSE: f"port {port} on {host} is already in use; stop the other server or pick another --port",
            errno.EACCES: f"port {port} needs privileges on this system; use a port above 1023",
            errno.EADDRNOTAVAIL: f"--host {quote(host)} is not an address of this machine; use 127.0.0.1, 0.0.0.0 "
            "or one of its interfaces' addresses",
        }
        raise InputError(hints.get(exc.errno, f"cannot listen on {host}:{port} ({exc.strerror})")) from None
    return sock


def run_server(
    app: FastAPI,
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_PORT,
    log_level: str = "info",
    announce: Callable[[str], None] | None = None,
) -> None:
    """Serve ``app`` with uvicorn until interrupted. The socket is bound first, so a taken port or a bad
    host is an InputError (the CLI's one ``error:`` line) before ``announce(url)`` says it is serving."""
    import uvicorn

    sock = bind_socket(host, port)
    try:
        server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=5))
        if announce is not None:
            announce(f"http://{host}:{sock.getsockname()[1]}")
        server.run(sockets=[sock])
    finally:
        sock.close()
    if not server.started:
        raise SpeccompileError(
            "the server stopped while starting (see the log above); check the artifact and the "
            "options, then run `speccompile serve` again"
        )


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
