"""`speccompile serve` with continuous batching: requests decode in one batch, each as it would alone.

A real uvicorn server on 127.0.0.1 and the real `openai` client: concurrent requests of different prompts,
lengths, endpoints, streamed or not, joining and leaving the batch, each answer checked against its own
batch-1 greedy output; a client that goes away, a request that fails, and the metrics of the batch."""

from __future__ import annotations

import threading

import httpx
import openai
import pytest
from helpers_reliability import copy_with_chat_template
from prometheus_client.parser import text_string_to_metric_families

from speccompile.runtime import load
from speccompile.server import create_app, serve_in_thread

PROMPTS = ["def add(a, b):", "for i in range(10):", "class Point:", "import os\nimport sys\n", "x = [1, 2, 3]"]


@pytest.fixture(scope="module")
def model(tiny_artifact, tmp_path_factory):
    return load(copy_with_chat_template(tiny_artifact, tmp_path_factory.mktemp("batching") / "tiny-chat"))


@pytest.fixture(scope="module")
def plan(model):
    return next(iter(model.manifest.plans))


@pytest.fixture(scope="module")
def server(model, plan):
    app = create_app(model, max_batch=3, max_queue=16, model_name="tiny", plan=plan, prefill_chunk=4)
    with serve_in_thread(app) as url:
        yield url, app


def expected(model, plan, prompt: str, max_tokens: int) -> list[int]:
    """The prompt's batch-1 greedy output (a replica: the server's batch is not touched)."""
    return model.replica().generate(prompt, max_new_tokens=max_tokens, plan=plan, temperature=0).token_ids


def metric(url: str, name: str, suffix: str) -> float:
    text = httpx.get(url + "/metrics").text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name + suffix:
                return sample.value
    raise KeyError(name + suffix)


def test_concurrent_requests_in_one_batch_each_answer_their_own_prompt(server, model, plan):
    url, _ = server
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    jobs = [(i, PROMPTS[i % len(PROMPTS)], 6 + 3 * (i % 4), i % 2 == 1) for i in range(10)]
    want = {(p, n): expected(model, plan, p, n) for _, p, n, _ in jobs}
    results, errors = {}, []
    rounds_before = metric(url, "speccompile_batch_size", "_count")

    def ask(i, prompt, max_tokens, stream):
        try:
            if stream:
                ids = []
                for chunk in client.completions.create(
                    model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True
                ):
                    if chunk.choices and chunk.choices[0].finish_reason is None:
                        ids += (chunk.model_extra.get("speccompile") or {}).get("token_ids", [])
                results[i] = ids
            else:
                response = client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0)
                results[i] = response.model_extra["speccompile"]["token_ids"]
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=ask, args=job) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors and len(results) == len(jobs)
    for i, prompt, max_tokens, _ in jobs:
        assert results[i] == want[prompt, max_tokens], f"request {i} ({prompt!r}) is not its own greedy output"
    rounds = metric(url, "speccompile_batch_size", "_count") - rounds_before
    sequences = metric(url, "speccompile_batch_size", "_sum")
    assert rounds > 0 and sequences > rounds, "no round decoded more than one request"
    assert metric(url, "speccompile_time_to_first_token_seconds", "_count") >= len(jobs)
    assert metric(url, "speccompile_rows_per_round", "_count") > 0
    assert httpx.get(url + "/health").json()["max_batch"] == 3


def test_a_prompt_that_begins_like_the_last_one_reuses_its_kv(server, model, plan):
    """The second of two prompts with the same first tokens copies their KV (the batch's spare prefix slot):
    OpenAI's ``usage.prompt_tokens_details.cached_tokens`` and ``/metrics`` count them, and the answer is
    still the prompt's own greedy output."""
    url, _ = server
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    shared = "# Answer with Python code only, no prose, and keep it short.\n" * 2
    first, second = shared + "def add(a, b):", shared + "class Point:"
    common = len(model.tokenizer.encode(shared))
    assert common >= 8
    before = metric(url, "speccompile_cached_prompt_tokens", "_total")
    usages = []
    for prompt in (first, second):
        response = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0)
        assert response.model_extra["speccompile"]["token_ids"] == expected(model, plan, prompt, 6)
        usages.append(response.usage)
    cached = usages[1].prompt_tokens_details.cached_tokens
    assert common - 1 <= cached < usages[1].prompt_tokens  # a token at the seam may merge differently
    assert metric(url, "speccompile_cached_prompt_tokens", "_total") - before >= cached


def test_a_client_that_goes_away_leaves_the_batch_and_the_others_finish(server, model, plan):
    url, app = server
    scheduler = app.state.speccompile.scheduler
    other = {}

    def ask_other():
        body = {"model": "tiny", "prompt": PROMPTS[1], "max_tokens": 20, "temperature": 0}
        other["ids"] = httpx.post(url + "/v1/completions", json=body, timeout=120).json()["speccompile"]["token_ids"]

    thread = threading.Thread(target=ask_other)
    thread.start()
    body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 60, "temperature": 0, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                break  # one chunk, then hang up
    thread.join(timeout=120)
    assert other["ids"] == expected(model, plan, PROMPTS[1], 20)
    for _ in range(200):  # the abandoned stream leaves within a round or two
        if scheduler.busy == 0:
            break
        threading.Event().wait(0.05)
    assert scheduler.busy == 0 and metric(url, "speccompile_cancelled_requests", "_total") >= 1


def test_a_request_that_fails_does_not_disturb_the_others(server, model, plan, monkeypatch):
    url, app = server
    decoder = app.state.speccompile.scheduler.decoder
    original = decoder.add

    def add(request, *args, **kwargs):
        if request.max_new_tokens == 7:  # this request alone cannot decode
            raise RuntimeError("injected failure for one request")
        return original(request, *args, **kwargs)

    monkeypatch.setattr(decoder, "add", add)
    answers = {}

    def ask(key, max_tokens):
        body = {"model": "tiny", "prompt": PROMPTS[2], "max_tokens": max_tokens, "temperature": 0}
        answers[key] = httpx.post(url + "/v1/completions", json=body, timeout=120)

    threads = [threading.Thread(target=ask, args=(k, n)) for k, n in (("bad", 7), ("good", 9))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert answers["bad"].status_code == 500 and "error" in answers["bad"].json()
    assert answers["good"].status_code == 200
    assert answers["good"].json()["speccompile"]["token_ids"] == expected(model, plan, PROMPTS[2], 9)
    assert httpx.get(url + "/health").json()["status"] == "ok"


def test_a_full_batch_and_queue_answer_429(model, plan):
    app = create_app(model.replica(), max_batch=1, max_queue=0, model_name="tiny", plan=plan)
    scheduler = app.state.speccompile.scheduler
    with serve_in_thread(app) as url:
        gate = threading.Event()
        original = scheduler.decoder.step

        def slow_step():
            gate.wait(30)
            return original()

        scheduler.decoder.step = slow_step
        first = threading.Thread(
            target=lambda: httpx.post(
                url + "/v1/completions", json={"model": "tiny", "prompt": "a", "max_tokens": 4}, timeout=60
            )
        )
        first.start()
        for _ in range(100):
            if scheduler.busy:
                break
            threading.Event().wait(0.02)
        refused = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "b", "max_tokens": 4})
        gate.set()
        first.join(timeout=60)
    assert refused.status_code == 429 and "Retry-After" in refused.headers
    assert "batch places are taken" in refused.json()["error"]["message"]
