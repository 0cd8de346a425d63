"""Issue 27: `speccompile serve` against hostile request bodies (shape, size, encoding, numbers), a handler
bug, and tiny temperatures. Every hostile body gets a 4xx with an OpenAI error body on one line, over one
keep-alive connection that the server never drops: after each, a well-formed request on the same
connection is served. A real uvicorn server on 127.0.0.1, the tiny real artifact."""

from __future__ import annotations

import http.client
import json
import threading
import warnings

import httpx
import openai
import pytest
from helpers_reliability import copy_with_chat_template

import speccompile.server.app as serve_module
from speccompile.server import create_app, serve_in_thread


def deep(depth: int, inner: str = "1") -> str:
    return "[" * depth + inner + "]" * depth


def body(**fields) -> bytes:
    return json.dumps(fields).encode()


C, CHAT = "/v1/completions", "/v1/chat/completions"
USER = {"role": "user", "content": "hi"}

# (name, path, raw body, expected status, words the message must contain)
HOSTILE = [
    # -- shape -----------------------------------------------------------------------------------------------------
    ("deep-prompt", C, f'{{"prompt": {deep(5000)}}}'.encode(), 400, ["nested"]),
    ("deep-unclosed", C, b'{"prompt": ' + b"[" * 100000, 400, []),
    ("deep-top-level", C, deep(3000).encode(), 400, []),
    (
        "deep-stream-options",
        C,
        b'{"prompt": "x", "stream_options": ' + b'{"a": ' * 40 + b"1" + b"}" * 40 + b"}",
        400,
        ["stream_options", "nested"],
    ),
    (
        "deep-content-part",
        CHAT,
        body(messages=[{"role": "user", "content": [{"type": "text", "text": "x", "meta": json.loads(deep(30))}]}]),
        400,
        ["messages[0]", "nested"],
    ),
    ("deep-message-extra", CHAT, body(messages=[{**USER, "name": json.loads(deep(40))}]), 400, ["nested"]),
    ("top-level-string", C, b'"prompt"', 400, ["JSON object"]),
    ("top-level-number", C, b"42", 400, ["JSON object"]),
    ("top-level-null", C, b"null", 400, ["JSON object"]),
    ("empty-object", C, b"{}", 400, ["missing", "prompt"]),
    (
        "wide-object",
        C,
        json.dumps({"prompt": "x", **{f"k{i}": i for i in range(20000)}}).encode(),
        400,
        ["unrecognized"],
    ),
    ("prompt-object", C, body(prompt={"a": 1}), 400, ["prompt"]),
    ("prompt-null", C, body(prompt=None), 400, ["prompt"]),
    ("prompt-long-ids", C, body(prompt=[5] * 100000), 400, ["context"]),
    ("prompt-batch", C, body(prompt=[[1, 2], [3]]), 400, ["batched"]),
    ("prompt-empty-batch", C, body(prompt=[[]]), 400, ["empty"]),
    ("prompt-empty-list", C, body(prompt=[]), 400, ["empty"]),
    ("prompt-bools", C, body(prompt=[True, False]), 400, ["prompt"]),
    ("prompt-floats", C, body(prompt=[1.5]), 400, ["prompt"]),
    ("prompt-negative-id", C, body(prompt=[-1]), 400, ["token ids"]),
    ("prompt-huge-id", C, body(prompt=[2**64]), 400, ["token ids"]),
    ("messages-string", CHAT, body(messages="hi"), 400, ["messages"]),
    ("messages-bad-role", CHAT, body(messages=[{"role": "hacker", "content": "x"}]), 400, ["role"]),
    ("messages-no-role", CHAT, body(messages=[{"content": "x"}]), 400, ["role"]),
    ("messages-content-object", CHAT, body(messages=[{"role": "user", "content": {"a": 1}}]), 400, ["content"]),
    (
        "messages-part-text-number",
        CHAT,
        body(messages=[{"role": "user", "content": [{"type": "text", "text": 5}]}]),
        400,
        ["text"],
    ),
    ("messages-parts-numbers", CHAT, body(messages=[{"role": "user", "content": [1, 2]}]), 400, ["content"]),
    ("messages-thousands", CHAT, body(messages=[USER] * 5000), 400, ["context"]),
    ("stop-number", C, body(prompt="x", stop=[1]), 400, ["stop"]),
    ("stop-object", C, body(prompt="x", stop={"a": 1}), 400, ["stop"]),
    ("stream-options-string", C, body(prompt="x", stream_options="yes"), 400, ["stream_options"]),
    ("logit-bias-string", C, body(prompt="x", logit_bias={"1": "x"}), 400, ["logit_bias"]),
    # -- encoding: valid JSON, not text the tokenizer can take --------------------------------------------------------
    ("surrogate-prompt", C, b'{"prompt": "\\ud800", "max_tokens": 2}', 400, ["prompt", "surrogate"]),
    ("surrogate-inside-prompt", C, b'{"prompt": "ok\\udfffok"}', 400, ["prompt", "surrogate"]),
    ("surrogate-prompt-batch", C, b'{"prompt": ["\\ud800"]}', 400, ["prompt[0]", "surrogate"]),
    ("surrogate-model", C, b'{"prompt": "x", "model": "\\ud800"}', 400, ["model", "surrogate"]),
    ("surrogate-key", C, b'{"prompt": "x", "\\ud800": 1}', 400, ["surrogate"]),
    ("surrogate-stop", C, b'{"prompt": "x", "stop": ["\\ud800"]}', 400, ["stop[0]", "surrogate"]),
    ("surrogate-user", C, b'{"prompt": "x", "user": "\\udc00"}', 400, ["user", "surrogate"]),
    (
        "surrogate-chat",
        CHAT,
        b'{"messages": [{"role": "user", "content": "\\udc00"}]}',
        400,
        ["messages[0]['content']", "surrogate"],
    ),
    (
        "surrogate-half-emoji",
        CHAT,
        b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud83d"}]}]}',
        400,
        ["surrogate"],
    ),
    ("invalid-utf8", C, b'{"prompt": "\xff\xfe"}', 400, ["JSON"]),
    ("overlong-utf8", C, b'{"prompt": "\xc0\xaf"}', 400, ["JSON"]),
    ("nul-after-body", C, b'{"prompt": "x"}\x00', 400, ["JSON"]),
    ("truncated", C, b'{"prompt": "x"', 400, ["JSON"]),
    ("single-quotes", C, b"{'prompt': 'x'}", 400, ["JSON"]),
    ("trailing-comma", C, b'{"prompt": "x",}', 400, ["JSON"]),
    ("comment", C, b'{"prompt": "x" /* hi */}', 400, ["JSON"]),
    ("empty-body", C, b"", 400, ["empty"]),
    ("whitespace-body", C, b" \n\t ", 400, ["empty"]),
    # -- numbers ----------------------------------------------------------------------------------------------------
    ("nan-temperature", C, b'{"prompt": "x", "temperature": NaN}', 400, ["NaN"]),
    ("infinity-top-p", C, b'{"prompt": "x", "top_p": Infinity}', 400, ["Infinity"]),
    ("minus-infinity", C, b'{"prompt": "x", "temperature": -Infinity}', 400, ["Infinity"]),
    ("max-tokens-5000-digits", C, b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", 400, ["digits"]),
    ("max-tokens-overflowing-float", C, b'{"prompt": "x", "max_tokens": 1e400}', 400, ["max_tokens"]),
    ("temperature-overflowing-float", C, b'{"prompt": "x", "temperature": 1e400}', 400, ["temperature"]),
    ("seed-2-64", C, body(prompt="x", seed=2**64), 400, ["seed"]),
    ("seed-4000-digits", C, body(prompt="x", seed=10**4000), 400, ["seed", "integer"]),
    ("top-k-negative", C, body(prompt="x", top_k=-1), 400, ["top_k"]),
    ("top-k-float", C, body(prompt="x", top_k=1.5), 400, ["top_k"]),
    ("n-huge", C, body(prompt="x", n=10**30), 400, ["'n'"]),
    ("max-tokens-bool", C, body(prompt="x", max_tokens=True), 400, ["max_tokens"]),
    # -- size ------------------------------------------------------------------------------------------------------
    ("long-key", C, json.dumps({"prompt": "x", "k" * 300: 1}).encode(), 400, ["key of 300 characters"]),
    ("long-model-name", C, body(prompt="x", model="m" * 500000), 404, ["500000 characters"]),
    ("long-unknown-field", C, json.dumps({"prompt": "x", "f" * 200: 1}).encode(), 400, ["unrecognized"]),
    ("body-over-limit", C, body(prompt="x" * (2 << 20)), 413, ["bytes"]),
]
CLOSES = {"body-over-limit"}  # refused before the body is read: the server may close this connection


@pytest.fixture(scope="module")
def chat_artifact(tiny_artifact, tmp_path_factory):
    return copy_with_chat_template(tiny_artifact, tmp_path_factory.mktemp("hostile") / "tiny-chat")


@pytest.fixture(scope="module")
def server(chat_artifact):
    with serve_in_thread(create_app(chat_artifact, slots=2, max_queue=8, model_name="tiny")) as url:
        yield url


@pytest.fixture
def connection(server):
    """A keep-alive connection per case (so one case's failure does not fail the next): the hostile body and
    then a well-formed request go over it, and a dropped connection would show."""
    conn = http.client.HTTPConnection(server.removeprefix("http://"), timeout=60)
    yield conn
    conn.close()


def post(conn: http.client.HTTPConnection, path: str, raw: bytes) -> tuple[http.client.HTTPResponse, bytes]:
    conn.request("POST", path, body=raw, headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    return response, response.read()


WELL_FORMED = body(model="tiny", prompt="def add(a, b):", max_tokens=2, temperature=0)


def test_the_set_is_large_enough():
    assert len(HOSTILE) >= 50 and len({name for name, *_ in HOSTILE}) == len(HOSTILE)


@pytest.mark.parametrize("name,path,raw,status,words", HOSTILE, ids=[case[0] for case in HOSTILE])
def test_hostile_body_gets_a_4xx_and_the_connection_keeps_serving(connection, name, path, raw, status, words):
    response, data = post(connection, path, raw)
    assert response.status == status, data[:300]
    error = json.loads(data)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert "\n" not in error["message"] and len(error["message"]) <= 600, error["message"][:300]
    for word in words:
        assert word in error["message"], error["message"]
    if name in CLOSES:
        connection.close()  # the next request opens a fresh one
    else:  # the hostile request did not cost the connection
        assert not response.will_close, f"{name}: the server closed the connection"
    sock = connection.sock
    response, data = post(connection, C, WELL_FORMED)
    assert response.status == 200, data[:300]
    assert json.loads(data)["usage"]["completion_tokens"] >= 1
    assert sock is None or connection.sock is sock  # served on the same connection, not a new one


def test_after_every_hostile_body_the_server_is_healthy(server):
    health = httpx.get(server + "/health").json()
    assert health["status"] == "ok" and health["busy"] == 0 and health["queued"] == 0
    text = httpx.get(server + "/metrics").text
    assert 'status="500"' not in text  # not one of them reached the catch-all


def test_a_handler_bug_is_a_logged_500_and_other_requests_are_served(server, connection, monkeypatch, caplog):
    """A bug in a handler (here: prompt handling raising ZeroDivisionError for one prompt) answers that request
    with a 500 OpenAI error body, logs the traceback, and drops neither the connection nor the requests around it."""
    original = serve_module.completion_prompt_ids

    def buggy(model, prompt):
        if prompt == "boom":
            raise ZeroDivisionError("a handler bug")
        return original(model, prompt)

    monkeypatch.setattr(serve_module, "completion_prompt_ids", buggy)
    client = openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=60)
    streamed = {}
    streaming = threading.Thread(
        target=lambda: streamed.setdefault(
            "text",
            "".join(
                chunk.choices[0].text
                for chunk in client.completions.create(
                    model="tiny", prompt="for i in range(10):", max_tokens=24, temperature=0, stream=True
                )
                if chunk.choices
            ),
        )
    )
    streaming.start()
    with caplog.at_level("ERROR", logger="speccompile.server"):
        for _ in range(3):
            response, data = post(connection, C, body(prompt="boom", max_tokens=2))
            assert response.status == 500 and not response.will_close
            error = json.loads(data)["error"]
            assert error["type"] == "server_error" and "ZeroDivisionError" in error["message"]
            response, data = post(connection, C, WELL_FORMED)
            assert response.status == 200
    streaming.join(timeout=60)
    assert streamed.get("text"), "the concurrent stream was not served"
    assert any("ZeroDivisionError" in record.getMessage() and record.exc_info for record in caplog.records)
    assert httpx.get(server + "/health").json()["status"] == "ok"


@pytest.mark.parametrize("temperature", [1e-5, 1e-40, 1e-300, 5e-324])
def test_a_tiny_temperature_decodes_like_greedy_without_overflow(server, temperature):
    """A positive temperature too small for logits / T to fit a float: the softmax is taken after shifting
    by the maximum, so it is a one-hot on the argmax (greedy), with no overflow warning and no nan."""
    client = openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=60)
    greedy = client.completions.create(model="tiny", prompt="class Point:", max_tokens=12, temperature=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the server runs in this process: an overflow warning would raise
        tiny = client.completions.create(
            model="tiny", prompt="class Point:", max_tokens=12, temperature=temperature, seed=3
        )
    assert tiny.model_extra["speccompile"]["token_ids"] == greedy.model_extra["speccompile"]["token_ids"]
