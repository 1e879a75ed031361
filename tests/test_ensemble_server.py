"""The whole product through a real tritonserver over gRPC streaming: exact greedy text
under concurrency, the streaming text contract, stop words, cancellation, seeded
sampling, and clear errors for bad requests while others are served."""

from __future__ import annotations

import json

import pytest

from tests.ensemble_client import (
    cancel_after_pieces,
    metric,
    run_one,
    run_stream_requests,
    scrape_metrics,
    wait_for,
)
from tests.test_exactness import MAX_TOKENS, QUESTIONS, TEXTS

pytestmark = [pytest.mark.server, pytest.mark.slow]

MORE_TEXTS = [
    "My favourite recipe for pancakes",
    "The mitochondria is",
    "Here is a short poem about autumn:",
    "import numpy as np\n",
    "Q: What is the boiling point of water?\nA:",
    "The best way to learn a language is",
    "Dear diary, today",
    "Breaking news:",
]
MORE_QUESTIONS = [
    "Name a famous painter.",
    "What colour is the sky?",
    "How many legs does a spider have?",
    "Suggest a name for a cat.",
    "What is the largest ocean?",
    "Tell me a fun fact about bees.",
    "What is an atom?",
    "Recommend a book for a long flight.",
]


def chat(question: str) -> list[dict]:
    return [{"role": "user", "content": question}]


def chat_ids(tokenizer, messages) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def greedy_text(reference, tokenizer, prompt_ids, max_tokens) -> str:
    return tokenizer.decode(reference.greedy(prompt_ids, max_tokens), skip_special_tokens=True)


