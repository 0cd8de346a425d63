"""`speccompile serve --ray`: the server as Ray Serve replicas on a real two-node Ray cluster on 127.0.0.1.

One cluster for the module: head and worker, one CPU each, node IPs pinned to loopback, no dashboard, Serve's
HTTP proxy on the head only. Each replica takes one CPU, so two replicas land on the two nodes. Answers are
compared with the artifact's own plain greedy output token for token. The tests run in file order: the
autoscaling CLI first, then two fixed replicas, the worker node removed last. Every wait is bounded, and the
cluster is torn down whatever happens.
"""

from __future__ import annotations

import ipaddress
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

# Before Ray is imported: no usage statistics, and 127.0.0.1 stays 127.0.0.1 (ray_serve.pin_loopback).
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

ray = pytest.importorskip("ray")
pytest.importorskip("ray.serve")

import httpx  # noqa: E402
import openai  # noqa: E402
import psutil  # noqa: E402
from cli_helpers import assert_one_line_error, invoke  # noqa: E402
from helpers_reliability import copy_with_chat_template  # noqa: E402
from ray import serve  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from speccompile.runtime import load  # noqa: E402
from speccompile.runtime.errors import InputError, SpeccompileError  # noqa: E402
from speccompile.server import ray_serve as rs  # noqa: E402

