"""preprocessing's logic (inflightllm.text.preprocess) without a server: defaults, every
validation rule with its exact message, stop/bad word packing, JSON-vs-tensor precedence,
the chat template, and the Triton adapter's per-request errors (with a fake pb_utils)."""

from __future__ import annotations

import importlib.util
import json
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from inflightllm.text.preprocess import (
    ENGINE_REQUEST_DTYPES,
    SAMPLING_PARAMETER_KEYS,
    RequestError,
    RequestLimits,
    build_engine_request,
    pack_token_sequences,
    word_token_sequences,
)
from inflightllm.token_sequences import unpack_token_sequences

LIMITS = RequestLimits(
    max_input_length=64, max_output_len=1024, max_model_len=80, priority_levels=3, vocab_size=49152
)
REPO_ROOT = Path(__file__).resolve().parent.parent
HELLO_WORLD = [19556, 905]  # "Hello world"
ALLOWED_KEYS = ", ".join(SAMPLING_PARAMETER_KEYS)


def text(value: str | bytes) -> np.ndarray:
    """A BYTES tensor [1, 1] as Triton's as_numpy() gives it."""
    return np.array([[value.encode("utf-8") if isinstance(value, str) else value]], dtype=object)


def words(*values: str) -> np.ndarray:
    """A BYTES tensor [1, k] (TensorRT-LLM clients' stop_words/bad_words)."""
    return np.array([[v.encode("utf-8") for v in values]], dtype=object)


def scalar(value, dtype) -> np.ndarray:
    return np.array([[value]], dtype=dtype)


def make_request(prompt: str | None = "Hello world", max_tokens: int | None = 5, sampling=None, **tensors):
    """Inputs of one request: text_input, max_tokens, sampling_parameters (a dict, dumped
    to JSON, or a raw string), plus any other tensor given as an array."""
    inputs = dict(tensors)
    if prompt is not None:
        inputs["text_input"] = text(prompt)
    if max_tokens is not None:
        inputs["max_tokens"] = scalar(max_tokens, np.int32)
    if sampling is not None:
        inputs["sampling_parameters"] = text(sampling if isinstance(sampling, str) else json.dumps(sampling))
    return inputs


def build(tokenizer, limits=LIMITS, **kwargs) -> dict[str, np.ndarray]:
    return build_engine_request(make_request(**kwargs), tokenizer, limits)


def values(request: dict[str, np.ndarray]) -> dict:
    """Plain Python values of the [1, ...] outputs (scalars unwrapped)."""
    out = {}
    for name, array in request.items():
        assert array.dtype == ENGINE_REQUEST_DTYPES[name], name
        assert array.shape[0] == 1, name
        flat = array.reshape(-1).tolist()
        out[name] = flat[0] if array.shape == (1, 1) and name not in ("input_ids", "stop_words", "bad_words", "guided_guide") else flat
    return out


def error_of(tokenizer, limits=LIMITS, **kwargs) -> str:
    with pytest.raises(RequestError) as info:
        build(tokenizer, limits, **kwargs)
    return str(info.value)


# ---------------------------------------------------------------- defaults and prompt


def test_defaults_fill_every_engine_input(smollm2_tokenizer):
    request = build(smollm2_tokenizer)
    assert list(request) == list(ENGINE_REQUEST_DTYPES)
    assert request["input_ids"].shape == (1, 2)
    assert values(request) == {
        "input_ids": HELLO_WORLD,
        "input_length": 2,
        "max_tokens": 5,
        "min_tokens": 0,
        "streaming": False,
        "temperature": 0.0,
        "top_k": 0,
        "top_p": 1.0,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "seed": -1,
        "end_id": -1,
        "ignore_eos": False,
        "stop_words": [0],
        "bad_words": [0],
        "return_log_probs": False,
        "num_top_logprobs": 0,
        "priority": 0,
        "exclude_input_in_output": False,
        "timeout_ms": 0,
        "guided_type": 0,
        "guided_guide": [0],
        "n": 1,
        "best_of": 0,
        "beam_width": 1,
        "length_penalty": 1.0,
        "early_stopping": 0,
    }


