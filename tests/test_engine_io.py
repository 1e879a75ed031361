"""The engine model's response tensors (inflightllm/serving/engine_io.py `output_tensors`):
names, dtypes, shapes, values, and strides that Triton's DLPack import accepts."""

from __future__ import annotations

import torch

from inflightllm.engine import RequestOutput
from inflightllm.request import FinishReason
from inflightllm.sampling_params import SamplingParams
from inflightllm.serving.engine_io import EngineRequest, output_tensors


def _output(new, context, finished=False, reason=FinishReason.NONE, logprobs=(), top_ids=(), top_values=(),
            cum=0.0) -> RequestOutput:
    return RequestOutput("req-7", list(new), list(context), list(logprobs), [list(t) for t in top_ids],
                         [list(t) for t in top_values], cum, finished, reason, 3, 5, 2)


def _beam_output(beams, cums, logprobs=None, finished=False, reason=FinishReason.NONE) -> RequestOutput:
    output = _output(beams[0] if beams else [40], [], finished, reason, cum=cums[0] if cums else -0.5)
    output.beam_token_ids = [list(b) for b in beams]
    output.beam_cum_logprobs = list(cums)
    output.beam_scores = list(cums)
    output.beam_logprobs = logprobs if logprobs is not None else [[] for _ in beams]
    output.beam_pad_id = 2
    return output


def _request(echo=False, top_logprobs=0, logprobs=False) -> EngineRequest:
    params = SamplingParams(max_tokens=8, logprobs=top_logprobs > 0 or logprobs, top_logprobs=top_logprobs)
    return EngineRequest([11, 12, 13], params, 0, not echo, echo)


def _triton_accepts(tensor: torch.Tensor) -> bool:
    """Triton's check: row-major strides computed from the shape (the first axis unchecked)."""
    expected = 1
    for axis in range(tensor.dim() - 1, 0, -1):
        if tensor.stride(axis) != expected:
            return False
        expected *= tensor.shape[axis]
    return True


def test_a_streamed_piece_without_log_probs():
    tensors = output_tensors(_output([40, 41], [30, 31, 32]), _request(), handle=7)
    expected = {
        "request_handle": (torch.int64, [1, 1], [[7]]),
        "output_ids": (torch.int32, [1, 2], [[40, 41]]),
        "context_ids": (torch.int32, [1, 3], [[30, 31, 32]]),
        "finish_reason": (torch.int32, [1, 1], [[0]]),
        "num_input_tokens": (torch.int32, [1, 1], [[3]]),
        "num_output_tokens": (torch.int32, [1, 1], [[5]]),
        "num_cached_tokens": (torch.int32, [1, 1], [[2]]),
        "cum_log_probs": (torch.float32, [1, 1], [[0.0]]),
        "output_log_probs": (torch.float32, [1, 0], [[]]),
        "top_logprob_ids": (torch.int32, [1, 2, 0], [[[], []]]),
        "top_logprobs": (torch.float32, [1, 2, 0], [[[], []]]),
        "sequence_index": (torch.int32, [1, 1], [[0]]),
        "sequence_length": (torch.int32, [1, 1], [[2]]),
    }
    assert list(tensors) == list(expected)
    for name, (dtype, shape, values) in expected.items():
        tensor = tensors[name]
        assert (tensor.dtype, list(tensor.shape), tensor.tolist()) == (dtype, shape, values), name
        assert tensor.device.type == "cpu" and _triton_accepts(tensor), (name, tensor.stride())


def test_the_final_response_echoes_the_prompt_and_has_no_context():
    tensors = output_tensors(_output([40], [30], finished=True, reason=FinishReason.LENGTH), _request(echo=True))
    assert tensors["output_ids"].tolist() == [[11, 12, 13, 40]]
    assert tensors["context_ids"].tolist() == [[]] and list(tensors["context_ids"].shape) == [1, 0]
    assert tensors["finish_reason"].tolist() == [[int(FinishReason.LENGTH)]]
    assert all(_triton_accepts(tensor) for tensor in tensors.values())


def test_log_probs_and_top_log_probs():
    output = _output([40, 41], [], logprobs=[-0.5, -1.25], top_ids=[[40, 9], [41, 8]],
                     top_values=[[-0.5, -2.0], [-1.25, -3.0]], cum=-1.75)
    tensors = output_tensors(output, _request(top_logprobs=2))
    assert tensors["output_log_probs"].dtype == torch.float32
    assert tensors["output_log_probs"].tolist() == [[-0.5, -1.25]]
    assert tensors["cum_log_probs"].tolist() == [[-1.75]]
    assert tensors["top_logprob_ids"].dtype == torch.int32
    assert tensors["top_logprob_ids"].tolist() == [[[40, 9], [41, 8]]]
    assert tensors["top_logprobs"].tolist() == [[[-0.5, -2.0], [-1.25, -3.0]]]
    assert all(_triton_accepts(tensor) for tensor in tensors.values())