PROMPTS = ["def add(a, b):", "for i in range(10):", "class Point:", "import os\nimport sys\n"]
MESSAGES = [
    [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def add(a, b):"}],
    [{"role": "user", "content": "Sort a list."}],
]
MAX_TOKENS = 16
LOOPBACK = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((LOOPBACK, 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def chat_artifact(tiny_artifact, tmp_path_factory):
    return copy_with_chat_template(tiny_artifact, tmp_path_factory.mktemp("ray") / "tiny-chat")


@pytest.fixture(scope="module")
def model(chat_artifact):
    return load(chat_artifact)


@pytest.fixture(scope="module")
def plan(model):
    """The artifact's plan by name: the tiny model's plans are slower than plain decoding, so it may have
    no default plan, and drafting must really run."""
    return next(iter(model.manifest.plans))


@pytest.fixture(scope="module")
def cluster():
    """Head + worker on 127.0.0.1, one CPU each, Serve's proxy on the head: (cluster, proxy URL)."""
    rs.pin_loopback()
    head = {"num_cpus": 1, "node_ip_address": LOOPBACK, "include_dashboard": False}
    head["_system_config"] = {"metrics_report_interval_ms": 1000}
    made = Cluster(initialize_head=True, connect=True, head_node_args=head)
    try:
        made.add_node(num_cpus=1, node_ip_address=LOOPBACK)
        made.wait_for_nodes(timeout=60)
        yield made, rs.start_serve(LOOPBACK, free_port())
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            made.shutdown()


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=cluster[1] + "/v1", api_key="unused", max_retries=0, timeout=90)


def alive_nodes() -> set[str]:
    return {node["NodeID"][:12] for node in ray.nodes() if node["Alive"]}


def deploy_two(artifact, plan):
    """Two fixed replicas, one sequence each (the same arguments again leave them running)."""
    rs.deploy(rs.ServeArgs(artifact=str(artifact), max_batch=1, max_queue=8, model_name="tiny", replicas=2, plan=plan))


def plain_greedy(model, prompt_or_ids, max_tokens=MAX_TOKENS):
    return model.replica().generate(prompt_or_ids, max_new_tokens=max_tokens, temperature=0, speculate=False)


def chat_prompt_ids(artifact, messages) -> list[int]:
    """The chat prompt rendered by transformers, independently of the server's own template code."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(artifact / "tokenizer").apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True
    )
    return ids["input_ids"] if isinstance(ids, dict) else ids


def ask(client, kind: str, payload, stream: bool, max_tokens: int = MAX_TOKENS, started=None) -> dict:
    """One greedy request through the openai client: its token ids and text, the replica and node that
    answered (response headers) and the speccompile extension of its last body. ``started(where)`` is
    called once the headers are in (a stream's body still to come)."""
    create = client.completions if kind == "completion" else client.chat.completions
    field = {"prompt": payload} if kind == "completion" else {"messages": payload}
    raw = create.with_raw_response.create(model="tiny", max_tokens=max_tokens, temperature=0, stream=stream, **field)
    where = {"replica": raw.headers["x-speccompile-replica"], "node": raw.headers["x-speccompile-node"]}
    where["node"] = where["node"].split("(node ")[1].rstrip(")")
    if started is not None:
        started(where)
    response = raw.parse()
    if not stream:
        choice = response.choices[0]
        text = choice.text if kind == "completion" else choice.message.content
        extension = response.model_extra["speccompile"]
        return {"ids": extension["token_ids"], "text": text, "extension": extension, **where}
    text, ids, extension = "", [], None
    for chunk in response:
        choice = chunk.choices[0]
        text += (choice.text if kind == "completion" else choice.delta.content) or ""
        extension = chunk.model_extra.get("speccompile") or {}
        ids += extension.get("token_ids", []) if choice.finish_reason is None else []
    return {"ids": ids, "text": text, "extension": extension, **where}


def wait_for(condition, timeout: float, what: str, every: float = 0.5):
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(every)
    return value


# -- the CLI ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options, words",
    [
        (["--ray", "--replicas", "2", "--autoscale", "1:2"], ["not both"]),
        (["--ray", "--autoscale", "2:1"], ["MIN <= MAX"]),
        (["--ray", "--autoscale", "one:two"], ["not MIN:MAX"]),
        (["--replicas", "2"], ["need --ray"]),
    ],
)
def test_cli_bad_ray_options_are_one_line_errors(chat_artifact, options, words):
    assert_one_line_error(invoke("serve", chat_artifact, *options), *words, exit_code=2)


def test_ray_limits_copy_the_servers_own_capacity(tmp_path):
    """A replica takes only what it can decode at once; the rest wait at the proxy up to the server's queue
    length, then get the server's 429; autoscaling targets the same number."""
    fixed = rs.deployment_options(rs.ServeArgs(artifact=str(tmp_path), max_batch=3, max_queue=5, replicas=2))
    assert (fixed["max_ongoing_requests"], fixed["max_queued_requests"], fixed["num_replicas"]) == (3, 5, 2)
    assert fixed["backpressure_config"].status_code == 429 and fixed["backpressure_config"].retry_after_s
    scaled = rs.deployment_options(rs.ServeArgs(artifact=str(tmp_path), max_batch=2, autoscale="1:4"))
    assert "num_replicas" not in scaled and scaled["autoscaling_config"]["target_ongoing_requests"] == 2
    assert (scaled["autoscaling_config"]["min_replicas"], scaled["autoscaling_config"]["max_replicas"]) == (1, 4)


@pytest.mark.parametrize(
    "args, words",
    [
        ({"replicas": 2, "autoscale": "1:2"}, ["not both"]),
        ({"max_batch": 0}, ["max_batch", "greater than or equal to 1"]),
        ({"autoscale": "4:1"}, ["autoscale", "MIN <= MAX"]),
        ({"replica": 2}, ["replica", "keys: artifact"]),
    ],
)
def test_builder_arguments_are_checked_with_one_line_errors(tmp_path, args, words):
    with pytest.raises(InputError) as error:
        rs.app({"artifact": str(tmp_path), **args})
    assert len(str(error.value).splitlines()) == 1
    for word in words:
        assert word in str(error.value), error.value


def test_cli_names_every_node_that_lacks_the_artifact(cluster, tmp_path):
    missing = tmp_path / "not-copied-here"
    result = invoke("serve", missing, "--ray", cluster[0].address, "--port", cluster[1].rsplit(":", 1)[1])
    assert result.exit_code == 1, result.output
    # (this process is the cluster's driver too, so Ray's own log lines reach its stderr: only one error line)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and str(missing) in errors[0] and "no such folder there" in errors[0], result.stderr
    for node in alive_nodes():
        assert node in errors[0], errors[0]
    assert rs.DEFAULT_APP_NAME not in serve.status().applications  # nothing half-deployed


TGKILL = {"x86_64": 234, "aarch64": 131}  # the tgkill system call's number
AS_FROM_A_TERMINAL = (
    "import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "sys.argv = ['speccompile', *sys.argv[1:]]; runpy.run_module('speccompile.cli', run_name='__main__')"
)
"""The CLI as a user at a terminal starts it, Ctrl-C at its default: a process inherits an ignored SIGINT from a
launcher that ignores it (a background job of a non-interactive shell, nohup), and this test may run under one."""


def other_threads_taking(pid: int, signum: int) -> list[int]:
    """The process's threads, the main one aside, that do not block ``signum`` (a signal sent to a thread that
    blocks it stays pending there, never delivered)."""
    found = []
    for name in os.listdir(f"/proc/{pid}/task"):
        try:
            status = open(f"/proc/{pid}/task/{name}/status").read()
        except FileNotFoundError:  # the thread ended meanwhile
            continue
        blocked = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigBlk:")), 16)
        if int(name) != pid and not blocked & (1 << (signum - 1)):
            found.append(int(name))
    return found


def signal_masks(pid: int) -> str:
    """The main thread's blocked, ignored and caught signal masks of process ``pid`` (``/proc``), for messages."""
    status = open(f"/proc/{pid}/status").read().splitlines()
    return " ".join(line.replace("\t", "") for line in status if line.startswith(("SigBlk", "SigIgn", "SigCgt")))


def ctrl_c_through_another_thread(process: subprocess.Popen) -> None:
    """SIGINT delivered to one of the process's threads other than the main one, as the kernel may deliver a Ctrl-C
    in a process whose other threads leave it unblocked (a Ray driver's gRPC threads): the worst case for the CLI,
    whose main thread must still notice it promptly. A plain SIGINT where tgkill's number is not known here."""
    import ctypes

    number = TGKILL.get(os.uname().machine)
    threads = other_threads_taking(process.pid, signal.SIGINT)
    if number is None or not threads:
        process.send_signal(signal.SIGINT)
        return
    if ctypes.CDLL(None, use_errno=True).syscall(number, process.pid, threads[-1], signal.SIGINT) != 0:
        process.send_signal(signal.SIGINT)  # that thread ended meanwhile


def test_cli_autoscale_rises_under_a_burst_and_falls_back_when_idle(cluster, chat_artifact, model):
    """`speccompile serve ART --ray ADDRESS --autoscale 1:2`, a real process joining the cluster."""
    made, url = cluster
    command = [sys.executable, "-c", AS_FROM_A_TERMINAL, "serve", str(chat_artifact), "--ray", made.address]
    command += [
        "--autoscale",
        "1:2",
        "--scale-down-after",
        "2",
        "--max-batch",
        "1",
        "--max-queue",
        "8",
        "--port",
        url.rsplit(":", 1)[1],
    ]
    # faulthandler: a CLI that does not exit is made to print every thread's stack (SIGABRT) before it is killed
    env = {**os.environ, "PYTHONFAULTHANDLER": "1"}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(process.stdout.readline, "")), daemon=True)
    reader.start()
    try:
        wait_for(lambda: any("serving" in s for s in lines) or process.poll() is not None, 120, "the CLI to serve")
        assert process.poll() is None, "".join(lines)
        announced = next(s for s in lines if "serving" in s)
        assert "1 to 2 replicas (autoscaling)" in announced and url in announced, announced
        assert rs.replicas_running() == 1
        reference = plain_greedy(model, PROMPTS[0], 48)
        stop, answers = threading.Event(), []
        body = {"model": chat_artifact.name, "prompt": PROMPTS[0], "max_tokens": 48, "temperature": 0}

        def burst():
            while not stop.is_set():
                answers.append(httpx.post(url + "/v1/completions", json=body, timeout=90))

        with ThreadPoolExecutor(4) as pool:
            workers = [pool.submit(burst) for _ in range(4)]
            try:
                wait_for(lambda: rs.replicas_running() >= 2, 90, "a second replica under the burst")
            finally:
                stop.set()
            for worker in workers:
                worker.result(timeout=120)  # no request hung, none failed at the transport
        assert {a.status_code for a in answers} <= {200, 429}, {a.status_code for a in answers}
        served = [a.json()["speccompile"]["token_ids"] for a in answers if a.status_code == 200]
        assert served and all(ids == reference.token_ids for ids in served)
        wait_for(lambda: rs.replicas_running() == 1, 60, "the deployment to fall back to 1 replica when idle")
    finally:
        masks = signal_masks(process.pid)  # for the message below, should the CLI not exit
        ctrl_c_through_another_thread(process)  # a user's Ctrl-C: the CLI removes its application, then exits
        try:
            process.wait(timeout=300)  # only a safety net: the CLI bounds its own wait for the removal
        except subprocess.TimeoutExpired:
            process.send_signal(signal.SIGABRT)  # its threads' stacks, through faulthandler
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
            reader.join(timeout=10)
            raise AssertionError(
                f"the CLI still runs 300s after Ctrl-C (its signal masks: {masks}; this process's: "
                f"{signal_masks(os.getpid())}): {''.join(lines)[-6000:]}"
            ) from None
    reader.join(timeout=30)
    output = "".join(lines)
    assert process.returncode == 130 and "Traceback" not in output, output
    removed = f"removed application '{rs.DEFAULT_APP_NAME}' from the Ray cluster at {made.address} ("
    assert sum(line.startswith(removed) for line in lines) == 1, output
    assert rs.DEFAULT_APP_NAME not in serve.status().applications  # gone when the CLI said so, not later