@pytest.mark.parametrize("prompt", ["Hello 😀 你好", " leading space", "Ünïcödé\nnew line 👨\u200d👩\u200d👧 🇫🇷", "<|im_start|>user"])
def test_text_input_ids_equal_the_tokenizer(smollm2_tokenizer, prompt):
    request = build(smollm2_tokenizer, prompt=prompt)
    assert request["input_ids"][0].tolist() == smollm2_tokenizer(prompt)["input_ids"]
    assert request["input_length"][0, 0] == request["input_ids"].shape[1]
    assert build(smollm2_tokenizer, prompt="Hello 😀 你好")["input_ids"][0].tolist() == [
        19556, 40303, 218, 216, 18645, 250, 48392, 138
    ]


def chat_ids(tokenizer, messages) -> list[int]:
    result = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(result["input_ids"] if hasattr(result, "keys") else result)


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "user", "content": "What is the capital of France?"}],
        [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Hi 😀 你好"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "  spaces  "},
        ],
    ],
)
def test_chat_messages_equal_apply_chat_template(smollm2_tokenizer, messages):
    inputs = make_request(prompt=None, messages=text(json.dumps(messages)))
    ids = build_engine_request(inputs, smollm2_tokenizer, LIMITS)["input_ids"][0].tolist()
    assert ids == chat_ids(smollm2_tokenizer, messages)
    if len(messages) == 1:
        assert ids == [
            1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411,
            407, 19712, 8182, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1,
            520, 9531, 198,
        ]


# ---------------------------------------------------------------- validation messages