def test_responses_do_not_share_data():
    first = output_tensors(_output([40], [30]), _request())
    second = output_tensors(_output([41], [30, 40]), _request())
    assert first["output_ids"].tolist() == [[40]] and second["output_ids"].tolist() == [[41]]
    assert first["output_ids"].data_ptr() != second["output_ids"].data_ptr()


def test_scalars_are_right_whatever_the_value_and_shared_only_when_small():
    request = _request()
    seen = []
    for handle, (num_output, cum) in enumerate([(5, 0.0), (6, -0.25), (5, 0.0), (20000, -0.0), (-1, 1.5)]):
        output = RequestOutput("req-7", [40], [], [], [], [], cum, False, FinishReason.NONE, 3, num_output, 2)
        tensors = output_tensors(output, request, handle=handle % 2)
        assert tensors["request_handle"].tolist() == [[handle % 2]]
        assert tensors["num_output_tokens"].tolist() == [[num_output]]
        assert tensors["num_input_tokens"].tolist() == [[3]] and tensors["num_cached_tokens"].tolist() == [[2]]
        assert tensors["cum_log_probs"].tolist() == [[cum]]
        assert str(tensors["cum_log_probs"][0, 0].item()) == str(float(cum))  # -0.0 stays -0.0
        for name in ("request_handle", "finish_reason", "num_input_tokens", "num_output_tokens",
                     "num_cached_tokens", "cum_log_probs"):
            assert list(tensors[name].shape) == [1, 1] and _triton_accepts(tensors[name]), name
        seen.append(tensors)
    # Constant values: one tensor (never written to); large or negative counts: fresh ones.
    assert seen[0]["num_output_tokens"] is seen[2]["num_output_tokens"]
    assert seen[0]["request_handle"] is not seen[1]["request_handle"]
    assert seen[0]["request_handle"].tolist() == [[0]] and seen[1]["request_handle"].tolist() == [[1]]
    assert seen[3]["num_output_tokens"] is not output_tensors(
        RequestOutput("req-7", [40], [], [], [], [], 0.0, False, FinishReason.NONE, 3, 20000, 2), request
    )["num_output_tokens"]


def _packed_request(**kwargs) -> EngineRequest:
    request = _request(**kwargs)
    request.packed_outputs = True
    return request


def test_packed_responses_unpack_to_the_documented_tensors():
    """The ensemble's three tensors (inflightllm/packed_outputs.py) give postprocessing
    exactly the documented tensors: names, dtypes, shapes and values."""
    import numpy as np

    from inflightllm.packed_outputs import PACKED_F32, PACKED_I32, unpack

    cases = [
        (_output([40, 41], [7, 8, 9]), {}),
        (_output([], [5]), {}),  # nothing new (e.g. a stop string held the tokens back)
        (_output([42], [7], finished=True, reason=FinishReason.LENGTH, logprobs=[-0.5], cum=-1.25), {"echo": True}),
        (_output([40, 41], [], logprobs=[-0.1, -0.2], top_ids=[[40, 3], [41, 9]],
                 top_values=[[-0.1, -2.0], [-0.2, -3.5]], cum=-0.3), {"top_logprobs": 2}),
        # Beam search: every beam in one response, padded to the longest.
        (_beam_output([[40, 41], [40, 42], [43, 44]], [-0.5, -0.75, -1.5]), {}),
        (_beam_output([[40, 41, 45], [40], [43, 44]], [-0.5, -0.75, -1.5], [[-0.1, -0.2, -0.2], [-0.75], [-1, -0.5]],
                      finished=True, reason=FinishReason.STOP), {"echo": True, "logprobs": True}),
        (_beam_output([], [], finished=True, reason=FinishReason.CANCELLED), {}),  # cancelled before a beam step
    ]
    for output, kwargs in cases:
        classic = output_tensors(output, _request(**kwargs), handle=99)
        packed = output_tensors(output, _packed_request(**kwargs), handle=99)
        assert sorted(packed) == sorted(["request_handle", PACKED_I32, PACKED_F32])
        assert all(_triton_accepts(tensor) and tensor.shape[0] == 1 for tensor in packed.values())
        assert packed[PACKED_I32].dtype == torch.int32 and packed[PACKED_F32].dtype == torch.float32
        unpacked = unpack({name: tensor.numpy() for name, tensor in packed.items()})
        assert sorted(unpacked) == sorted(classic)
        for name, tensor in classic.items():
            expected = tensor.numpy()
            assert unpacked[name].dtype == expected.dtype, name
            assert unpacked[name].shape == expected.shape, (name, unpacked[name].shape, expected.shape)
            np.testing.assert_array_equal(unpacked[name], expected, err_msg=name)


