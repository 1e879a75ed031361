"""`preprocessing` and `postprocessing` in a real tritonserver, over gRPC.

The repository holds only these two models: config.pbtxt from the rendered `model_repo/`
when it is there (else a minimal one written here from docs/INTERFACE.md), model.py from
`templates/models/`. One server serves the whole module.
"""

from __future__ import annotations

import json
import queue
import random
import shutil
from pathlib import Path

import numpy as np
import pytest

from inflightllm.detokenizer import CONTEXT_WINDOW
from inflightllm.model_source import DEFAULT_TOKENIZER

pytestmark = pytest.mark.server

REPO_ROOT = Path(__file__).resolve().parent.parent
IM_END = 2

# name, Triton type, dims, optional — docs/INTERFACE.md "Ensemble inputs".
PREPROCESSING_INPUTS = [
    ("text_input", "STRING", [1], True),
    ("messages", "STRING", [1], True),
    ("max_tokens", "INT32", [1], False),
    ("stream", "BOOL", [1], True),
    ("temperature", "FP32", [1], True),
    ("top_k", "INT32", [1], True),
    ("top_p", "FP32", [1], True),
    ("min_p", "FP32", [1], True),
    ("repetition_penalty", "FP32", [1], True),
    ("presence_penalty", "FP32", [1], True),
    ("frequency_penalty", "FP32", [1], True),
    ("min_tokens", "INT32", [1], True),
    ("seed", "UINT64", [1], True),
    ("stop_words", "STRING", [-1], True),
    ("bad_words", "STRING", [-1], True),
    ("end_id", "INT32", [1], True),
    ("pad_id", "INT32", [1], True),
    ("exclude_input_in_output", "BOOL", [1], True),
    ("return_log_probs", "BOOL", [1], True),
    ("num_top_logprobs", "INT32", [1], True),
    ("priority", "INT32", [1], True),
    ("sampling_parameters", "STRING", [1], True),
    ("return_finish_reason", "BOOL", [1], True),
    ("return_num_input_tokens", "BOOL", [1], True),
    ("return_num_output_tokens", "BOOL", [1], True),
]
# "preprocessing -> engine".
PREPROCESSING_OUTPUTS = [
    ("input_ids", "INT32", [-1]),
    ("input_length", "INT32", [1]),
    ("max_tokens", "INT32", [1]),
    ("min_tokens", "INT32", [1]),
    ("streaming", "BOOL", [1]),
    ("temperature", "FP32", [1]),
    ("top_p", "FP32", [1]),
    ("min_p", "FP32", [1]),
    ("repetition_penalty", "FP32", [1]),
    ("presence_penalty", "FP32", [1]),
    ("frequency_penalty", "FP32", [1]),
    ("top_k", "INT32", [1]),
    ("seed", "INT64", [1]),
    ("end_id", "INT32", [1]),
    ("ignore_eos", "BOOL", [1]),
    ("stop_words", "INT32", [-1]),
    ("bad_words", "INT32", [-1]),
    ("return_log_probs", "BOOL", [1]),
    ("num_top_logprobs", "INT32", [1]),
    ("priority", "INT32", [1]),
    ("exclude_input_in_output", "BOOL", [1]),
]
# "engine -> postprocessing".
POSTPROCESSING_INPUTS = [
    ("output_ids", "INT32", [-1], False),
    ("context_ids", "INT32", [-1], False),
    ("finish_reason", "INT32", [1], False),
    ("num_input_tokens", "INT32", [1], False),
    ("num_output_tokens", "INT32", [1], False),
    ("num_cached_tokens", "INT32", [1], False),
    ("cum_log_probs", "FP32", [1], False),
    ("output_log_probs", "FP32", [-1], False),
    ("top_logprob_ids", "INT32", [-1, -1], False),
    ("top_logprobs", "FP32", [-1, -1], False),
]
# "Ensemble outputs".
POSTPROCESSING_OUTPUTS = [
    ("text_output", "STRING", [1]),
    ("finish_reason", "STRING", [1]),
    ("num_input_tokens", "INT32", [1]),
    ("num_output_tokens", "INT32", [1]),
    ("num_cached_tokens", "INT32", [1]),
    ("output_ids", "INT32", [-1]),
    ("cum_log_probs", "FP32", [1]),
    ("output_log_probs", "FP32", [-1]),
    ("top_logprob_ids", "INT32", [-1, -1]),
    ("top_logprobs", "FP32", [-1, -1]),
]
LIMIT_PARAMETERS = {"max_input_length": "2048", "max_output_len": "1024", "max_model_len": "8192", "priority_levels": "3"}