def test_a_removal_that_does_not_finish_names_what_is_left_and_how_to_remove_it(monkeypatch):
    """Ctrl-C again while ``serve --ray ADDRESS`` removes its application (or a removal past its bound, or one
    that fails) ends in one line naming the application and the call that removes it; after an error, that
    error stays the command's own line."""
    hint = "ray.init(address='127.0.0.1:6379'); ray_serve.delete('speccompile')"
    for fails, words in [
        (KeyboardInterrupt(), ["its removal was requested, but the wait for it was interrupted"]),
        (SpeccompileError("still DELETING after 120s"), ["it is still DELETING after 120s"]),
        (ConnectionError("the head went away"), ["the removal failed: ConnectionError: the head went away"]),
    ]:

        def wait_removed(*args, fails=fails):
            raise fails

        monkeypatch.setattr(rs, "request_removal", lambda name: None)
        monkeypatch.setattr(rs, "wait_removed", wait_removed)
        said: list[str] = []
        with pytest.raises(rs.LeftBehind) as left:
            rs.remove_on_exit("speccompile", "127.0.0.1:6379", said.append, cause=KeyboardInterrupt())
        line = str(left.value)
        assert not said and len(line.splitlines()) == 1 and hint in line, line
        assert line.startswith("left application 'speccompile' on the Ray cluster at 127.0.0.1:6379"), line
        for word in words:
            assert word in line, line
        rs.remove_on_exit("speccompile", "127.0.0.1:6379", said.append, cause=InputError("the deployment failed"))
        assert len(said) == 1 and hint in said[0], said

    monkeypatch.setattr(rs, "wait_removed", lambda *args: 1.5)
    said = []
    rs.remove_on_exit("speccompile", "127.0.0.1:6379", said.append, cause=KeyboardInterrupt())
    assert said == ["removed application 'speccompile' from the Ray cluster at 127.0.0.1:6379 (1.5s)"]
    rs.remove_on_exit("speccompile", "127.0.0.1:6379", said.append, cause=InputError("the deployment failed"))
    assert len(said) == 1  # the error is the one line