def test_32_concurrent_streams_equal_transformers_greedy(model_repo_server, smollm2_reference, smollm2_tokenizer):
    requests, expected = [], []
    questions = QUESTIONS + MORE_QUESTIONS
    texts = TEXTS + MORE_TEXTS
    max_tokens = MAX_TOKENS + [n + 2 for n in MAX_TOKENS]
    for i in range(32):
        n = max_tokens[i]
        if i % 2 == 0:
            messages = chat(questions[i // 2])
            requests.append({"messages": messages, "max_tokens": n, "stream": True})
            prompt = chat_ids(smollm2_tokenizer, messages)
        else:
            text = texts[i // 2]
            requests.append({"text_input": text, "max_tokens": n, "stream": True})
            prompt = smollm2_tokenizer.encode(text)
        expected.append(greedy_text(smollm2_reference, smollm2_tokenizer, prompt, n))
    results = run_stream_requests(model_repo_server.grpc_url, requests, num_streams=4)
    mismatches = [
        f"request {i}: got {r.text!r}, transformers {e!r}"
        for i, (r, e) in enumerate(zip(results, expected))
        if r.error or r.text != e
    ]
    assert not mismatches, "\n".join(mismatches)
    assert all(r.finish_reason in ("stop", "length") for r in results)
    # Streaming really streamed: most requests got more than one piece.
    assert sum(len(r.pieces) > 2 for r in results) >= 28


def test_non_streaming_equals_the_joined_stream(model_repo_server):
    request = {"messages": chat("Give me a tip for learning to cook."), "max_tokens": 40}
    streamed = run_one(model_repo_server.grpc_url, {**request, "stream": True})
    whole = run_one(model_repo_server.grpc_url, {**request, "stream": False, "exclude_input_in_output": True})
    assert len(whole.responses) == 1
    assert whole.text == streamed.text
    assert whole.finish_reason == streamed.finish_reason
    assert int(whole.last("num_output_tokens").reshape(-1)[0]) == int(streamed.last("num_output_tokens").reshape(-1)[0])


def test_non_streaming_echoes_the_prompt_by_default(model_repo_server, smollm2_tokenizer):
    text = "The quick brown fox"
    result = run_one(model_repo_server.grpc_url, {"text_input": text, "max_tokens": 8, "stream": False})
    generated = run_one(model_repo_server.grpc_url, {"text_input": text, "max_tokens": 8, "stream": True})
    assert result.text == text + generated.text
    ids = result.last("output_ids").reshape(-1).tolist()
    assert ids[: len(smollm2_tokenizer.encode(text))] == smollm2_tokenizer.encode(text)


@pytest.mark.parametrize(
    "question",
    [
        "Translate 'I love you' into Chinese.",
        "Say hello in Korean.",
        "Repeat exactly: 🎉🎉 日本語 😀",
        "你好，请介绍一下你自己。",  # ends mid-emoji at 40 tokens: a replacement char, as in a full decode
    ],
)
def test_emoji_and_cjk_stream_exactly(model_repo_server, smollm2_reference, smollm2_tokenizer, question):
    messages = chat(question)
    expected = greedy_text(smollm2_reference, smollm2_tokenizer, chat_ids(smollm2_tokenizer, messages), 40)
    assert any(ord(c) > 0x2E80 for c in expected)  # the output itself has CJK, Hangul or emoji
    result = run_one(model_repo_server.grpc_url, {"messages": messages, "max_tokens": 40, "stream": True})
    assert result.error is None
    assert result.text == expected
    # No piece but a final one may end in a replacement character.
    assert not any(piece.endswith("\ufffd") for piece in result.pieces[:-1])


def test_stop_word_ends_the_request_and_never_appears(model_repo_server):
    request = {"messages": chat("What is the capital of France?"), "max_tokens": 32, "stream": True}
    plain = run_one(model_repo_server.grpc_url, request)
    assert "Paris" in plain.text
    stopped = run_one(model_repo_server.grpc_url, {**request, "stop_words": ["Paris"]})
    assert stopped.finish_reason == "stop"
    assert "Paris" not in stopped.text
    assert all("Par" not in piece for piece in stopped.pieces)
    assert plain.text.startswith(stopped.text)
    assert stopped.text.rstrip() == plain.text[: plain.text.index("Paris")].rstrip()


def test_cancelled_stream_frees_its_blocks(model_repo_server):
    url = model_repo_server.grpc_url
    metrics_url = model_repo_server.metrics_url
    before = metric(scrape_metrics(metrics_url), "inflightllm_request_finished_total", finish_reason="cancelled")

    def ensemble_completions() -> int:
        import urllib.request

        with urllib.request.urlopen(f"http://{model_repo_server.http_url}/v2/models/ensemble/stats") as response:
            stats = json.load(response)["model_stats"][0]["inference_stats"]
        return stats["success"]["count"] + stats["fail"]["count"]

    def blocks_in_use():
        assert metric(scrape_metrics(metrics_url), "inflightllm_kv_cache_blocks", state="used") > 0

    completions_before = ensemble_completions()
    # min_tokens keeps the model from stopping early: the request runs until cancelled.
    request = {"messages": chat("Write a very long story about a dragon."), "max_tokens": 900, "min_tokens": 900,
               "stream": True}
    pieces = cancel_after_pieces(url, request, before_cancel=blocks_in_use)

    def freed():
        values = scrape_metrics(metrics_url)
        return (
            metric(values, "inflightllm_kv_cache_blocks", state="used") == 0
            and metric(values, "inflightllm_requests", state="running") == 0
            and metric(values, "inflightllm_request_finished_total", finish_reason="cancelled") == before + 1
        )

    assert wait_for(freed, timeout=30), scrape_metrics(metrics_url)
    assert len(pieces) < 100  # stopped long before max_tokens
    # The ensemble request is over too (an error response from postprocessing would
    # leave it counted in flight, and server shutdown would wait its exit timeout).
    assert wait_for(lambda: ensemble_completions() == completions_before + 1, timeout=10)


def test_seeded_sampling_repeats(model_repo_server):
    base = {"text_input": "Once upon a time", "max_tokens": 24, "stream": True, "temperature": 1.0, "top_p": 0.95}
    first = run_one(model_repo_server.grpc_url, {**base, "seed": 1234})
    second = run_one(model_repo_server.grpc_url, {**base, "seed": 1234})
    assert first.text == second.text
    others = {run_one(model_repo_server.grpc_url, {**base, "seed": seed}).text for seed in (1, 2, 3)}
    assert len(others | {first.text}) > 1  # different seeds are not all the same text
    json_seeded = run_one(
        model_repo_server.grpc_url,
        {"text_input": "Once upon a time", "max_tokens": 24, "stream": True,
         "sampling_parameters": {"temperature": 1.0, "top_p": 0.95, "seed": 1234}},
    )
    assert json_seeded.text == first.text


BAD_REQUESTS = [
    ({"text_input": "hi", "max_tokens": 8, "temperature": -1.0}, "temperature"),
    ({"text_input": "hi", "max_tokens": 8, "top_p": 0.0}, "top_p"),
    ({"text_input": "hi", "max_tokens": 0}, "max_tokens"),
    ({"text_input": "hi", "max_tokens": 5000}, "max_tokens"),
    ({"max_tokens": 8}, "text_input"),
    ({"text_input": "hi", "messages": chat("hi"), "max_tokens": 8}, "messages"),
    ({"messages": "not json", "max_tokens": 8}, "messages"),
    ({"text_input": "hi", "max_tokens": 8, "sampling_parameters": {"temprature": 1}}, "temprature"),
    ({"text_input": "hi", "max_tokens": 8, "priority": 7}, "priority"),
    ({"text_input": "hi", "max_tokens": 8, "num_top_logprobs": 50}, "num_top_logprobs"),
    ({"text_input": "hi", "max_tokens": 8, "end_id": 10**6}, "end_id"),
    ({"text_input": "hi", "max_tokens": 8, "top_k": -3}, "top_k"),
    ({"text_input": "", "max_tokens": 8}, "text_input"),
    ({"text_input": "word " * 3000, "max_tokens": 8}, "text_input"),
    ({"text_input": "hi", "max_tokens": 8, "min_tokens": 20}, "min_tokens"),
    ({"text_input": "hi"}, "max_tokens"),
]


def test_bad_requests_get_clear_errors_while_a_good_one_completes(model_repo_server):
    good = {"messages": chat("What is the capital of France?"), "max_tokens": 32, "stream": True}
    requests = [good] + [bad for bad, _ in BAD_REQUESTS] + [good]
    results = run_stream_requests(model_repo_server.grpc_url, requests, num_streams=len(requests))
    assert results[0].error is None and results[0].text == "The capital of France is Paris."
    assert results[-1].error is None and results[-1].text == "The capital of France is Paris."
    problems = []
    for (bad, name), result in zip(BAD_REQUESTS, results[1:-1]):
        if result.error is None:
            problems.append(f"{json.dumps(bad)[:80]}: no error")
        elif name not in result.error:
            problems.append(f"{json.dumps(bad)[:80]}: error does not name {name!r}: {result.error}")
    assert not problems, "\n".join(problems)
    values = scrape_metrics(model_repo_server.metrics_url)
    assert wait_for(lambda: metric(scrape_metrics(model_repo_server.metrics_url), "inflightllm_kv_cache_blocks",
                                   state="used") == 0)
    assert metric(values, "inflightllm_kv_cache_blocks", state="total") > 0


def test_logprobs_and_counts_are_returned(model_repo_server):
    result = run_one(model_repo_server.grpc_url, {
        "text_input": "The capital of France is", "max_tokens": 6, "stream": False,
        "exclude_input_in_output": True, "return_log_probs": True, "num_top_logprobs": 3,
    })
    assert result.error is None
    logprobs = result.last("output_log_probs").reshape(-1)
    top_ids = result.last("top_logprob_ids")
    top_values = result.last("top_logprobs")
    num_out = int(result.last("num_output_tokens").reshape(-1)[0])
    assert num_out == len(logprobs) == top_ids.shape[-2] == 6
    assert top_ids.shape[-1] == 3 and top_values.shape[-1] == 3
    # Greedy: the chosen token is the most likely one.
    output_ids = result.last("output_ids").reshape(-1).tolist()
    assert output_ids == top_ids.reshape(6, 3)[:, 0].tolist()
    assert abs(float(result.last("cum_log_probs").reshape(-1)[0]) - float(logprobs.sum())) < 1e-4
    assert int(result.last("num_input_tokens").reshape(-1)[0]) == 5