ERROR_CASES = {
    "temperature below 0": (
        {"temperature": scalar(-0.5, np.float32)},
        "input 'temperature': -0.5 is out of range; allowed: 0 to 100 (0 = greedy)",
    ),
    "temperature NaN": (
        {"temperature": scalar(np.nan, np.float32)},
        "input 'temperature': nan is out of range; allowed: 0 to 100 (0 = greedy)",
    ),
    "temperature in JSON": (
        {"sampling": {"temperature": 100.5}},
        "sampling_parameters key 'temperature': 100.5 is out of range; allowed: 0 to 100 (0 = greedy)",
    ),
    "max_tokens too large": (
        {"max_tokens": 5000},
        "input 'max_tokens': 5000 is out of range; allowed: 1 to 1024 (the profile's max_output_len)",
    ),
    "max_tokens zero": (
        {"max_tokens": 0},
        "input 'max_tokens': 0 is out of range; allowed: 1 to 1024 (the profile's max_output_len)",
    ),
    "max_tokens in JSON": (
        {"max_tokens": None, "sampling": {"max_tokens": -3}},
        "sampling_parameters key 'max_tokens': -3 is out of range; allowed: 1 to 1024 (the profile's max_output_len)",
    ),
    "max_tokens missing": (
        {"max_tokens": None},
        "input 'max_tokens' is missing; allowed: 1 to 1024 (the profile's max_output_len), "
        "as the tensor or as sampling_parameters key 'max_tokens'",
    ),
    "max_model_len": (
        {"max_tokens": 79},
        "input 'max_tokens': the prompt's 2 tokens + max_tokens 79 = 81 is more than max_model_len 80; "
        "allowed: max_tokens at most 78 for this prompt",
    ),
    "min_tokens above max_tokens": (
        {"min_tokens": scalar(6, np.int32)},
        "input 'min_tokens': 6 is out of range; allowed: 0 to max_tokens (5)",
    ),
    "top_k negative tensor": (
        {"top_k": scalar(-1, np.int32)},
        "input 'top_k': -1 is out of range; allowed: 0 (off) or more",
    ),
    "top_k below -1 in JSON": (
        {"sampling": {"top_k": -2}},
        "sampling_parameters key 'top_k': -2 is out of range; allowed: -1 or 0 (off), or more",
    ),
    "top_p zero": (
        {"top_p": scalar(0.0, np.float32)},
        "input 'top_p': 0.0 is out of range; allowed: greater than 0, up to 1 (1 = off)",
    ),
    "top_p above 1": (
        {"sampling": {"top_p": 1.5}},
        "sampling_parameters key 'top_p': 1.5 is out of range; allowed: greater than 0, up to 1 (1 = off)",
    ),
    "min_p above 1": (
        {"min_p": scalar(1.25, np.float32)},
        "input 'min_p': 1.25 is out of range; allowed: 0 to 1 (0 = off)",
    ),
    "repetition_penalty zero": (
        {"repetition_penalty": scalar(0, np.float32)},
        "input 'repetition_penalty': 0.0 is out of range; allowed: greater than 0, up to 100 (1 = off)",
    ),
    "presence_penalty": (
        {"presence_penalty": scalar(2.5, np.float32)},
        "input 'presence_penalty': 2.5 is out of range; allowed: -2 to 2",
    ),
    "frequency_penalty": (
        {"sampling": {"frequency_penalty": -3}},
        "sampling_parameters key 'frequency_penalty': -3 is out of range; allowed: -2 to 2",
    ),
    "seed negative in JSON": (
        {"sampling": {"seed": -1}},
        "sampling_parameters key 'seed': -1 is out of range; allowed: 0 or more",
    ),
    "end_id outside vocabulary": (
        {"end_id": scalar(49152, np.int32)},
        "input 'end_id': 49152 is out of range; allowed: 0 to 49151 (the vocabulary)",
    ),
    "stop_token_ids outside vocabulary": (
        {"sampling": {"stop_token_ids": [2, 50000]}},
        "sampling_parameters key 'stop_token_ids': 50000 is out of range; allowed: 0 to 49151 (the vocabulary)",
    ),
    "num_top_logprobs": (
        {"num_top_logprobs": scalar(21, np.int32)},
        "input 'num_top_logprobs': 21 is out of range; allowed: 0 to 20",
    ),
    "logprobs in JSON": (
        {"sampling": {"logprobs": 25}},
        "sampling_parameters key 'logprobs': 25 is out of range; allowed: 0 to 20",
    ),
    "priority": (
        {"priority": scalar(3, np.int32)},
        "input 'priority': 3 is out of range; allowed: 0 to 2 (the profile's priority_levels is 3; larger is scheduled first)",
    ),
    "unknown JSON key": (
        {"sampling": {"temprature": 0.5}},
        f"sampling_parameters: unknown key 'temprature'; allowed keys: {ALLOWED_KEYS}",
    ),
    "JSON string for a number": (
        {"sampling": {"temperature": "hot"}},
        "sampling_parameters key 'temperature': \"hot\" is a string that is not a number; expected a number",
    ),
    "JSON float for an integer": (
        {"sampling": {"top_k": 1.5}},
        "sampling_parameters key 'top_k': 1.5 is a number; expected an integer",
    ),
    "JSON boolean for an integer": (
        {"sampling": {"max_tokens": True}},
        "sampling_parameters key 'max_tokens': true is a boolean; expected an integer",
    ),
    "JSON string for a boolean": (
        {"sampling": {"ignore_eos": "yes"}},
        "sampling_parameters key 'ignore_eos': \"yes\" is a string; expected a boolean",
    ),
    "JSON stop with a number": (
        {"sampling": {"stop": ["end", 7]}},
        "sampling_parameters key 'stop': [\"end\", 7] is a list holding an integer; expected a string or a list of strings",
    ),
    "JSON stop_token_ids as a number": (
        {"sampling": {"stop_token_ids": 2}},
        "sampling_parameters key 'stop_token_ids': 2 is an integer; expected a list of integers",
    ),
    "JSON stop empty string": (
        {"sampling": {"stop": ""}},
        "sampling_parameters key 'stop': \"\" is an empty string; allowed: non-empty strings",
    ),
    "JSON stop list with an empty string": (
        {"sampling": {"stop": ["end", ""]}},
        "sampling_parameters key 'stop': item 1 \"\" is an empty string; allowed: non-empty strings",
    ),
    "JSON bad_words empty string": (
        {"sampling": {"bad_words": [""]}},
        "sampling_parameters key 'bad_words': item 0 \"\" is an empty string; allowed: non-empty strings",
    ),
    "sampling_parameters not JSON": (
        {"sampling": "{temperature: 1}"},
        "sampling_parameters: not valid JSON (Expecting property name enclosed in double quotes: line 1 column 2 (char 1))",
    ),
    "sampling_parameters not an object": (
        {"sampling": "[1, 2]"},
        "sampling_parameters: [1, 2] is a list; expected a JSON object",
    ),
    "both prompt inputs": (
        {"messages": text('[{"role": "user", "content": "hi"}]')},
        "inputs 'text_input' and 'messages': both were given; allowed: exactly one of them",
    ),
    "no prompt input": (
        {"prompt": None},
        "input 'text_input' is missing; allowed: 'text_input' (the prompt) or 'messages' "
        '(a JSON list of {"role", "content"} objects)',
    ),
    "empty prompt": (
        {"prompt": ""},
        "input 'text_input': the prompt is empty (0 tokens); allowed: 1 to 64 tokens (the profile's max_input_length)",
    ),
    "prompt too long": (
        {"prompt": "word" + " word" * 69},
        "input 'text_input': the prompt has 70 tokens; allowed: 1 to 64 tokens (the profile's max_input_length)",
    ),
    "prompt not UTF-8": (
        {"prompt": b"caf\xe9"},
        "input 'text_input': the text is not valid UTF-8 ('utf-8' codec can't decode byte 0xe9 in position 3: unexpected end of data)",
    ),
    "messages not JSON": (
        {"prompt": None, "messages": text("hi there")},
        "input 'messages': not valid JSON (Expecting value: line 1 column 1 (char 0))",
    ),
    "messages empty list": (
        {"prompt": None, "messages": text("[]")},
        'input \'messages\': [] is not a non-empty JSON list of {"role": string, "content": string} objects',
    ),
    "message without content": (
        {"prompt": None, "messages": text('[{"role": "user", "content": "hi"}, {"role": "user"}]')},
        'input \'messages\': item 1 ({"role": "user"}) is not an object with string \'role\' and \'content\'; '
        'expected a non-empty JSON list of {"role": string, "content": string} objects',
    ),
    "unknown role": (
        {"prompt": None, "messages": text('[{"role": "robot", "content": "hi"}]')},
        "input 'messages': item 0 has role \"robot\"; allowed roles: system, user, assistant, tool",
    ),
    # Other backends' names.
    "seed and random_seed": (
        {"seed": scalar(1, np.uint64), "random_seed": scalar(1, np.uint64)},
        "inputs 'seed' and 'random_seed': both were given; they are the same setting, allowed: one of them",
    ),
    "min_length above max_tokens": (
        {"min_length": scalar(6, np.int32)},
        "input 'min_length': 6 is out of range; allowed: 0 to max_tokens (5)",
    ),
    "beam_width 0": (
        {"beam_width": scalar(0, np.int32)},
        "input 'beam_width': 0 is out of range; allowed: 1 or more",
    ),
    "length_penalty": (
        {"length_penalty": scalar(11.0, np.float32)},
        "input 'length_penalty': 11.0 is out of range; allowed: -10 to 10",
    ),
    "early_stopping code": (
        {"early_stopping": scalar(3, np.int32)},
        "input 'early_stopping': 3 is out of range; allowed: 0 (false), 1 (true) or 2 (\"never\")",
    ),
    "context logits": (
        {"return_context_logits": scalar(True, np.bool_)},
        "input 'return_context_logits': true is not supported: this server returns no logits; allowed: false "
        "(for log probabilities use return_log_probs and num_top_logprobs)",
    ),
    "generation logits": (
        {"return_generation_logits": scalar(True, np.bool_)},
        "input 'return_generation_logits': true is not supported: this server returns no logits; allowed: false "
        "(for log probabilities use return_log_probs and num_top_logprobs)",
    ),
    "vLLM n": (
        {"sampling": {"n": 0}},
        "sampling_parameters key 'n': 0 is out of range; allowed: 1 or more",
    ),
    "vLLM early_stopping": (
        {"sampling": {"early_stopping": "sometimes"}},
        "sampling_parameters key 'early_stopping': \"sometimes\" is a string; expected true, false or \"never\"",
    ),
    "vLLM number string that is not a number": (
        {"max_tokens": None, "sampling": {"max_tokens": "lots"}},
        "sampling_parameters key 'max_tokens': \"lots\" is a string that is not an integer; expected an integer",
    ),
}