# -- two replicas on two nodes ----------------------------------------------------------------------------


def test_two_replicas_on_two_nodes_answer_like_plain_greedy(cluster, client, chat_artifact, model, plan):
    deploy_two(chat_artifact, plan)
    cases = [("completion", p, s) for p in PROMPTS for s in (False, True)]
    cases += [("chat", m, s) for m in MESSAGES for s in (False, True)]
    with ThreadPoolExecutor(4) as pool:  # concurrent, so the proxy spreads them over both replicas
        answers = list(pool.map(lambda case: (case, ask(client, *case)), cases * 2))
    for (kind, payload, stream), answer in answers:
        expected = plain_greedy(model, payload if kind == "completion" else chat_prompt_ids(chat_artifact, payload))
        assert (answer["ids"], answer["text"]) == (expected.token_ids, expected.text), (kind, payload, stream)
    assert {a["node"] for _, a in answers} == alive_nodes() and len(alive_nodes()) == 2  # one replica per node
    assert len({a["replica"] for _, a in answers}) == 2
    assert any(a["extension"].get("rounds") for _, a in answers)  # the draft plan really ran

    # Ray's metrics of both nodes add up to what these two replicas served.
    tokens, replicas = sum(len(a["ids"]) for _, a in answers), {a["replica"] for _, a in answers}
    totals = wait_for(
        lambda: (
            (t := rs.cluster_metrics(replicas=replicas)).get("ray_speccompile_completion_tokens_total", 0) >= tokens
            and t
        ),
        30,
        "Ray's metrics to count every generated token",
    )
    assert totals["ray_speccompile_completion_tokens_total"] == tokens
    assert totals['ray_speccompile_requests_total{status="200"}'] >= len(answers)
    assert 0 < totals["ray_speccompile_accepted_tokens_total"] <= totals["ray_speccompile_drafted_tokens_total"]
    assert totals["ray_speccompile_verify_rounds_total"] > 0
    assert totals["ray_speccompile_request_seconds_count"] >= len(answers)


