"""`speccompile serve`: a real uvicorn server on 127.0.0.1, spoken to with the real `openai` client.

Outputs are compared with the runtime (`speccompile generate --json`, `model.generate`) token for token;
every bad input must get its 4xx with an OpenAI error body while the server keeps serving.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
from click.testing import CliRunner
from helpers_reliability import copy_with_chat_template
from prometheus_client.parser import text_string_to_metric_families

from speccompile.cli import main
from speccompile.runtime import load
from speccompile.server import create_app, serve_in_thread
from speccompile.server.openai_api import StopCutter

PROMPTS = ["def add(a, b):", "for i in range(10):", "class Point:", "import os\nimport sys\n"]
API_KEY = "test-key-123"


@pytest.fixture(scope="module")
def chat_artifact(tiny_artifact, tmp_path_factory):
    """The tiny artifact with a chat template in tokenizer_config.json (and its manifest hash updated)."""
    return copy_with_chat_template(tiny_artifact, tmp_path_factory.mktemp("serve") / "tiny-chat")


@pytest.fixture(scope="module")
def model(chat_artifact):
    return load(chat_artifact)


@pytest.fixture(scope="module")
def plan(model):
    """Drafting is exercised with the artifact's plan by name: the tiny model's plan is slower than plain
    decoding, so the manifest may name no default plan."""
    return next(iter(model.manifest.plans))


@pytest.fixture(scope="module")
def server(model, plan):
    """Two slots, room for eight waiting requests."""
    with serve_in_thread(create_app(model, slots=2, max_queue=8, model_name="tiny", plan=plan)) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=60)


def reference(model, prompt, **kwargs):
    """The runtime's own answer with the served plan, on a replica so the server's slots are not touched."""
    return model.replica().generate(prompt, plan=next(iter(model.manifest.plans)), **kwargs)


def cli_generate(artifact, plan, prompt, *args) -> dict:
    result = CliRunner().invoke(main, ["generate", str(artifact), "--prompt", prompt, "--json", "--plan", plan, *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.output.strip().splitlines()[-1])


def extension(response) -> dict:
    return response.model_extra["speccompile"]


def streamed(chunks, field="text"):
    """Concatenated text, token ids and final chunk of an openai stream."""
    text, ids, last = "", [], None
    for chunk in chunks:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        text += (choice.text if field == "text" else choice.delta.content) or ""
        ids += (chunk.model_extra.get("speccompile") or {}).get("token_ids", []) if choice.finish_reason is None else []
        last = chunk
    return text, ids, last


def test_completion_greedy_equals_generate_token_for_token(client, chat_artifact, plan):
    for prompt in PROMPTS[:2]:
        expected = cli_generate(chat_artifact, plan, prompt, "--max-new-tokens", "24")
        response = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0)
        assert extension(response)["token_ids"] == expected["token_ids"]
        assert response.choices[0].text == expected["text"]
        assert response.choices[0].finish_reason == ("stop" if expected["stop_reason"] == "eos" else "length")
        assert response.usage.completion_tokens == len(expected["token_ids"])
        assert expected["mean_accepted"] is not None  # the draft plan really ran
        assert extension(response)["mean_accepted"] == pytest.approx(expected["mean_accepted"])
        assert extension(response)["acceptance_rate"] == pytest.approx(expected["acceptance_rate"])

        text, ids, last = streamed(
            client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0, stream=True)
        )
        assert ids == expected["token_ids"] and text == expected["text"]
        assert last.choices[0].finish_reason == response.choices[0].finish_reason


def test_sampled_with_seed_equals_generate_with_that_seed(client, chat_artifact, plan):
    expected = cli_generate(
        chat_artifact,
        plan,
        PROMPTS[2],
        "--max-new-tokens",
        "24",
        "--temperature",
        "0.9",
        "--top-p",
        "0.95",
        "--seed",
        "7",
    )
    kwargs = dict(model="tiny", prompt=PROMPTS[2], max_tokens=24, temperature=0.9, top_p=0.95, seed=7)
    response = client.completions.create(**kwargs)
    assert extension(response)["token_ids"] == expected["token_ids"]
    text, ids, _ = streamed(client.completions.create(**kwargs, stream=True))
    assert ids == expected["token_ids"] and text == expected["text"]
    other = client.completions.create(**{**kwargs, "seed": 8})
    assert extension(other)["token_ids"] != expected["token_ids"]  # the seed is really used


def test_chat_uses_the_tokenizers_template(client, model, chat_artifact):
    from transformers import AutoTokenizer

    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def add(a, b):"}]
    ids = AutoTokenizer.from_pretrained(chat_artifact / "tokenizer").apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True
    )
    ids = ids["input_ids"] if isinstance(ids, dict) else ids
    expected = reference(model, ids, max_new_tokens=20, temperature=0)
    response = client.chat.completions.create(model="tiny", messages=messages, max_tokens=20, temperature=0)
    assert extension(response)["token_ids"] == expected.token_ids
    assert response.choices[0].message.content == expected.text
    assert response.usage.prompt_tokens == len(ids)
    text, token_ids, last = streamed(
        client.chat.completions.create(
            model="tiny",
            messages=messages,
            max_completion_tokens=20,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        ),
        field="delta",
    )
    assert token_ids == expected.token_ids and text == expected.text
    assert last.choices[0].finish_reason in ("stop", "length")


def test_stop_strings_cut_where_the_client_expects(client, model):
    full = reference(model, PROMPTS[0], max_new_tokens=40, temperature=0).text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert stop.strip(), f"pick another slice of {full!r}"
    expected = full[: full.index(stop)]
    response = client.completions.create(
        model="tiny", prompt=PROMPTS[0], max_tokens=40, temperature=0, stop=[stop, "never-produced"]
    )
    assert response.choices[0].text == expected and response.choices[0].finish_reason == "stop"
    text, _, last = streamed(
        client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=40, temperature=0, stop=stop, stream=True)
    )
    assert text == expected and last.choices[0].finish_reason == "stop"


def test_stop_cutter_holds_back_a_possible_stop_string():
    cutter = StopCutter(["END", "xy"])
    assert cutter.feed("abc E") == "abc "  # "E" may start "END"
    assert cutter.feed("N") == ""
    assert cutter.feed("Dzzz") == "" and cutter.stopped
    cutter = StopCutter(["END"])
    assert cutter.feed("abEN") == "ab" and cutter.feed("x") == "ENx" and cutter.flush() == ""


def test_concurrent_requests_are_not_mixed(server, model):
    """Eight requests on two slots at once: each answer is its own prompt's."""
    expected = {p: reference(model, p, max_new_tokens=16, temperature=0).token_ids for p in PROMPTS}
    results, errors = {}, []

    def ask(i, prompt):
        try:
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 16, "temperature": 0}
            results[i] = (prompt, httpx.post(server + "/v1/completions", json=body, timeout=60).json())
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=ask, args=(i, PROMPTS[i % 4])) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(results) == 8
    for prompt, body in results.values():
        assert body["speccompile"]["token_ids"] == expected[prompt]


