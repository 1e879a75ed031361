"""The OpenAI-compatible front end (tools/serve_openai.py), with the official `openai`
client, against the real server: the shared `model_repo_server` (the whole default
ensemble), with the front end attached to it in its own process (uvicorn)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest

from tests.ensemble_client import metric, run_one, scrape_metrics, wait_for
from tools.server_launcher import free_port

pytestmark = pytest.mark.server

REPO_ROOT = Path(__file__).resolve().parent.parent
QUESTION = "What is the capital of France?"
ANSWER = "The capital of France is Paris."
STORY = "Once upon a time"


class Frontend:
    """tools/serve_openai.py attached to a running Triton, on a free port."""

    def __init__(self, triton_grpc: str, *extra: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process = subprocess.Popen(
            [sys.executable, "tools/serve_openai.py", "--triton-grpc", triton_grpc, "--port", str(self.port),
             "--log-level", "warning", *extra],
            cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        deadline = time.monotonic() + 120
        while not self.healthy():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"the front end did not start:\n{self.process.stdout.read()}", pytrace=False)
            time.sleep(0.3)

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def client(self) -> openai.OpenAI:
        # No retries: a 503 must reach the test, not be retried away.
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=120)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@pytest.fixture(scope="module")
def frontend(model_repo_server):
    server = Frontend(model_repo_server.grpc_url)
    yield server
    server.stop()


def post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST")
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def chat(question: str = QUESTION) -> list[dict]:
    return [{"role": "user", "content": question}]


def test_models_and_health(frontend):
    client = frontend.client()
    assert [model.id for model in client.models.list()] == ["ensemble"]
    assert client.models.retrieve("ensemble").id == "ensemble"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    with urllib.request.urlopen(f"{frontend.url}/health") as response:
        assert json.loads(response.read()) == {"status": "ok"}


def test_streamed_chat_equals_the_ensembles_greedy_text(frontend, model_repo_server):
    expected = run_one(model_repo_server.grpc_url, {"messages": chat(), "max_tokens": 32, "stream": True})
    client = frontend.client()
    stream = client.chat.completions.create(
        model="ensemble", messages=chat(), max_tokens=32, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert "".join(pieces) == expected.text == ANSWER
    assert len(pieces) == 7  # one chunk per token
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
    usage = chunks[-1].usage
    assert chunks[-1].choices == []
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (37, 7, 44)
    assert all(c.usage is None for c in chunks[:-1])

    # Not streamed: the same text in one answer; max_completion_tokens is max_tokens' newer name.
    answer = client.chat.completions.create(model="ensemble", messages=chat(), max_completion_tokens=32,
                                            temperature=0)
    assert answer.choices[0].message.content == ANSWER
    assert answer.choices[0].finish_reason == "stop"
    assert answer.usage.completion_tokens == 7


def test_streamed_completion_equals_the_ensembles_greedy_text(frontend, model_repo_server):
    expected = run_one(model_repo_server.grpc_url, {"text_input": STORY, "max_tokens": 24, "stream": True})
    client = frontend.client()
    chunks = list(client.completions.create(model="ensemble", prompt=STORY, max_tokens=24, temperature=0,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == expected.finish_reason == "length"
    whole = client.completions.create(model="ensemble", prompt=STORY, max_tokens=24, temperature=0)
    assert whole.choices[0].text == expected.text
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (4, 24)


def test_stop_seed_and_logprobs_take_effect(frontend):
    client = frontend.client()
    stopped = client.chat.completions.create(model="ensemble", messages=chat(), temperature=0, stop=["Paris"])
    assert stopped.choices[0].message.content == "The capital of France is"
    assert stopped.choices[0].finish_reason == "stop"

    def sample(seed: int) -> str:
        return client.completions.create(model="ensemble", prompt=STORY, max_tokens=16, temperature=1.0,
                                         seed=seed).choices[0].text

    assert sample(7) == sample(7)
    assert len({sample(seed) for seed in (1, 2, 3, 7)}) > 1

    answer = client.chat.completions.create(model="ensemble", messages=chat(), temperature=0, max_tokens=3,
                                            logprobs=True, top_logprobs=2)
    content = answer.choices[0].logprobs.content
    assert "".join(item.token for item in content) == answer.choices[0].message.content == "The capital of"
    for item in content:  # greedy: the chosen token is the most likely one
        assert len(item.top_logprobs) == 2
        assert item.top_logprobs[0].token == item.token and item.top_logprobs[0].logprob == item.logprob
        assert item.logprob <= 0 and bytes(item.bytes).decode() == item.token
    completion = client.completions.create(model="ensemble", prompt=STORY, max_tokens=4, temperature=0, logprobs=1)
    logprobs = completion.choices[0].logprobs
    assert "".join(logprobs.tokens) == completion.choices[0].text
    assert len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 4


def test_disconnect_mid_stream_frees_the_requests_kv_blocks(frontend, model_repo_server):
    metrics_url = model_repo_server.metrics_url
    before = metric(scrape_metrics(metrics_url), "inflightllm_request_finished_total", finish_reason="cancelled")
    client = frontend.client()
    # min_tokens keeps the model from stopping early: the request runs until cancelled.
    stream = client.chat.completions.create(
        model="ensemble", messages=chat("Write a very long story about a dragon."), max_tokens=900, stream=True,
        extra_body={"min_tokens": 900},
    )
    received = 0
    for _chunk in stream:
        received += 1
        if received == 4:
            break
    assert metric(scrape_metrics(metrics_url), "inflightllm_kv_cache_blocks", state="used") > 0
    stream.close()  # the HTTP connection closes mid-stream

    def freed():
        values = scrape_metrics(metrics_url)
        return (
            metric(values, "inflightllm_kv_cache_blocks", state="used") == 0
            and metric(values, "inflightllm_requests", state="running") == 0
            and metric(values, "inflightllm_request_finished_total", finish_reason="cancelled") == before + 1
        )

    assert wait_for(freed, timeout=60), scrape_metrics(metrics_url)


BAD_REQUESTS = [
    # (body changes, HTTP status, param, words in the message)
    ({"temperature": -1}, 400, "temperature", "-1.0 is out of range"),
    ({"max_tokens": "x"}, 400, "max_tokens", "valid integer"),
    ({"max_tokens": 4294967298}, 400, "max_tokens", "less than or equal to 2147483647"),
    ({"max_tokens": 5000}, 400, "max_tokens", "5000 is out of range"),
    ({"n": 9}, 400, "n", "allowed: 1 to 8"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages[0].role", "'user'"),
    ({"messages": []}, 400, "messages", "at least 1"),
    ({"logit_bias": {"1": 5}}, 400, "logit_bias", "unknown field"),
    ({"top_logprobs": 3}, 400, "top_logprobs", "logprobs=true"),
    ({"model": "gpt-4"}, 404, "model", "does not exist"),
]


@pytest.mark.parametrize(("change", "status", "param", "words"), BAD_REQUESTS,
                         ids=[next(iter(change)) + str(index) for index, (change, *_) in enumerate(BAD_REQUESTS)])
def test_bad_requests_get_openai_shaped_errors(frontend, change, status, param, words):
    body = {"model": "ensemble", "messages": chat(), "max_tokens": 8, **change}
    got_status, answer = post(f"{frontend.url}/v1/chat/completions", body)
    assert got_status == status, answer
    assert set(answer) == {"error"} and set(answer["error"]) == {"message", "type", "param", "code"}
    assert answer["error"]["param"] == param
    assert words in answer["error"]["message"]
    # The official client raises the matching exception, also for a streamed request.
    error_class = openai.BadRequestError if status == 400 else openai.NotFoundError
    with pytest.raises(error_class) as raised:
        frontend.client().chat.completions.create(**{**body, "stream": True})
    assert raised.value.status_code == status


def test_a_completion_error_names_the_field(frontend):
    with pytest.raises(openai.BadRequestError) as raised:
        frontend.client().completions.create(model="ensemble", prompt=STORY, max_tokens=4, top_p=0)
    assert raised.value.body["param"] == "top_p"
    assert "input 'top_p': 0.0 is out of range" in raised.value.body["message"]
    status, answer = post(f"{frontend.url}/v1/completions", {"model": "ensemble", "prompt": ["a", "b"]})
    assert (status, answer["error"]["param"]) == (400, "prompt")


def test_over_the_concurrency_limit_is_503(model_repo_server):
    limited = Frontend(model_repo_server.grpc_url, "--max-concurrent-requests", "1")
    try:
        client = limited.client()
        stream = client.chat.completions.create(
            model="ensemble", messages=chat("Write a very long story."), max_tokens=600, stream=True,
            extra_body={"min_tokens": 600},
        )
        next(iter(stream))  # the first request is running
        with pytest.raises(openai.InternalServerError) as raised:
            client.chat.completions.create(model="ensemble", messages=chat(), max_tokens=4)
        assert raised.value.status_code == 503
        assert raised.value.body["code"] == "overloaded"
        stream.close()
        # The slot comes back when the first request ends.
        assert wait_for(lambda: _answers(client), timeout=30)
    finally:
        limited.stop()
    assert wait_for(lambda: metric(scrape_metrics(model_repo_server.metrics_url), "inflightllm_kv_cache_blocks",
                                   state="used") == 0, timeout=60)


def _answers(client) -> bool:
    try:
        return client.chat.completions.create(model="ensemble", messages=chat(), max_tokens=2,
                                              temperature=0).choices[0].message.content == "The capital"
    except openai.InternalServerError:
        return False