@pytest.mark.parametrize("case", list(ERROR_CASES))
def test_error_message(smollm2_tokenizer, case):
    kwargs, message = ERROR_CASES[case]
    kwargs = dict(kwargs)
    call = {key: kwargs.pop(key) for key in ("prompt", "max_tokens", "sampling") if key in kwargs}
    assert error_of(smollm2_tokenizer, **call, **kwargs) == message


def test_prompt_too_long_for_messages_names_the_messages_input(smollm2_tokenizer):
    messages = [{"role": "user", "content": "word " * 10}]
    count = len(chat_ids(smollm2_tokenizer, messages))
    assert count > 40
    limits = RequestLimits(40, 1024, 2000, 3, 49152)
    message = error_of(smollm2_tokenizer, limits, prompt=None, messages=text(json.dumps(messages)))
    assert message == (
        f"input 'messages': the prompt has {count} tokens; allowed: 1 to 40 tokens (the profile's max_input_length)"
    )


def test_max_tokens_exactly_at_the_limits_is_accepted(smollm2_tokenizer):
    assert values(build(smollm2_tokenizer, max_tokens=78))["max_tokens"] == 78  # 2 + 78 = 80
    limits = RequestLimits(64, 1024, 4096, 3, 49152)
    assert values(build(smollm2_tokenizer, limits, max_tokens=1024))["max_tokens"] == 1024