def _tensor_block(kind: str, tensors) -> str:
    entries = []
    for name, data_type, dims, *optional in tensors:
        extra = "\n    optional: true" if optional and optional[0] else ""
        entries.append(
            f'  {{\n    name: "{name}"\n    data_type: TYPE_{data_type}\n    dims: [ {", ".join(map(str, dims))} ]{extra}\n  }}'
        )
    return f"{kind} [\n" + ",\n".join(entries) + "\n]\n"


def minimal_config(name: str, inputs, outputs, parameters: dict[str, str], preserve_ordering: bool) -> str:
    """A config.pbtxt for a Python model (used when no rendered one exists)."""
    batching = "  preserve_ordering: true\n" if preserve_ordering else ""
    params = "".join(
        f'parameters {{\n  key: "{key}"\n  value: {{ string_value: "{value}" }}\n}}\n'
        for key, value in sorted(parameters.items())
    )
    return (
        f'name: "{name}"\nbackend: "python"\nmax_batch_size: 64\n'
        + _tensor_block("input", inputs)
        + _tensor_block("output", outputs)
        + f"dynamic_batching {{\n  max_queue_delay_microseconds: 2000\n{batching}}}\n"
        + "instance_group [ { count: 2\n kind: KIND_CPU } ]\n"
        + params
    )


@pytest.fixture(scope="module")
def tokenizer_repository(tmp_path_factory) -> Path:
    repository = tmp_path_factory.mktemp("tokenizer_repo")
    model_params = DEFAULT_TOKENIZER.to_parameters()
    fallbacks = {
        "preprocessing": minimal_config(
            "preprocessing", PREPROCESSING_INPUTS, PREPROCESSING_OUTPUTS, {**model_params, **LIMIT_PARAMETERS}, False
        ),
        "postprocessing": minimal_config(
            "postprocessing", POSTPROCESSING_INPUTS, POSTPROCESSING_OUTPUTS, model_params, True
        ),
    }
    for name, fallback in fallbacks.items():
        (repository / name / "1").mkdir(parents=True)
        rendered = REPO_ROOT / "model_repo" / name / "config.pbtxt"
        config = rendered.read_text() if rendered.is_file() else fallback
        (repository / name / "config.pbtxt").write_text(config)
        shutil.copy(REPO_ROOT / "templates" / "models" / f"{name}.py", repository / name / "1" / "model.py")
    return repository


@pytest.fixture(scope="module")
def server(triton_server_factory, tokenizer_repository):
    return triton_server_factory(tokenizer_repository)


@pytest.fixture(scope="module")
def client(server):
    import tritonclient.grpc as grpcclient

    with grpcclient.InferenceServerClient(server.grpc_url) as grpc_client:
        yield grpc_client


# ---------------------------------------------------------------- request helpers

_NUMPY_TYPES = {"BYTES": object, "BOOL": np.bool_, "INT32": np.int32, "UINT64": np.uint64, "FP32": np.float32}


def infer_input(name: str, datatype: str, values):
    """An input with the batch dimension of 1: `values` is one element or a list."""
    import tritonclient.grpc as grpcclient

    row = values if isinstance(values, list) else [values]
    if datatype == "BYTES":
        row = [v.encode("utf-8") if isinstance(v, str) else v for v in row]
    array = np.array([row], dtype=_NUMPY_TYPES[datatype])  # [1, len(row)]
    tensor = grpcclient.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array)
    return tensor


def preprocessing_inputs(prompt: str | None = None, max_tokens: int = 16, **extra):
    inputs = [infer_input("max_tokens", "INT32", max_tokens)]
    if prompt is not None:
        inputs.append(infer_input("text_input", "BYTES", prompt))
    types = dict((name, dtype) for name, dtype, _dims, _optional in PREPROCESSING_INPUTS)
    for name, value in extra.items():
        datatype = {"STRING": "BYTES"}.get(types[name], types[name])
        inputs.append(infer_input(name, datatype, value))
    return inputs


def outputs_of(result, names) -> dict[str, np.ndarray]:
    return {name: result.as_numpy(name) for name in names}


# ---------------------------------------------------------------- preprocessing

