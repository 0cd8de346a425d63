"""``speccompile serve ARTIFACT --ray``: the same OpenAI-compatible server as Ray Serve replicas.

Why this shape:
- Each replica is the very app ``speccompile serve`` runs (``create_app`` as the ``serve.ingress``), so
  the wire format, the 4xx bodies and the answers are the single-machine server's, token for token. Ray
  adds what one machine cannot: replicas placed across nodes, autoscaling on ongoing requests, restarts of
  failed replicas, one HTTP endpoint (the proxy, on the head node only).
- Ray's limits copy the server's own (``capacity``): ``max_ongoing_requests`` is the number of sequences a
  replica decodes at once, so the proxy hands a request only to a replica that can start it now and the
  rest wait at the proxy, ``max_queued_requests`` deep (the server's ``max_queue``), past which Ray answers
  429 with Retry-After: the server's contract for a full queue. Autoscaling targets the same number.
- The draft plan is the deployment's ``user_config``: changing only it makes Ray call every replica's
  ``reconfigure`` in place, so switching plans does not reload the weights. That holds for applications
  deployed from a config (the code version then comes from the config); ``deploy`` therefore applies a
  declarative config, as ``serve deploy`` does, rather than ``serve.run`` (a new random version, so new
  replicas, on every call).
- The artifact is read from the same path on every node (copied or shared, docs/ray.md); ``deploy``
  checks that path on every alive node first and names the nodes that lack it.
- The server's acceptance, token and latency figures also go to Ray's metrics (``ray.serve.metrics``:
  tagged with deployment, replica and application), which every node exports for Prometheus; counters
  and histograms, so sums over replicas and nodes are the cluster's figures.

``app`` is a Ray Serve application builder: ``serve run speccompile.server.ray_serve:app artifact=PATH``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from speccompile.runtime.errors import InputError, SpeccompileError, quote
from speccompile.server.limits import (
    DEFAULT_MAX_BATCH,
    DEFAULT_MAX_QUEUE,
    DEFAULT_PORT,
    DEFAULT_PREFILL_CHUNK,
    DEFAULT_REPLICA_CPUS,
    DEFAULT_SCALE_DOWN_AFTER_S,
    MAX_BATCH_BOUNDS,
)

DEFAULT_APP_NAME = "speccompile"
DEPLOYMENT_NAME = "speccompile"
LOOPBACK = "127.0.0.1"
REMOVAL_TIMEOUT_S = 120.0  # removing an application normally takes seconds; a second Ctrl-C stops the wait


def pin_loopback() -> None:
    """Keep a Ray cluster on one machine on 127.0.0.1 and off the network (call before Ray starts).

    Ray turns 127.0.0.1 (in an address, or as the node's IP) into the address of the machine's default
    route, so that other machines could reach it; Ray's own switch ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``
    makes it keep 127.0.0.1 instead (read when Ray is imported, so the constant is set too when it already
    is). Ray's usage statistics, which would be sent out, stay off."""
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    constants = sys.modules.get("ray._private.ray_constants")
    if constants is not None:
        constants.ENABLE_RAY_CLUSTER = False


os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

try:
    import ray
    from ray import serve
    from ray.serve.config import BackpressureConfig
except ImportError as exc:  # the CLI turns this into one line
    raise ImportError(
        f"serving on Ray needs Ray Serve ({exc.name} is missing); install it with pip install 'speccompile[ray]'",
        name=exc.name,
    ) from None

log = logging.getLogger("speccompile.server.ray")


# -- the application's arguments -------------------------------------------------------------------------


class ServeArgs(BaseModel):
    """The application builder's arguments (``serve run ...:app artifact=PATH max_batch=8 replicas=2``, or the
    ``args`` of a Serve config file). ``plan`` and ``speculate`` are only the initial ``user_config``."""

    model_config = ConfigDict(extra="forbid")

    artifact: str = Field(description="the artifact folder: an absolute path, the same on every node")
    max_batch: int = Field(
        DEFAULT_MAX_BATCH, ge=MAX_BATCH_BOUNDS[0], description="requests one replica decodes at once, in one batch"
    )
    max_queue: int = Field(DEFAULT_MAX_QUEUE, ge=0, description="requests that may wait for a replica; then 429")
    prefill_chunk: int = Field(DEFAULT_PREFILL_CHUNK, ge=1, description="prompt tokens a joiner prefills per round")
    token_budget: int | None = Field(None, ge=1, description="tokens per round in all, running rows first")
    kv_budget_bytes: int | None = Field(None, ge=1, description="a replica's KV cache budget in bytes")
    keep_prompts: int | None = Field(None, ge=0, description="prompts whose KV a replica keeps (None: max_batch)")
    plan: str | None = None
    speculate: bool = True
    api_key: str | None = None
    backend: str | None = None
    device: str = "cpu"
    model_name: str | None = None
    replicas: int | None = Field(None, ge=1)
    autoscale: str | None = Field(None, description="MIN:MAX replicas, autoscaling on ongoing requests")
    scale_down_after_s: float = Field(DEFAULT_SCALE_DOWN_AFTER_S, ge=0, allow_inf_nan=False)
    replica_cpus: float = Field(DEFAULT_REPLICA_CPUS, ge=0, allow_inf_nan=False)

    @field_validator("artifact")
    @classmethod
    def _absolute(cls, value: str) -> str:
        return str(Path(value).expanduser().absolute())

    @field_validator("autoscale")
    @classmethod
    def _min_max(cls, value: str | None) -> str | None:
        if value is not None:
            low, high = parse_autoscale(value)
            value = f"{low}:{high}"
        return value

    @model_validator(mode="after")
    def _one_scaling(self) -> ServeArgs:
        if self.replicas is not None and self.autoscale is not None:
            raise ValueError("pass replicas=N or autoscale=MIN:MAX, not both")
        return self

    @classmethod
    def parse(cls, args) -> ServeArgs:
        """``args`` (a dict, or already ServeArgs) checked, or an InputError naming the first bad key."""
        try:
            return cls.model_validate(args)
        except ValidationError as exc:
            error = exc.errors()[0]
            where = ".".join(map(str, error["loc"])) or "arguments"
            message = error["msg"].removeprefix("Value error, ")
            raise InputError(f"{where}: {message} (keys: {', '.join(cls.model_fields)})") from None

    def describe(self) -> str:
        if self.autoscale is not None:
            low, high = self.autoscale.split(":")
            return f"{low} to {high} replicas (autoscaling)"
        return f"{self.replicas or 1} replica(s)"


def parse_autoscale(text: str) -> tuple[int, int]:
    """``MIN:MAX`` -> (min, max): whole numbers, 0 <= MIN <= MAX, MAX >= 1; else an InputError."""
    match = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", str(text))
    if not match:
        raise InputError(f"--autoscale {quote(str(text))} is not MIN:MAX (two whole numbers, e.g. 1:4)")
    low, high = int(match.group(1)), int(match.group(2))
    if high < 1 or low > high:
        raise InputError(f"--autoscale {low}:{high}: need 0 <= MIN <= MAX and MAX >= 1 (e.g. 1:4)")
    return low, high


def capacity(args: ServeArgs) -> tuple[dict, int, int]:
    """The server's own limits, in the one place the Ray layer reads them: the ``create_app`` options that
    set them, the requests one replica decodes at once (Ray's ``max_ongoing_requests`` and autoscaling
    target) and the requests allowed to wait (Ray's ``max_queued_requests``)."""
    server = {"max_batch": args.max_batch, "max_queue": args.max_queue, "prefill_chunk": args.prefill_chunk}
    if args.kv_budget_bytes is not None:
        server["kv_budget_bytes"] = args.kv_budget_bytes
    if args.keep_prompts is not None:
        server["keep_prompts"] = args.keep_prompts
    if args.token_budget is not None:
        server["token_budget"] = args.token_budget
    return server, args.max_batch, args.max_queue


def user_config(plan: str | None = None, speculate: bool = True) -> dict:
    """The deployment's ``user_config``: what ``reconfigure`` switches without reloading the weights."""
    return {"plan": plan, "speculate": bool(speculate)}


def deployment_options(args: ServeArgs) -> dict:
    """The ``serve.deployment`` options of one artifact's deployment (see the module docstring)."""
    _, concurrent, waiting = capacity(args)
    options: dict = {
        "max_ongoing_requests": concurrent,
        "max_queued_requests": max(1, waiting),
        "backpressure_config": BackpressureConfig(status_code=429, retry_after_s=1),
        "ray_actor_options": {"num_cpus": args.replica_cpus, **({"num_gpus": 1} if "cuda" in args.device else {})},
        "user_config": user_config(args.plan, args.speculate),
        "health_check_period_s": 10,
        "health_check_timeout_s": 30,
        "graceful_shutdown_timeout_s": 20,
        # a stopping replica sleeps this long before it first counts its requests (Ray's default is 2 s): an
        # idle one, the usual case on Ctrl-C or a scale-down, then goes in well under a second
        "graceful_shutdown_wait_loop_s": 0.5,
    }
    if args.autoscale is None:
        options["num_replicas"] = args.replicas or 1
    else:
        low, high = parse_autoscale(args.autoscale)
        options["autoscaling_config"] = {
            "min_replicas": low,
            "initial_replicas": max(1, low),
            "max_replicas": high,
            "target_ongoing_requests": concurrent,  # a replica is full when every sequence decodes
            "upscale_delay_s": 2.0,
            "downscale_delay_s": args.scale_down_after_s,
            # the window Ray averages the load over: past its 10 s metrics interval (Ray requires it), well
            # short of its 30 s default, so an idle replica goes about scale_down_after_s + 11 s after the load
            "look_back_period_s": 11.0,
        }
    return options


# -- the artifact on every node --------------------------------------------------------------------------


def node_description() -> str:
    """This node as errors and the ``x-speccompile-node`` header name it: its IP and Ray node id's start."""
    return f"{ray.util.get_node_ip_address()} (node {ray.get_runtime_context().get_node_id()[:12]})"


def artifact_problem(path: str) -> str | None:
    """Why ``path`` is not a usable artifact on this machine, or None. Cheap: the manifest is read and each
    file it lists must be there with its size (a replica's ``load`` then checks the hashes)."""
    from speccompile.runtime import read_artifact

    root = Path(path)
    if not root.is_dir():
        return "no such folder there"
    try:
        manifest = read_artifact(root, verify=False, backends=[])
    except SpeccompileError as exc:
        return f"not a readable artifact there ({' '.join(str(exc).split())})"
    for name, record in manifest.files.items():
        file = root / name
        size = file.stat().st_size if file.is_file() else None
        if size != record.get("bytes", size):
            return f"its file {name} is missing or incomplete there (a partial copy?)"
    return None


def _probe(path: str) -> tuple[str, str | None]:
    return node_description(), artifact_problem(path)


def check_artifact_on_nodes(path: str, timeout_s: float = 120.0) -> int:
    """Check ``path`` on every alive node (a zero-CPU task pinned to each); returns how many nodes there are,
    or raises an InputError naming every node that lacks the artifact."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    probe = ray.remote(num_cpus=0, max_retries=0)(_probe)
    nodes = {
        probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)).remote(path): (
            f"{node['NodeManagerAddress']} (node {node['NodeID'][:12]})"
        )
        for node in ray.nodes()
        if node.get("Alive")
    }
    ready, late = ray.wait(list(nodes), num_returns=len(nodes), timeout=timeout_s)
    problems = []
    for ref in ready:
        try:
            where, problem = ray.get(ref)
        except ray.exceptions.RayError as exc:  # the node went away under the check
            where, problem = nodes[ref], f"the check failed there ({type(exc).__name__})"
        if problem:
            problems.append(f"node {where}: {problem}")
    for ref in late:
        problems.append(f"node {nodes[ref]}: no answer within {timeout_s:.0f}s")
        ray.cancel(ref, force=True)
    if problems:
        raise InputError(
            f"artifact {path} is not usable on every node: {'; '.join(problems)}; put it at the same path on "
            "every node (copy it, or share the folder: docs/ray.md)"
        )
    return len(nodes)


# -- the replica's figures in Ray's metrics --------------------------------------------------------------

LATENCY_BOUNDARIES = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120, 300]


class RayMetrics:
    """The server's figures as Ray metrics (every node exports them with a ``ray_`` prefix). Counters and
    histograms only, so that sums over replicas are the cluster's: acceptance = accepted / drafted,
    tokens per verify round = round_tokens / verify_rounds, tokens/s = rate(completion_tokens)."""

    def __init__(self, model_name: str):
        from ray.serve import metrics

        self.tags = {"model": model_name}

        def counter(name: str, what: str, extra: tuple = ()):
            return metrics.Counter(name, description=what, tag_keys=("model",) + extra)

        self.requests = counter("speccompile_requests", "HTTP requests answered", ("endpoint", "status"))
        self.prompt_tokens = counter("speccompile_prompt_tokens", "Prompt tokens of decoded requests")
        self.completion_tokens = counter("speccompile_completion_tokens", "Tokens generated")
        self.decode_seconds = counter("speccompile_decode_seconds", "Seconds spent decoding requests")
        self.rounds = counter("speccompile_verify_rounds", "Speculative verify rounds")
        self.round_tokens = counter("speccompile_round_tokens", "Tokens those verify rounds produced")
        self.drafted = counter("speccompile_drafted_tokens", "Tokens drafted (requests that ran to the end)")
        self.accepted = counter("speccompile_accepted_tokens", "Drafted tokens the verifier accepted")
        self.latency = metrics.Histogram(
            "speccompile_request_seconds",
            description="Request to last byte, seconds",
            boundaries=LATENCY_BOUNDARIES,
            tag_keys=("model", "endpoint"),
        )
        self._lock = threading.Lock()  # outcomes arrive from decode threads, answers from the event loop

    def record(self, outcome) -> None:
        """One finished request (the server's ``on_outcome``; called from its decode thread)."""
        with self._lock:
            self.prompt_tokens.inc(outcome.prompt_tokens, self.tags)
            if outcome.token_ids:
                self.completion_tokens.inc(len(outcome.token_ids), self.tags)
            if outcome.seconds > 0:
                self.decode_seconds.inc(outcome.seconds, self.tags)
            if outcome.rounds and outcome.mean_accepted is not None:
                self.rounds.inc(outcome.rounds, self.tags)
                self.round_tokens.inc(outcome.rounds * outcome.mean_accepted, self.tags)
            if outcome.drafted:
                self.drafted.inc(outcome.drafted, self.tags)
            if outcome.accepted:
                self.accepted.inc(outcome.accepted, self.tags)

    def answered(self, endpoint: str, status: int, seconds: float) -> None:
        with self._lock:
            self.requests.inc(1, {**self.tags, "endpoint": endpoint, "status": str(status)})
            self.latency.observe(seconds, {**self.tags, "endpoint": endpoint})


ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")


class ReplicaTagging:
    """Pure ASGI middleware: names the replica and its node in response headers (``x-speccompile-replica``,
    ``x-speccompile-node``: which replica answered, for clients and tests) and counts every answer in the
    Ray metrics. Pure ASGI, so streams pass through unbuffered."""

    def __init__(self, app, replica: str, node: str, metrics: RayMetrics):
        self.app, self.metrics = app, metrics
        self.headers = [(b"x-speccompile-replica", replica.encode()), (b"x-speccompile-node", node.encode())]

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, status = time.perf_counter(), [500]

        async def tagged_send(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                message = {**message, "headers": [*message.get("headers", []), *self.headers]}
            await send(message)

        try:
            await self.app(scope, receive, tagged_send)
        finally:
            endpoint = scope["path"] if scope["path"] in ENDPOINTS else "other"
            self.metrics.answered(endpoint, status[0], time.perf_counter() - start)


# -- the deployment --------------------------------------------------------------------------------------


@serve.deployment(name=DEPLOYMENT_NAME)
@serve.ingress()
class SpeccompileServer:
    """One replica: ``create_app`` over one load of the artifact, behind Ray's proxy."""

    def __init__(self, args: dict):
        from speccompile.server.app import create_app

        args = ServeArgs.parse(args)
        self.node = node_description()
        self.replica = serve.get_replica_context().replica_id.unique_id
        problem = artifact_problem(args.artifact)
        if problem:
            raise InputError(f"artifact {args.artifact} on node {self.node}: {problem}; see docs/ray.md")
        self.root = Path(args.artifact)
        model_name = args.model_name or self.root.name
        self.metrics = RayMetrics(model_name)
        server_options, _, _ = capacity(args)
        self.asgi = create_app(
            args.artifact,
            **server_options,
            api_key=args.api_key,
            backend=args.backend,
            device=args.device,
            model_name=model_name,
            on_outcome=self.metrics.record,
        )
        self.asgi.add_middleware(ReplicaTagging, replica=self.replica, node=self.node, metrics=self.metrics)
        self.state = self.asgi.state.speccompile

    def __serve_build_asgi_app__(self):
        return self.asgi

    def reconfigure(self, config: dict) -> None:
        """Ray calls this at start and whenever the deployment's ``user_config`` changes: switch the draft plan
        (``plan``: a name, or null for the manifest's default) or plain decoding (``speculate: false``) for
        the requests that start from now on. The weights stay loaded."""
        config = user_config(**(config or {}))
        if config["plan"] is not None:
            self.state.model.plan(config["plan"])  # an unknown name fails here, with the known ones
        self.state.scheduler.set_plan(config["plan"], config["speculate"])
        log.info("replica %s: plan %s, speculate %s", self.replica, config["plan"], config["speculate"])

    def check_health(self) -> None:
        """Ray's periodic probe: a replica whose artifact vanished from its node is replaced. It never waits
        for a free sequence, so a busy replica stays healthy."""
        if not (self.root / "manifest.json").is_file():
            raise RuntimeError(f"the artifact {self.root} vanished from node {self.node}")


def app(args: dict):
    """The application builder: ``serve run speccompile.server.ray_serve:app artifact=PATH [key=value ...]``
    (the keys: ``ServeArgs``). Connected to a cluster, it checks the artifact on every node first."""
    args = ServeArgs.parse(args)
    if ray.is_initialized():
        check_artifact_on_nodes(args.artifact)
    return SpeccompileServer.options(**deployment_options(args)).bind(args.model_dump())


# -- the driver: connect, deploy, reconfigure, watch (the CLI's `serve --ray`, tests, benchmarks) --------


def connect(address: str | None = None) -> str:
    """Connect this process to the Ray cluster at ``address``, or start a local one (``None``) on 127.0.0.1
    without a dashboard; returns what it connected to, for the log line."""
    if address is None:
        pin_loopback()
    logging.getLogger("ray.serve").setLevel(logging.WARNING)  # not its INFO lines on the CLI's terminal
    if ray.is_initialized():
        return "the Ray cluster this process is connected to"
    try:
        ray.init(
            address="local" if address is None else address,
            include_dashboard=False if address is None else None,
            logging_level=logging.WARNING,
            log_to_driver=False,  # replicas' logs stay in Ray's log folder; their errors reach us via status
        )
    except ConnectionError as exc:
        raise SpeccompileError(
            f"cannot reach the Ray cluster at {address} ({' '.join(str(exc).split())[:200]}); start it with "
            "`ray start --head` there, or check --ray ADDRESS"
        ) from None
    return "a local Ray cluster on 127.0.0.1" if address is None else f"the Ray cluster at {address}"


def start_serve(host: str = LOOPBACK, port: int = DEFAULT_PORT) -> str:
    """Start Ray Serve with its HTTP proxy on the head node only, on ``host``:``port``; returns the URL that
    proxy answers on (a running Serve keeps its own proxy and options)."""
    serve.start(proxy_location="HeadOnly", http_options={"host": host, "port": port})
    config = _client().http_config
    return f"http://{config.host}:{config.port}"


def _client():
    from ray.serve.context import _get_global_client

    return _get_global_client()


def _declarative_configs() -> dict[str, dict]:
    """The configs of the applications deployed from a config on this cluster: applying a config replaces
    all of them, so the others are passed along unchanged."""
    applications = _client().get_serve_details().get("applications", {})
    return {
        name: details["deployed_app_config"]
        for name, details in applications.items()
        if details.get("deployed_app_config") and str(details.get("source")).lower().endswith("declarative")
    }


def _apply(configs: dict[str, dict], name: str, timeout_s: float) -> None:
    from ray.serve.schema import ServeDeploySchema

    before = _status(name)
    _client().deploy_apps(ServeDeploySchema(applications=list(configs.values())))
    wait_running(name, timeout_s, before=None if before is None else before.last_deployed_time_s)


def _status(name: str):
    return serve.status().applications.get(name)


def deploy(args: ServeArgs, name: str = DEFAULT_APP_NAME, timeout_s: float = 600.0) -> None:
    """Deploy one artifact's application from a config (other config-deployed applications kept) after
    checking the artifact on every node, and wait until it is RUNNING. The same ``args`` again are a no-op."""
    check_artifact_on_nodes(args.artifact)
    configs = _declarative_configs()
    configs[name] = {
        "name": name,
        "route_prefix": "/",
        "import_path": f"{__name__}:app",
        "args": args.model_dump(exclude_defaults=True),
        "deployments": [{"name": DEPLOYMENT_NAME, "user_config": user_config(args.plan, args.speculate)}],
    }
    _apply(configs, name, timeout_s)


def reconfigure(
    plan: str | None = None, speculate: bool = True, name: str = DEFAULT_APP_NAME, timeout_s: float = 120.0
) -> None:
    """Switch the draft plan (or plain decoding) of a deployed application in place: only its deployment's
    ``user_config`` changes, so Ray calls each replica's ``reconfigure`` and restarts none."""
    configs = _declarative_configs()
    if name not in configs:
        raise InputError(f"no application {quote(name)} deployed by speccompile on this cluster")
    configs[name]["deployments"] = [{"name": DEPLOYMENT_NAME, "user_config": user_config(plan, speculate)}]
    _apply(configs, name, timeout_s)


def delete(name: str = DEFAULT_APP_NAME, timeout_s: float = REMOVAL_TIMEOUT_S) -> float:
    """Remove one application (the other config-deployed ones kept) and wait until the cluster no longer lists
    it; returns the seconds that took, or raises a SpeccompileError when it is still there after ``timeout_s``
    (already gone: returns at once)."""
    start = time.monotonic()
    request_removal(name)
    return wait_removed(name, timeout_s, start)


def request_removal(name: str = DEFAULT_APP_NAME) -> None:
    """Ask the controller to remove one application, without waiting. A config-deployed one goes by applying
    the others' configs, as ``serve deploy`` would, so that Ray's stored config drops it too; any other by a
    non-blocking ``serve.delete`` (its blocking form polls for up to 60 s and then raises, which ``wait_removed``
    does with its own bound instead)."""
    from ray.serve.schema import ServeDeploySchema

    configs = _declarative_configs()
    if configs.pop(name, None) is not None:
        _client().deploy_apps(ServeDeploySchema(applications=list(configs.values())))
    elif _status(name) is not None:
        serve.delete(name, _blocking=False)


def wait_removed(
    name: str = DEFAULT_APP_NAME, timeout_s: float = REMOVAL_TIMEOUT_S, start: float | None = None
) -> float:
    """Wait until the cluster no longer lists the application (its replicas stop on their own: idle ones at
    once, busy ones when their requests end or the controller kills them after ``graceful_shutdown_timeout_s``);
    returns the seconds since ``start`` (a ``time.monotonic()``, default now), or raises a SpeccompileError
    naming its state when it is still listed ``timeout_s`` after ``start``."""
    start = time.monotonic() if start is None else start
    while (status := _status(name)) is not None:
        if time.monotonic() - start > timeout_s:
            state = str(getattr(status.status, "value", status.status))
            raise SpeccompileError(f"still {state} after {timeout_s:.0f}s")
        time.sleep(0.2)
    return time.monotonic() - start


def removal_hint(name: str, address: str) -> str:
    """The one call that removes an application left on the cluster at ``address`` (``delete`` is idempotent:
    on an application already gone it returns at once)."""
    return (
        f'python -c "import ray; from speccompile.server import ray_serve; ray.init(address={address!r}); '
        f'ray_serve.delete({name!r})"'
    )


class LeftBehind(SpeccompileError):
    """``serve --ray`` stopped without removing its application: the one line says what is left and how to
    remove it."""


def remove_on_exit(
    name: str, address: str, announce: Callable[[str], None], cause: BaseException | None = None
) -> None:
    """``serve --ray``'s way out on a cluster it does not own: remove the application it deployed and say so in
    one line. When that fails, times out or is interrupted (a second Ctrl-C, a SIGTERM), the line names what is
    left and the call that removes it, raised as LeftBehind so that the exit status says so. When ``cause`` (why
    the command stops) is an error, that error stays the command's one line: the removal is silent, and only a
    failed one is announced first."""
    where, start, requested = f"the Ray cluster at {address}", time.monotonic(), False
    try:
        request_removal(name)
        requested = True
        seconds = wait_removed(name, REMOVAL_TIMEOUT_S, start)
    except BaseException as exc:  # a second Ctrl-C or a SIGTERM too: one line, no traceback
        if isinstance(exc, SpeccompileError):
            why = f"its removal was requested, but it is {exc}"
        elif isinstance(exc, Exception):
            why = f"the removal failed: {type(exc).__name__}: {' '.join(str(exc).split())[:120]}"
        elif requested:
            why = "its removal was requested, but the wait for it was interrupted"
        else:
            why = "interrupted before its removal was requested"
        line = f"left application {quote(name)} on {where} ({why}); remove it with: {removal_hint(name, address)}"
        if isinstance(cause, Exception):
            announce(line)
            return
        raise LeftBehind(line) from None
    if not isinstance(cause, Exception):
        announce(f"removed application {quote(name)} from {where} ({seconds:.1f}s)")


def wait_running(name: str = DEFAULT_APP_NAME, timeout_s: float = 600.0, before: float | None = None) -> None:
    """Wait at most ``timeout_s`` until the application is RUNNING (deployed again since ``before``, its
    ``last_deployed_time_s``, when given); a one-line SpeccompileError when it failed or is still not ready."""
    deadline, last = time.monotonic() + timeout_s, "not deployed yet"
    while True:
        status = _status(name)
        if status is not None and status.last_deployed_time_s != before:
            state = str(getattr(status.status, "value", status.status))
            deployment = status.deployments.get(DEPLOYMENT_NAME)
            message = " ".join(m for m in (status.message, deployment and deployment.message) if m)
            if state == "RUNNING":
                return
            if state == "DEPLOY_FAILED":
                raise SpeccompileError(f"the deployment failed: {_one_line_from_ray(message)}")
            last = f"{state}: {' '.join(str(message).split())[:300]}" if message else state
        if time.monotonic() > deadline:
            raise SpeccompileError(
                f"the deployment is not ready after {timeout_s:.0f}s ({last}); check that the cluster has the "
                "CPUs (--replica-cpus) for every replica"
            )
        time.sleep(0.5)


def _one_line_from_ray(text: str) -> str:
    """The speccompile error inside Ray's report of a failed replica or builder (a traceback), as one line."""
    found = re.findall(r"(?:InputError|ArtifactError|SpeccompileError|ArtifactOpenError): (.+)", str(text))
    if found:
        return found[-1].strip()
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    return lines[-1] if lines else "no message from Ray"


def replicas_running(name: str = DEFAULT_APP_NAME) -> int:
    """How many replicas of the application are RUNNING now (0 when it is not deployed)."""
    status = _status(name)
    deployment = None if status is None else status.deployments.get(DEPLOYMENT_NAME)
    states = {} if deployment is None else deployment.replica_states or {}
    return sum(int(n) for state, n in states.items() if str(getattr(state, "value", state)) == "RUNNING")


def serve_on_ray(
    args: ServeArgs, *, address: str | None, host: str, port: int, announce: Callable[[str], None]
) -> None:
    """The CLI's ``serve --ray``: connect (or start a local cluster), start the proxy on the head, check the
    artifact on every node, deploy, announce, then wait until interrupted. On the way out (Ctrl-C, SIGTERM, an
    error) a local cluster is stopped; on a cluster given by address the application is removed, and one line
    says that it was, or what was left and how to remove it (``remove_on_exit``)."""
    if address is None:
        from speccompile.server.app import bind_socket

        bind_socket(host, port).close()  # a taken port: the server's one-line error, before Ray starts
    deployed = False
    try:
        on_sigterm = signal.getsignal(signal.SIGTERM)
        connected = connect(address)
        if on_sigterm is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, on_sigterm)  # ray.init's handler aborts: the caller's runs the cleanup
        url = start_serve(host, port)
        nodes = check_artifact_on_nodes(args.artifact)
        deployed = True
        deploy(args)
        announce(f"serving {args.artifact} on {url}/v1 with {args.describe()} on {connected} ({nodes} node(s))")
        while True:  # short sleeps: Ray's driver threads (gRPC, its event engine) leave SIGINT unblocked, so the
            # kernel may hand a Ctrl-C to one of them; Python then raises KeyboardInterrupt in this thread only when
            # its sleep returns, which a sleep of an hour would hold back for an hour
            time.sleep(0.5)
    except BaseException as exc:
        stopped = not isinstance(exc, Exception)  # Ctrl-C or SIGTERM: the line below is the command's last word
        if address is None:
            if ray.is_initialized():
                with contextlib.suppress(BaseException):  # a second Ctrl-C too: ray.shutdown ends the replicas
                    serve.shutdown()
            ray.shutdown()
            if stopped:
                announce("stopped the local Ray cluster")
        elif deployed:
            remove_on_exit(DEFAULT_APP_NAME, address, announce, cause=exc)
        elif stopped:
            announce(f"stopped before deploying anything on the Ray cluster at {address}")
        raise


def cluster_metrics(
    prefix: str = "ray_speccompile_", replicas: set[str] | None = None, timeout_s: float = 10.0
) -> dict[str, float]:
    """The cluster's totals of the metrics named ``prefix...``: every alive node's Prometheus export summed
    over nodes, replicas and tags (requests keep their status: ``name{status="200"}``); with ``replicas``,
    only those replicas' series (a node keeps exporting the last figures of replicas that stopped)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    totals: dict[str, float] = {}
    for node in ray.nodes():
        if not node.get("Alive") or not node.get("MetricsExportPort"):
            continue
        url = f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
        try:
            text = httpx.get(url, timeout=timeout_s).text
        except httpx.HTTPError:
            continue
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if not sample.name.startswith(prefix) or math.isnan(sample.value):
                    continue
                if replicas is not None and sample.labels.get("replica") not in replicas:
                    continue
                key = sample.name + (f'{{status="{sample.labels["status"]}"}}' if "status" in sample.labels else "")
                totals[key] = totals.get(key, 0.0) + sample.value
    return totals