# ---------------------------------------------------------------- stop and bad words


def test_stop_words_pack_both_spacings(smollm2_tokenizer):
    request = build(smollm2_tokenizer, stop_words=words("Paris", "a,b"))
    # "Paris" -> [38634], " Paris" -> [7042]; "a,b" is one word (commas do not split).
    assert request["stop_words"].tolist() == [[4, 1, 38634, 1, 7042, 3, 81, 28, 82, 3, 253, 28, 82]]
    assert unpack_token_sequences(request["stop_words"].reshape(-1).tolist()) == ((38634,), (7042,), (81, 28, 82), (253, 28, 82))


def test_identical_sequences_are_kept_once(smollm2_tokenizer):
    # "Paris" twice, and " Paris" (whose spaced form "  Paris" differs) -> no repeats.
    sequences = word_token_sequences(smollm2_tokenizer, ["Paris", "Paris", " Paris"])
    assert sequences == [(38634,), (7042,), tuple(smollm2_tokenizer.encode("  Paris", add_special_tokens=False))]


def test_stop_token_ids_are_sequences_of_one_after_the_words(smollm2_tokenizer):
    request = build(smollm2_tokenizer, sampling={"stop": "Paris", "stop_token_ids": [2, 7042, 2]})
    assert request["stop_words"].tolist() == [[3, 1, 38634, 1, 7042, 1, 2]]


def test_stop_as_json_string_or_list(smollm2_tokenizer):
    one = build(smollm2_tokenizer, sampling={"stop": "\n"})["stop_words"].tolist()
    assert one == [[2, 1, 198, 1, 3717]]
    many = build(smollm2_tokenizer, sampling={"stop": ["\n", "<|im_end|>"]})["stop_words"].tolist()
    assert many == [[4, 1, 198, 1, 3717, 1, 2, 2, 216, 2]]


def test_empty_elements_of_word_tensors_are_ignored(smollm2_tokenizer):
    request = build(smollm2_tokenizer, stop_words=words(""), bad_words=words("", "Paris", ""))
    assert request["stop_words"].tolist() == [[0]]
    assert request["bad_words"].tolist() == [[2, 1, 38634, 1, 7042]]


def test_word_tensor_of_one_dimension_is_accepted(smollm2_tokenizer):
    inputs = make_request(stop_words=np.array([b"Paris"], dtype=object))
    assert build_engine_request(inputs, smollm2_tokenizer, LIMITS)["stop_words"].tolist() == [[2, 1, 38634, 1, 7042]]


def test_bad_words_from_json(smollm2_tokenizer):
    request = build(smollm2_tokenizer, sampling={"bad_words": ["hello world"]})
    assert request["bad_words"].tolist() == [[2, 2, 28120, 905, 2, 33662, 905]]
    assert request["stop_words"].tolist() == [[0]]