PROMPTS = [
    "What is the capital of France?",
    "Emoji: 😀 👨\u200d👩\u200d👧 🇫🇷 and 👍🏽",
    "中文：你好，世界！日本語。한국어",
    "  leading spaces, trailing newline\n",
    "naïve café — «quotes» …",
]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_preprocessing_input_ids_equal_transformers(client, smollm2_tokenizer, prompt):
    result = client.infer("preprocessing", preprocessing_inputs(prompt, max_tokens=7))
    out = outputs_of(result, [name for name, _type, _dims in PREPROCESSING_OUTPUTS])
    expected_ids = smollm2_tokenizer(prompt)["input_ids"]
    assert out["input_ids"].dtype == np.int32
    assert out["input_ids"].tolist() == [expected_ids]
    assert out["input_length"].tolist() == [[len(expected_ids)]]
    assert out["max_tokens"].tolist() == [[7]]
    assert out["temperature"].tolist() == [[0.0]]
    assert out["seed"].dtype == np.int64 and out["seed"].tolist() == [[-1]]
    assert out["streaming"].dtype == np.bool_ and out["streaming"].tolist() == [[False]]
    assert out["stop_words"].tolist() == [[0]]
    assert out["bad_words"].tolist() == [[0]]


def test_preprocessing_chat_form(client, smollm2_tokenizer):
    messages = [{"role": "user", "content": "Bonjour 😀, 你好?"}]
    result = client.infer(
        "preprocessing", preprocessing_inputs(max_tokens=5, messages=json.dumps(messages, ensure_ascii=False))
    )
    expected = smollm2_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    expected = list(expected["input_ids"] if hasattr(expected, "keys") else expected)
    assert result.as_numpy("input_ids").tolist() == [expected]
    assert expected[-3:] == [520, 9531, 198]  # "assistant\n" of the generation prompt


def test_preprocessing_words_and_sampling_parameters(client):
    result = client.infer(
        "preprocessing",
        preprocessing_inputs(
            "Hello world",
            stop_words=["Paris", ""],
            seed=2**64 - 1,
            stream=True,
            sampling_parameters=json.dumps({"top_p": 0.5, "stop_token_ids": [2], "bad_words": ["\n"], "logprobs": 3}),
        ),
    )
    out = outputs_of(result, ["stop_words", "bad_words", "seed", "streaming", "temperature", "top_p",
                              "return_log_probs", "num_top_logprobs"])
    assert out["stop_words"].tolist() == [[3, 1, 38634, 1, 7042, 1, 2]]
    assert out["bad_words"].tolist() == [[2, 1, 198, 1, 3717]]
    assert out["seed"].tolist() == [[2**63 - 1]]
    assert out["streaming"].tolist() == [[True]]
    assert out["temperature"].tolist() == [[1.0]]  # only top_p given: sampling at temperature 1
    assert out["top_p"].tolist() == [[0.5]]
    assert (out["return_log_probs"].tolist(), out["num_top_logprobs"].tolist()) == ([[True]], [[3]])


def test_bad_request_fails_alone_while_concurrent_good_ones_succeed(client, smollm2_tokenizer):
    from tritonclient.utils import InferenceServerException

    results: queue.Queue = queue.Queue()
    kinds = ["good", "bad"] * 6
    for index, kind in enumerate(kinds):
        temperature = 0.5 if kind == "good" else -0.5
        inputs = preprocessing_inputs(f"request {index} 😀", temperature=temperature)
        client.async_infer(
            "preprocessing", inputs, callback=lambda result, error, i=index: results.put((i, result, error))
        )
    answers = dict((i, (result, error)) for i, result, error in (results.get(timeout=60) for _ in kinds))
    for index, kind in enumerate(kinds):
        result, error = answers[index]
        if kind == "good":
            assert error is None, error
            ids = smollm2_tokenizer(f"request {index} 😀")["input_ids"]
            assert result.as_numpy("input_ids").tolist() == [ids]
            assert result.as_numpy("temperature").tolist() == [[0.5]]
        else:
            assert isinstance(error, InferenceServerException)
            assert error.message() == "input 'temperature': -0.5 is out of range; allowed: 0 to 100 (0 = greedy)"
            assert error.status() == "StatusCode.INVALID_ARGUMENT"


def test_preprocessing_error_messages_reach_the_client(client):
    from tritonclient.utils import InferenceServerException

    with pytest.raises(InferenceServerException) as info:
        client.infer("preprocessing", preprocessing_inputs("Hi", sampling_parameters='{"temprature": 1}'))
    assert info.value.message().startswith("sampling_parameters: unknown key 'temprature'; allowed keys: temperature, ")
    with pytest.raises(InferenceServerException) as info:
        client.infer("preprocessing", preprocessing_inputs("Hi", max_tokens=5000))
    assert info.value.message() == (
        "input 'max_tokens': 5000 is out of range; allowed: 1 to 1024 (the profile's max_output_len)"
    )


# ---------------------------------------------------------------- postprocessing

STREAM_TEXT = "Sure! 😀 Here: 你好世界, 👨\u200d👩\u200d👧 and 🇫🇷🇯🇵 — café.\n  Done"