def test_no_connection_leaves_loopback(cluster):
    """Every socket of the test process and the cluster's processes (raylets, GCS, agents, workers, the
    replicas) is on 127.0.0.1 at both ends; listening sockets on every interface are allowed."""
    processes = [psutil.Process()] + psutil.Process().children(recursive=True)
    outside = []
    for process in processes:
        try:
            connections = process.net_connections(kind="inet")
        except psutil.NoSuchProcess:  # a worker that ended meanwhile
            continue
        for conn in connections:
            listening = conn.status == psutil.CONN_LISTEN and conn.laddr.ip in ("0.0.0.0", "::")
            ends = [ipaddress.ip_address(a.ip) for a in (conn.laddr, conn.raddr) if a]
            if not listening and not all((getattr(ip, "ipv4_mapped", None) or ip).is_loopback for ip in ends):
                outside.append((process.name(), conn))
    assert len(processes) > 5 and not outside, outside


def test_reconfigure_switches_the_plan_without_restarting_replicas(cluster, client, chat_artifact, model, plan):
    deploy_two(chat_artifact, plan)
    expected = plain_greedy(model, PROMPTS[1])

    def answers():
        with ThreadPoolExecutor(4) as pool:
            return list(pool.map(lambda _: ask(client, "completion", PROMPTS[1], False), range(8)))

    replicas = {a["replica"] for a in answers()}
    try:
        rs.reconfigure(plan=None, speculate=False)
        plain = answers()
        assert all(a["extension"]["rounds"] is None and a["ids"] == expected.token_ids for a in plain)
        assert {a["replica"] for a in plain} <= replicas  # the same replicas: the weights were not reloaded
    finally:
        rs.reconfigure(plan=plan, speculate=True)
    drafted = answers()
    assert all(a["extension"]["rounds"] and a["ids"] == expected.token_ids for a in drafted)
    assert {a["replica"] for a in drafted} <= replicas and rs.replicas_running() == 2


# -- fault: the worker node goes away mid-run (last: it leaves one node) ----------------------------------


def test_worker_node_removed_mid_run(cluster, client, chat_artifact, model, plan):
    """Streams and plain requests run on both replicas; the worker node is killed while one of its streams
    is under way. Every request ends within its timeout, whole and right or with a clean error (an error
    status or a cut connection the client sees), and the requests after it succeed on the head's replica."""
    made, _ = cluster
    deploy_two(chat_artifact, plan)
    head = ray.get_runtime_context().get_node_id()[:12]
    expected = plain_greedy(model, PROMPTS[2], 200)
    worker_streaming, removed = threading.Event(), threading.Event()
    outcomes: list[tuple[str, float]] = []

    def on_worker(where):
        if where["node"] != head:
            worker_streaming.set()

    def client_loop(stream: bool):
        while not removed.is_set():
            start = time.monotonic()
            try:
                answer = ask(client, "completion", PROMPTS[2], stream, max_tokens=200, started=on_worker)
                outcome = "done" if answer["ids"] == expected.token_ids else "wrong or cut short silently"
            except (openai.APIError, httpx.HTTPError) as exc:
                outcome = type(exc).__name__
            outcomes.append((outcome, time.monotonic() - start))

    with ThreadPoolExecutor(4) as pool:
        loops = [pool.submit(client_loop, stream) for stream in (True, True, True, False)]
        try:
            assert worker_streaming.wait(60), "no stream reached the worker's replica"
            made.remove_node(next(iter(made.worker_nodes)), allow_graceful=False)
        finally:
            removed.set()
        for loop in loops:
            loop.result(timeout=120)  # nothing hangs past the client's timeout
    assert all(seconds < 95 for _, seconds in outcomes), outcomes
    assert all(kind != "wrong or cut short silently" for kind, _ in outcomes), outcomes

    wait_for(lambda: alive_nodes() == {head}, 60, "Ray to see the worker node gone")
    later = [ask(client, "completion", PROMPTS[3], stream=i % 2 == 1) for i in range(4)]
    assert all(a["ids"] == plain_greedy(model, PROMPTS[3]).token_ids and a["node"] == head for a in later)