def test_pack_and_unpack():
    assert pack_token_sequences([]).tolist() == [[0]]
    assert pack_token_sequences([(5,), (1, 2, 3)]).tolist() == [[2, 1, 5, 3, 1, 2, 3]]
    assert pack_token_sequences([(5,)]).dtype == np.int32
    assert unpack_token_sequences([2, 1, 5, 3, 1, 2, 3]) == ((5,), (1, 2, 3))
    assert unpack_token_sequences([0]) == ()


# ---------------------------------------------------------------- precedence and rules


def test_tensor_wins_over_json(smollm2_tokenizer):
    request = values(
        build(
            smollm2_tokenizer,
            max_tokens=7,
            temperature=scalar(0.25, np.float32),
            top_k=scalar(3, np.int32),
            stop_words=words("Paris"),
            sampling={"temperature": 0.9, "top_k": 40, "max_tokens": 9, "stop": "\n", "min_p": 0.5},
        )
    )
    assert (request["temperature"], request["top_k"], request["max_tokens"]) == (0.25, 3, 7)
    assert request["stop_words"] == [2, 1, 38634, 1, 7042]
    assert request["min_p"] == 0.5  # no tensor: the JSON key counts


def test_json_fills_what_tensors_do_not_give(smollm2_tokenizer):
    request = values(
        build(
            smollm2_tokenizer,
            max_tokens=None,
            sampling={
                "max_tokens": 12, "min_tokens": 2, "temperature": 0.5, "top_k": -1, "top_p": 0.75,
                "repetition_penalty": 1.25, "presence_penalty": 0.5, "frequency_penalty": -0.5,
                "seed": 42, "ignore_eos": True, "min_p": None,
            },
        )
    )
    assert {k: request[k] for k in (
        "max_tokens", "min_tokens", "temperature", "top_k", "top_p", "min_p", "repetition_penalty",
        "presence_penalty", "frequency_penalty", "seed", "ignore_eos",
    )} == {
        "max_tokens": 12, "min_tokens": 2, "temperature": 0.5, "top_k": 0, "top_p": 0.75, "min_p": 0.0,
        "repetition_penalty": 1.25, "presence_penalty": 0.5, "frequency_penalty": -0.5, "seed": 42,
        "ignore_eos": True,
    }


@pytest.mark.parametrize(
    ("given", "temperature"),
    [
        ({}, 0.0),
        ({"top_p": scalar(0.5, np.float32)}, 1.0),
        ({"top_k": scalar(0, np.int32)}, 1.0),
        ({"sampling": {"min_p": 0.1}}, 1.0),
        ({"sampling": {"top_k": 50, "temperature": 0.0}}, 0.0),
        ({"top_k": scalar(50, np.int32), "temperature": scalar(0.7, np.float32)}, np.float32(0.7)),
    ],
)
def test_temperature_default(smollm2_tokenizer, given, temperature):
    assert values(build(smollm2_tokenizer, **given))["temperature"] == temperature


@pytest.mark.parametrize(
    ("seed", "expected"),
    [(0, 0), (12345, 12345), (2**63 - 1, 2**63 - 1), (2**63, 0), (2**64 - 1, 2**63 - 1)],
)
def test_uint64_seed_folds_into_int64(smollm2_tokenizer, seed, expected):
    assert values(build(smollm2_tokenizer, seed=scalar(seed, np.uint64)))["seed"] == expected


def test_json_seed(smollm2_tokenizer):
    assert values(build(smollm2_tokenizer, sampling={"seed": 7}))["seed"] == 7
    assert values(build(smollm2_tokenizer, sampling={"seed": 2**64 + 5}))["seed"] == 5


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ({"sampling": {"logprobs": 3}}, (True, 3)),
        ({"sampling": {"logprobs": 0}}, (True, 0)),
        ({"return_log_probs": scalar(True, np.bool_)}, (True, 0)),
        ({"num_top_logprobs": scalar(2, np.int32)}, (True, 2)),
        ({"num_top_logprobs": scalar(5, np.int32), "sampling": {"logprobs": 1}}, (True, 5)),
        ({"return_log_probs": scalar(False, np.bool_), "sampling": {"logprobs": 4}}, (False, 4)),
    ],
)
def test_log_prob_settings(smollm2_tokenizer, given, expected):
    request = values(build(smollm2_tokenizer, **given))
    assert (request["return_log_probs"], request["num_top_logprobs"]) == expected


