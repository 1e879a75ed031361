"""`preprocessing` and `postprocessing` in a real tritonserver, over gRPC.

Both run in the shared `model_repo_server` (the committed `model_repo/`), called directly
with non-streaming `infer` (they are not decoupled: postprocessing has one instance there).
Input types and output names come from the server's model metadata, i.e. from the rendered
configs (docs/INTERFACE.md).
"""

from __future__ import annotations

import json
import queue
import random

import numpy as np
import pytest

from inflightllm.detokenizer import CONTEXT_WINDOW

pytestmark = pytest.mark.server

IM_END = 2


@pytest.fixture(scope="module")
def client(model_repo_server):
    import tritonclient.grpc as grpcclient

    with grpcclient.InferenceServerClient(model_repo_server.grpc_url) as grpc_client:
        yield grpc_client


@pytest.fixture(scope="module")
def preprocessing_metadata(client) -> dict:
    """`{"inputs": {name: datatype}, "outputs": [names]}` of the served preprocessing model."""
    metadata = client.get_model_metadata("preprocessing", as_json=True)
    return {
        "inputs": {tensor["name"]: tensor["datatype"] for tensor in metadata["inputs"]},
        "outputs": [tensor["name"] for tensor in metadata["outputs"]],
    }


# ---------------------------------------------------------------- request helpers

_NUMPY_TYPES = {
    "BYTES": object, "BOOL": np.bool_, "INT32": np.int32, "INT64": np.int64, "UINT64": np.uint64, "FP32": np.float32
}


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


def preprocessing_inputs(metadata: dict, prompt: str | None = None, max_tokens: int = 16, **extra):
    inputs = [infer_input("max_tokens", "INT32", max_tokens)]
    if prompt is not None:
        inputs.append(infer_input("text_input", "BYTES", prompt))
    for name, value in extra.items():
        inputs.append(infer_input(name, metadata["inputs"][name], value))
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
def test_preprocessing_input_ids_equal_transformers(client, preprocessing_metadata, smollm2_tokenizer, prompt):
    result = client.infer("preprocessing", preprocessing_inputs(preprocessing_metadata, prompt, max_tokens=7))
    out = outputs_of(result, preprocessing_metadata["outputs"])
    assert all(array is not None for array in out.values()), out  # every output, defaults filled in
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


def test_preprocessing_chat_form(client, preprocessing_metadata, smollm2_tokenizer):
    messages = [{"role": "user", "content": "Bonjour 😀, 你好?"}]
    result = client.infer(
        "preprocessing", preprocessing_inputs(preprocessing_metadata, max_tokens=5, messages=json.dumps(messages, ensure_ascii=False))
    )
    expected = smollm2_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    expected = list(expected["input_ids"] if hasattr(expected, "keys") else expected)
    assert result.as_numpy("input_ids").tolist() == [expected]
    assert expected[-3:] == [520, 9531, 198]  # "assistant\n" of the generation prompt


def test_preprocessing_words_and_sampling_parameters(client, preprocessing_metadata):
    result = client.infer(
        "preprocessing",
        preprocessing_inputs(
            preprocessing_metadata,
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


def test_bad_request_fails_alone_while_concurrent_good_ones_succeed(client, preprocessing_metadata, smollm2_tokenizer):
    from tritonclient.utils import InferenceServerException

    results: queue.Queue = queue.Queue()
    kinds = ["good", "bad"] * 6
    for index, kind in enumerate(kinds):
        temperature = 0.5 if kind == "good" else -0.5
        inputs = preprocessing_inputs(preprocessing_metadata, f"request {index} 😀", temperature=temperature)
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


def test_preprocessing_error_messages_reach_the_client(client, preprocessing_metadata):
    from tritonclient.utils import InferenceServerException

    with pytest.raises(InferenceServerException) as info:
        client.infer("preprocessing", preprocessing_inputs(preprocessing_metadata, "Hi", sampling_parameters='{"temprature": 1}'))
    assert info.value.message().startswith("sampling_parameters: unknown key 'temprature'; allowed keys: temperature, ")
    with pytest.raises(InferenceServerException) as info:
        client.infer("preprocessing", preprocessing_inputs(preprocessing_metadata, "Hi", max_tokens=5000))
    assert info.value.message() == (
        "input 'max_tokens': 5000 is out of range; allowed: 1 to 1024 (the profile's max_output_len)"
    )


# ---------------------------------------------------------------- postprocessing

STREAM_TEXT = "Sure! 😀 Here: 你好世界, 👨\u200d👩\u200d👧 and 🇫🇷🇯🇵 — café.\n  Done"


def postprocessing_inputs(output_ids, context_ids, finish_reason, num_output_tokens, top_k=2):
    """One engine response as the engine sends it inside the ensemble: packed
    (inflightllm/packed_outputs.py; log probs made up)."""
    import tritonclient.grpc as grpcclient

    from inflightllm.packed_outputs import PACKED_F32, PACKED_I32, pack

    count = len(output_ids)
    rng = np.random.default_rng(count * 1000 + num_output_tokens)
    output_log_probs = (-rng.random(count)).astype(np.float32)
    top_ids = rng.integers(0, 49152, size=(1, count, top_k)).astype(np.int32)
    top_logprobs = (-rng.random((1, count, top_k))).astype(np.float32)
    ints, floats = pack(
        finish_reason=finish_reason, num_input_tokens=11, num_output_tokens=num_output_tokens, num_cached_tokens=4,
        output_ids=list(output_ids), context_ids=list(context_ids), cum_log_probs=float(output_log_probs.sum()),
        output_log_probs=output_log_probs.tolist(), top_logprob_ids=top_ids[0].tolist(),
        top_logprobs=top_logprobs[0].tolist(), top_k=top_k, num_top_rows=count,
    )
    tensors = [infer_input("request_handle", "INT64", 12345)]  # the engine's id; used only to relay cancellations
    for name, datatype, array in ((PACKED_I32, "INT32", ints), (PACKED_F32, "FP32", floats)):
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