def test_models_and_health(client, server):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    health = httpx.get(server + "/health").json()
    assert health["status"] == "ok" and health["slots"] == 2


BAD_INPUTS = [
    # (endpoint, raw body, status, words the message must contain)
    ("completions", b"{not json", 400, ["not valid JSON"]),
    ("completions", b"[1, 2]", 400, ["JSON object"]),
    ("completions", b"", 400, ["empty"]),
    ("completions", {"prompt": "x", "temperature": "hot"}, 400, ["temperature"]),
    ("completions", {"prompt": "x", "max_tokens": "many"}, 400, ["max_tokens"]),
    ("completions", {"prompt": "x", "max_tokens": "5"}, 400, ["max_tokens"]),
    ("completions", {"prompt": "x", "stream": "yes"}, 400, ["stream"]),
    ("completions", {"prompt": "x", "stop": ["a"] * 9}, 400, ["stop"]),
    ("completions", {"prompt": "x", "frobnicate": 1}, 400, ["unrecognized", "frobnicate"]),
    ("completions", {"max_tokens": 4}, 400, ["missing", "prompt"]),
    ("chat/completions", {"max_tokens": 4}, 400, ["missing", "messages"]),
    ("chat/completions", {"messages": []}, 400, ["messages is empty"]),
    ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, ["text"]),
    ("completions", {"prompt": ""}, 400, ["prompt is empty"]),
    ("completions", {"prompt": "   "}, 400, ["prompt is empty"]),
    ("completions", {"prompt": ["a", "b"]}, 400, ["batched"]),
    ("completions", {"prompt": [5, 99999]}, 400, ["token ids"]),
    ("completions", {"prompt": "def f():", "max_tokens": 255}, 400, ["255", "256", "context"]),
    ("completions", {"prompt": [5] * 300}, 400, ["300", "256", "context"]),
    ("completions", {"prompt": "x", "n": 2}, 400, ["'n' is not supported"]),
    ("completions", {"prompt": "x", "logprobs": 2}, 400, ["'logprobs' is not supported"]),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True}, 400, ["logprobs"]),
    ("completions", {"prompt": "x", "max_tokens": -5}, 400, ["max_tokens", "-5"]),
    ("completions", {"prompt": "x", "max_tokens": 0}, 400, ["max_tokens"]),
    ("completions", {"prompt": "x", "max_tokens": 10**12}, 400, ["max_tokens", str(10**12)]),
    ("completions", {"prompt": "x", "temperature": -0.1}, 400, ["temperature", "-0.1"]),
    ("completions", {"prompt": "x", "top_p": 0}, 400, ["top_p"]),
    ("completions", {"prompt": "x", "top_p": 1.5}, 400, ["top_p"]),
    ("completions", {"prompt": "x", "seed": -1}, 400, ["seed"]),
    ("completions", {"prompt": "x", "model": "gpt-4"}, 404, ["gpt-4", "tiny"]),
    ("completions", {"prompt": "x" * (2 << 20)}, 413, ["bytes"]),
]