def test_flags_priority_end_id_and_ignored_inputs(smollm2_tokenizer):
    request = values(
        build(
            smollm2_tokenizer,
            stream=scalar(True, np.bool_),
            exclude_input_in_output=scalar(True, np.bool_),
            priority=scalar(2, np.int32),
            end_id=scalar(2, np.int32),
            pad_id=scalar(99999, np.int32),  # accepted for compatibility, not used
            return_finish_reason=scalar(False, np.bool_),
            return_num_input_tokens=scalar(False, np.bool_),
            return_num_output_tokens=scalar(False, np.bool_),
        )
    )
    assert (request["streaming"], request["exclude_input_in_output"]) == (True, True)
    assert (request["priority"], request["end_id"]) == (2, 2)


def test_null_json_values_and_empty_json_count_as_not_given(smollm2_tokenizer):
    assert values(build(smollm2_tokenizer, sampling={"temperature": None}))["temperature"] == 0.0
    assert values(build(smollm2_tokenizer, sampling=""))["temperature"] == 0.0
    assert values(build(smollm2_tokenizer, sampling={}))["temperature"] == 0.0


def test_limits_from_parameters():
    params = {"max_input_length": "100", "max_output_len": "50", "priority_levels": "5", "model_source": "random"}
    assert RequestLimits.from_parameters(params, vocab_size=1000) == RequestLimits(100, 50, 150, 5, 1000)
    params["max_model_len"] = "120"
    assert RequestLimits.from_parameters(params, vocab_size=1000).max_model_len == 120
    with pytest.raises(ValueError, match="preprocessing parameter 'max_output_len': 'many' is not an integer"):
        RequestLimits.from_parameters({"max_output_len": "many"}, vocab_size=1000)


# ---------------------------------------------------------------- the Triton adapter


class _FakeTensor:
    def __init__(self, name, array):
        self._name, self._array = name, np.asarray(array)

    def name(self):
        return self._name

    def as_numpy(self):
        return self._array


class _FakeError:
    INVALID_ARG = "INVALID_ARG"

    def __init__(self, message, code=None):
        self._message, self.code = message, code

    def message(self):
        return self._message


class _FakeResponse:
    def __init__(self, output_tensors=None, error=None):
        self.output_tensors, self.error = output_tensors or [], error


def _fake_pb_utils() -> types.ModuleType:
    module = types.ModuleType("triton_python_backend_utils")
    module.Tensor = _FakeTensor
    module.TritonError = _FakeError
    module.InferenceResponse = _FakeResponse
    module.get_input_tensor_by_name = lambda request, name: (
        _FakeTensor(name, request[name]) if request.get(name) is not None else None
    )
    module.Logger = types.SimpleNamespace(log_error=lambda message: None)
    return module


class _FakeRequest(dict):
    """A request's input arrays by name, and its Triton request parameters (JSON text)."""

    def __init__(self, inputs, parameters: str = "{}"):
        super().__init__(inputs)
        self._parameters = parameters

    def parameters(self) -> str:
        return self._parameters