def test_a_malformed_packed_response_is_refused_naming_the_problem():
    import numpy as np
    import pytest

    from inflightllm.packed_outputs import PACKED_F32, PACKED_I32, unpack

    packed = output_tensors(_output([40, 41], [7]), _packed_request(), handle=1)
    ints, floats = packed[PACKED_I32].numpy(), packed[PACKED_F32].numpy()
    with pytest.raises(ValueError, match="needs both"):
        unpack({PACKED_I32: ints})
    with pytest.raises(ValueError, match="header"):
        unpack({PACKED_I32: ints[:, :-1], PACKED_F32: floats})
    with pytest.raises(ValueError, match="header alone"):
        unpack({PACKED_I32: np.zeros((1, 3), np.int32), PACKED_F32: floats})


def test_a_beam_search_response_has_the_beam_dimension():
    """TensorRT-LLM's shapes: output_ids [1, beams, longest] padded with the end id,
    sequence_length and cum_log_probs [1, beams], output_log_probs [1, beams, longest]
    (padded with 0; empty rows unless the request asked for log probs); the prompt first
    in each beam when echoed."""
    output = _beam_output([[40, 41, 45], [40], [43, 44]], [-0.5, -0.75, -1.5],
                          [[-0.125, -0.25, -0.25], [-0.75], [-1.0, -0.5]], finished=True, reason=FinishReason.LENGTH)
    tensors = output_tensors(output, _request(logprobs=True), handle=7)
    assert tensors["output_ids"].tolist() == [[[40, 41, 45], [40, 2, 2], [43, 44, 2]]]
    assert tensors["sequence_length"].tolist() == [[3, 1, 2]]
    assert tensors["cum_log_probs"].tolist() == [[-0.5, -0.75, -1.5]]
    assert tensors["output_log_probs"].tolist() == [[[-0.125, -0.25, -0.25], [-0.75, 0.0, 0.0], [-1.0, -0.5, 0.0]]]
    assert tensors["finish_reason"].tolist() == [[2]] and tensors["sequence_index"].tolist() == [[0]]
    assert all(_triton_accepts(tensor) for tensor in tensors.values())
    quiet = output_tensors(output, _request(), handle=7)  # no log probs asked
    assert list(quiet["output_log_probs"].shape) == [1, 3, 0] and _triton_accepts(quiet["output_log_probs"])
    echoed = output_tensors(output, _request(echo=True), handle=7)
    assert echoed["output_ids"].tolist() == [[[11, 12, 13, 40, 41, 45], [11, 12, 13, 40, 2, 2],
                                              [11, 12, 13, 43, 44, 2]]]
    assert echoed["sequence_length"].tolist() == [[6, 4, 5]]


def test_a_malformed_packed_beam_response_is_refused_naming_the_problem():
    import numpy as np
    import pytest

    from inflightllm.packed_outputs import PACKED_F32, PACKED_I32, pack_beams, unpack

    packed = output_tensors(_beam_output([[40, 41], [42]], [-0.5, -1.0]), _packed_request(), handle=1)
    ints, floats = packed[PACKED_I32].numpy(), packed[PACKED_F32].numpy()
    with pytest.raises(ValueError, match="id lengths"):
        unpack({PACKED_I32: ints[:, :-1], PACKED_F32: floats})
    with pytest.raises(ValueError, match="cumulative log probs"):
        unpack({PACKED_I32: ints, PACKED_F32: np.zeros((1, 1), np.float32)})
    with pytest.raises(ValueError, match="the same number of each"):
        pack_beams(finish_reason=0, num_input_tokens=1, num_output_tokens=1, num_cached_tokens=0,
                   beam_token_ids=[[1], [2]], beam_cum_logprobs=[-1.0], beam_logprobs=[[], []], pad_id=0)


def test_request_scalars_are_read_whatever_their_shape_and_more_than_one_value_is_refused():
    """parse_engine_request reads each per-request scalar ([1] or [1, 1]); two values for one
    is refused naming the input and the shape it got."""
    import pytest

    from inflightllm.sampling_params import InvalidRequestError
    from tests.test_engine_loop import engine_request

    parsed = engine_request([5, 6, 7], 9, temperature=0.5, seed=-1, top_k=3, priority=2)
    assert parsed.prompt_token_ids == [5, 6, 7]
    params = parsed.params
    assert (params.max_tokens, params.temperature, params.top_k, params.seed) == (9, 0.5, 3, None)
    assert parsed.priority == 2 and parsed.streaming is True
    with pytest.raises(InvalidRequestError, match=r"top_p: expected one value per request, got shape \[1, 1, 2\]"):
        engine_request([5, 6, 7], 9, top_p=[0.5, 0.9])
    with pytest.raises(InvalidRequestError, match="input_length: 4 does not match the 3 tokens"):
        engine_request([5, 6, 7], 9, input_length=4)