@pytest.mark.parametrize(
    "endpoint,body,status,words", BAD_INPUTS, ids=[f"{i}-{e}-{s}" for i, (e, _, s, _) in enumerate(BAD_INPUTS)]
)
def test_bad_input_gets_a_4xx_with_an_openai_error(server, endpoint, body, status, words):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(
        f"{server}/v1/{endpoint}", content=raw, headers={"content-type": "application/json"}, timeout=30
    )
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and "\n" not in error["message"]
    for word in words:
        assert word in error["message"], error["message"]


def test_the_openai_client_raises_on_a_bad_request(client):
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model="tiny", prompt="x", temperature=-1)


def test_after_bad_inputs_the_server_still_serves(server, client):
    assert httpx.get(server + "/health").json()["status"] == "ok"
    response = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=8, temperature=0)
    assert response.usage.completion_tokens >= 1


def metric_values(url) -> dict:
    text = httpx.get(url + "/metrics").text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_metrics_count_requests_tokens_and_rejections(server, client):
    client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=8, temperature=0)
    values = metric_values(server)
    ok = values[("speccompile_requests_total", (("endpoint", "/v1/completions"), ("status", "200")))]
    bad = values[("speccompile_requests_total", (("endpoint", "/v1/completions"), ("status", "400")))]
    assert ok >= 1 and bad >= 1
    assert values[("speccompile_completion_tokens_total", ())] >= 8
    assert values[("speccompile_mean_accepted_tokens", ())] >= 1.0
    assert 0.0 <= values[("speccompile_acceptance_rate", ())] <= 1.0
    assert values[("speccompile_queue_depth", ())] == 0
    assert values[("speccompile_rejected_requests_total", ())] == 0
    assert values[("speccompile_tokens_per_second", ())] > 0


@pytest.fixture(scope="module")
def one_slot_server(model, plan):
    """One slot, one place in the queue, an API key: for disconnects, 429 and 401."""
    app = create_app(model.replica(), slots=1, max_queue=1, api_key=API_KEY, model_name="tiny", plan=plan)
    with serve_in_thread(app) as url:
        yield url


def auth(key=API_KEY) -> dict:
    return {"Authorization": f"Bearer {key}"}


def wait_for(url, predicate, seconds=10.0) -> dict:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        health = httpx.get(url + "/health").json()
        if predicate(health):
            return health
        time.sleep(0.01)
    raise AssertionError(f"/health never reached the expected state: {health}")


LONG = {"model": "tiny", "prompt": "def add(a, b):", "max_tokens": 240, "temperature": 0, "stream": True}


def test_wrong_or_missing_api_key_gets_401(one_slot_server):
    for headers in ({}, auth("wrong"), {"Authorization": API_KEY}):
        response = httpx.post(one_slot_server + "/v1/completions", json={"prompt": "x"}, headers=headers)
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(one_slot_server + "/v1/models").status_code == 401
    assert httpx.get(one_slot_server + "/health").status_code == 200  # probes need no key
    client = openai.OpenAI(base_url=one_slot_server + "/v1", api_key=API_KEY, max_retries=0)
    assert client.completions.create(model="tiny", prompt="x", max_tokens=2).usage.completion_tokens >= 1
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=one_slot_server + "/v1", api_key="nope", max_retries=0).models.list()