def postprocessing_inputs(output_ids, context_ids, finish_reason, num_output_tokens, top_k=2):
    """One engine response as the engine would send it (log probs made up)."""
    count = len(output_ids)
    rng = np.random.default_rng(count * 1000 + num_output_tokens)
    output_log_probs = (-rng.random(count)).astype(np.float32)
    top_ids = rng.integers(0, 49152, size=(1, count, top_k)).astype(np.int32)
    top_logprobs = (-rng.random((1, count, top_k))).astype(np.float32)
    import tritonclient.grpc as grpcclient

    tensors = [
        infer_input("output_ids", "INT32", list(output_ids)),
        infer_input("context_ids", "INT32", list(context_ids)),
        infer_input("finish_reason", "INT32", finish_reason),
        infer_input("num_input_tokens", "INT32", 11),
        infer_input("num_output_tokens", "INT32", num_output_tokens),
        infer_input("num_cached_tokens", "INT32", 4),
        infer_input("cum_log_probs", "FP32", float(output_log_probs.sum())),
        infer_input("output_log_probs", "FP32", output_log_probs.tolist()),
    ]
    for name, datatype, array in (("top_logprob_ids", "INT32", top_ids), ("top_logprobs", "FP32", top_logprobs)):
        tensor = grpcclient.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    sent = {
        "output_log_probs": output_log_probs.reshape(1, -1),
        "top_logprob_ids": top_ids,
        "top_logprobs": top_logprobs,
    }
    return tensors, sent


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_postprocessing_streamed_pieces_concatenate_to_the_full_decode(client, smollm2_tokenizer, seed):
    ids = smollm2_tokenizer.encode(STREAM_TEXT, add_special_tokens=False) + [IM_END]
    rng = random.Random(seed)
    cuts, position = [], 0  # seed 0: one token per piece; others: random piece sizes
    while True:
        position += 1 if seed == 0 else rng.choice([1, 1, 2, 3, 5])
        if position >= len(ids):
            break
        cuts.append(position)
    bounds = [0, *cuts, len(ids)]
    pieces, reasons = [], []
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        final = end == len(ids)
        context = ids[max(0, start - CONTEXT_WINDOW) : start]
        tensors, sent = postprocessing_inputs(ids[start:end], context, 1 if final else 0, end)
        result = client.infer("postprocessing", tensors)
        pieces.append(result.as_numpy("text_output")[0, 0].decode("utf-8"))
        reasons.append(result.as_numpy("finish_reason")[0, 0].decode("utf-8"))
        assert result.as_numpy("output_ids").tolist() == [ids[start:end]]
        assert result.as_numpy("num_output_tokens").tolist() == [[end]]
        assert result.as_numpy("num_input_tokens").tolist() == [[11]]
        assert result.as_numpy("num_cached_tokens").tolist() == [[4]]
        for name, array in sent.items():
            assert np.array_equal(result.as_numpy(name), array), name
        assert "\ufffd" not in pieces[-1]
    assert "".join(pieces) == smollm2_tokenizer.decode(ids, skip_special_tokens=True) == STREAM_TEXT
    assert reasons == [""] * (len(pieces) - 1) + ["stop"]
    if seed == 0:  # one token at a time: the multi-byte characters are held back
        assert "" in pieces and "😀" in pieces


@pytest.mark.parametrize(("code", "reason"), [(0, ""), (1, "stop"), (2, "length"), (3, "cancelled")])
def test_postprocessing_finish_reasons_and_echo(client, smollm2_tokenizer, code, reason):
    # A non-streaming echo response: the prompt first, no context, the whole text at once.
    prompt_ids = smollm2_tokenizer.encode("Q: 你好? A:", add_special_tokens=False)
    generated = smollm2_tokenizer.encode(" 😀 hi", add_special_tokens=False)
    tensors, _ = postprocessing_inputs(prompt_ids + generated, [], code, len(generated))
    result = client.infer("postprocessing", tensors)
    assert result.as_numpy("finish_reason").tolist() == [[reason.encode()]]
    assert result.as_numpy("text_output").tolist() == [["Q: 你好? A: 😀 hi".encode()]]


def test_postprocessing_final_empty_piece_releases_held_bytes(client, smollm2_tokenizer):
    ids = smollm2_tokenizer.encode("ok 😀", add_special_tokens=False)[:-1]  # cut inside the emoji
    first, _ = postprocessing_inputs(ids, [], 0, len(ids))
    last, _ = postprocessing_inputs([], ids, 2, len(ids))
    texts = [client.infer("postprocessing", t).as_numpy("text_output")[0, 0].decode() for t in (first, last)]
    assert texts == ["ok ", "\ufffd"]
    assert "".join(texts) == smollm2_tokenizer.decode(ids)