def test_adapter_fails_only_the_bad_request_of_a_batch(smollm2_tokenizer, monkeypatch):
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", _fake_pb_utils())
    spec = importlib.util.spec_from_file_location("preprocessing_model", REPO_ROOT / "templates/models/preprocessing.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = module.TritonPythonModel()
    model.tokenizer, model.limits = smollm2_tokenizer, LIMITS
    model.input_names = ["text_input", "max_tokens", "temperature"]

    good = _FakeRequest(make_request())
    bad = _FakeRequest(make_request(temperature=scalar(-1.0, np.float32)))
    unread = _FakeRequest(make_request(), '{"temprature": 0.5, "triton_enable_empty_final_response": true}')
    responses = model.execute([good, bad, good, unread])
    assert [r.error is None for r in responses] == [True, False, True, False]
    assert responses[1].error.message() == "input 'temperature': -1.0 is out of range; allowed: 0 to 100 (0 = greedy)"
    assert responses[1].error.code == "INVALID_ARG"
    assert responses[3].error.message().startswith("request parameter 'temprature': not an input of this model")
    assert responses[3].error.code == "INVALID_ARG"
    outputs = {t.name(): t.as_numpy() for t in responses[2].output_tensors}
    assert list(outputs) == list(ENGINE_REQUEST_DTYPES)
    assert outputs["input_ids"].tolist() == [HELLO_WORLD]


# --- other backends' request names -----------------------------------------------------------


def test_tensorrt_llm_names_take_effect(smollm2_tokenizer):
    request = values(build(
        smollm2_tokenizer,
        random_seed=scalar(2**64 - 1, np.uint64),
        min_length=scalar(3, np.int32),
        beam_width=scalar(1, np.int32),
        length_penalty=scalar(1.0, np.float32),
        return_context_logits=scalar(False, np.bool_),
        return_generation_logits=scalar(False, np.bool_),
    ))
    assert (request["seed"], request["min_tokens"]) == ((2**64 - 1) % 2**63, 3)
    # The same as the engine's own names.
    assert request == values(build(smollm2_tokenizer, seed=scalar(2**64 - 1, np.uint64),
                                   min_tokens=scalar(3, np.int32)))


def test_several_outputs_reach_the_engine(smollm2_tokenizer):
    """n (JSON) or num_return_sequences (TensorRT-LLM), best_of, beam search's settings."""
    request = values(build(smollm2_tokenizer, sampling={"n": 3, "best_of": 5}))
    assert (request["n"], request["best_of"], request["beam_width"]) == (3, 5, 1)
    request = values(build(smollm2_tokenizer, num_return_sequences=scalar(4, np.int32),
                           beam_width=scalar(4, np.int32), length_penalty=scalar(0.5, np.float32),
                           early_stopping=scalar(2, np.int32)))
    assert (request["n"], request["beam_width"], request["length_penalty"], request["early_stopping"]) == (
        4, 4, 0.5, 2)
    request = values(build(smollm2_tokenizer, sampling={"beam_width": 2, "early_stopping": True,
                                                        "length_penalty": -1.0}))
    assert (request["beam_width"], request["early_stopping"], request["length_penalty"]) == (2, 1, -1.0)


@pytest.mark.parametrize("flag", ["return_cumulative_logprob", "return_logprobs"])
def test_vllm_log_prob_flags_turn_on_log_probs(smollm2_tokenizer, flag):
    assert values(build(smollm2_tokenizer, **{flag: scalar(True, np.bool_)}))["return_log_probs"] is True
    assert values(build(smollm2_tokenizer, **{flag: scalar(False, np.bool_)}))["return_log_probs"] is False
    request = values(build(smollm2_tokenizer, sampling={"logprobs": 2}, **{flag: scalar(True, np.bool_)}))
    assert (request["return_log_probs"], request["num_top_logprobs"]) == (True, 2)


def test_vllm_numbers_as_strings(smollm2_tokenizer):
    # genai-perf's vLLM format: {"max_tokens": "128", "min_tokens": "128"} and no max_tokens tensor.
    request = values(build(smollm2_tokenizer, max_tokens=None,
                           sampling={"max_tokens": "7", "min_tokens": "7", "temperature": "0.5", "n": "1"}))
    assert (request["max_tokens"], request["min_tokens"], request["temperature"]) == (7, 7, 0.5)


def test_postprocessing_sends_the_other_backends_outputs(smollm2_tokenizer):
    from inflightllm.text.postprocess import OUTPUT_NAMES, build_text_response

    outputs = build_text_response(
        {"output_ids": np.array([[19556]], np.int32), "finish_reason": np.array([[2]], np.int32),
         "cum_log_probs": np.array([[-1.5]], np.float32)},
        smollm2_tokenizer,
    )
    assert tuple(outputs) == OUTPUT_NAMES
    assert outputs["cumulative_logprob"].tolist() == [[-1.5]]
    assert outputs["batch_index"].tolist() == [[0]] and outputs["batch_index"].dtype == np.int32