def test_disconnect_mid_stream_frees_the_slot(one_slot_server):
    before = metric_values(one_slot_server)
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", one_slot_server + "/v1/completions", json=LONG, headers=auth()) as response:
            assert response.status_code == 200
            lines = response.iter_lines()  # kept: dropping the iterator closes the connection
            assert next(lines).startswith("data: ")
            assert httpx.get(one_slot_server + "/health").json()["busy"] == 1
        # leaving the block hangs up mid-stream
    wait_for(one_slot_server, lambda h: h["busy"] == 0)
    after = metric_values(one_slot_server)
    assert (
        after[("speccompile_cancelled_requests_total", ())] == before[("speccompile_cancelled_requests_total", ())] + 1
    )
    generated = after[("speccompile_completion_tokens_total", ())] - before[("speccompile_completion_tokens_total", ())]
    assert generated < LONG["max_tokens"]  # stopped early, not decoded to the end
    response = httpx.post(one_slot_server + "/v1/completions", json={"prompt": "x", "max_tokens": 4}, headers=auth())
    assert response.status_code == 200


def test_past_max_queue_gets_429_with_retry_after(one_slot_server):
    client = openai.OpenAI(base_url=one_slot_server + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
    queued = {}
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", one_slot_server + "/v1/completions", json=LONG, headers=auth()) as busy:
            lines = busy.iter_lines()
            assert next(lines).startswith("data: ")  # the slot is taken
            waiter = threading.Thread(
                target=lambda: queued.setdefault(
                    "response", client.completions.create(model="tiny", prompt="x", max_tokens=4, temperature=0)
                )
            )
            waiter.start()
            wait_for(one_slot_server, lambda h: h["queued"] == 1)
            with pytest.raises(openai.RateLimitError) as refused:
                client.completions.create(model="tiny", prompt="x", max_tokens=4)
            assert int(refused.value.response.headers["Retry-After"]) >= 1
            assert refused.value.response.json()["error"]["type"] == "rate_limit_error"
    waiter.join(timeout=30)
    assert queued["response"].usage.completion_tokens >= 1  # the queued request was served, not lost
    assert metric_values(one_slot_server)[("speccompile_rejected_requests_total", ())] == 1


def test_chat_without_template_is_a_clear_400(tiny_artifact):
    with serve_in_thread(create_app(tiny_artifact, slots=1)) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="no chat template"):
            client.chat.completions.create(model=tiny_artifact.name, messages=[{"role": "user", "content": "hi"}])
        assert client.completions.create(model=tiny_artifact.name, prompt="x", max_tokens=2).choices


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_cli_serve_answers_and_refuses_a_bad_plan(chat_artifact):
    result = CliRunner().invoke(main, ["serve", str(chat_artifact), "--plan", "no-such-plan"])
    assert result.exit_code == 1 and result.output.startswith("error: ") and "no-such-plan" in result.output
    port = free_port()
    env = {**os.environ, "SPECCOMPILE_API_KEY": API_KEY}
    process = subprocess.Popen(
        [sys.executable, "-m", "speccompile.cli", "serve", str(chat_artifact), "--port", str(port), "--slots", "2"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                health = httpx.get(url + "/health").json()
                break
            except httpx.TransportError:
                assert process.poll() is None and time.monotonic() < deadline, process.stdout.read().decode()
                time.sleep(0.2)
        assert health["slots"] == 2
        client = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0)
        response = client.completions.create(model="tiny-chat", prompt=PROMPTS[0], max_tokens=6, temperature=0)
        assert response.usage.completion_tokens >= 1
    finally:
        process.terminate()
        process.wait(timeout=20)


@pytest.fixture
def taken_port():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        yield holder.getsockname()[1]


@pytest.mark.parametrize("case", ["port-taken", "host-not-here", "host-unknown", "no-artifact"])
def test_cli_serve_startup_errors_are_one_line_before_serving(chat_artifact, taken_port, tmp_path, case):
    """Issue 27: a start-up failure is the CLI's one ``error:`` line and exit 1, and nothing claimed to be
    serving first (the socket is bound before the "serving" line; uvicorn's own log never runs)."""
    artifact, options = str(chat_artifact), ["--port", str(taken_port)]
    words = {
        "port-taken": [str(taken_port), "already in use", "--port"],
        "host-not-here": ["10.255.255.1", "--host"],
        "host-unknown": ["no-such-host.invalid", "--host"],
        "no-artifact": ["does not exist"],
    }[case]
    if case == "host-not-here":
        options = ["--host", "10.255.255.1", "--port", "0"]
    elif case == "host-unknown":
        options = ["--host", "no-such-host.invalid", "--port", "0"]
    elif case == "no-artifact":
        artifact = str(tmp_path / "missing")
    result = CliRunner().invoke(main, ["serve", artifact, *options])
    lines = result.output.strip().splitlines()
    assert result.exit_code == 1 and len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert all(word in lines[0] for word in words), lines[0]
    assert "serving" not in result.output and "Traceback" not in result.output
