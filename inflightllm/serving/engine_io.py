"""The engine model's tensors <-> engine requests and outputs (docs/INTERFACE.md).

Pure torch at the edges: the Triton adapter moves tensors by DLPack and calls these
functions, so the same code serves CPU and GPU hosts whatever their NumPy.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from inflightllm import packed_outputs
from inflightllm.engine import RequestOutput
from inflightllm.guided.spec import KIND_BY_CODE, GuidedSpec
from inflightllm.sampling_params import InvalidRequestError, SamplingParams
from inflightllm.sequence_group import GroupParams
from inflightllm.text.preprocess import EARLY_STOPPING_CODES, ENGINE_REQUEST_DTYPES
from inflightllm.token_sequences import unpack_token_sequences

# The generation inputs of the engine model: exactly what preprocessing emits. The
# structured-output pair is optional (a client of the engine model alone may leave it out).
ENGINE_INPUTS = tuple(ENGINE_REQUEST_DTYPES)
OPTIONAL_INPUTS = ("guided_type", "guided_guide")


@dataclass
class EngineRequest:
    """One parsed engine-model request."""

    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    streaming: bool
    echo_prompt: bool  # non-streaming and not exclude_input_in_output: output starts with the prompt
    timeout_ms: int = 0  # longest wait in the queue; 0 = the profile's default_timeout_microseconds
    arrival_time: float | None = None  # monotonic time it reached the engine model (queue timeouts count from it)
    # The responses carry `request_handle` + the two packed tensors (inflightllm/packed_outputs.py)
    # instead of the eleven documented ones: the ensemble asks for them.
    packed_outputs: bool = False
    # (handle, its `request_handle` tensor): built once, the same in every response of the request.
    handle_tensor: tuple[int, torch.Tensor] | None = field(default=None, repr=False, compare=False)
    group: GroupParams | None = None  # several outputs (n, best_of, beam search); None: one


def _scalar(inputs: dict[str, torch.Tensor], name: str):
    tensor = inputs[name]
    if tensor.numel() != 1:
        raise InvalidRequestError(f"{name}: expected one value per request, got shape {list(tensor.shape)}")
    return tensor.item()  # any shape of one element: ~0.15 us, where reshape(-1)[0].item() is ~2 us


def _guided_spec(inputs: dict[str, torch.Tensor]) -> GuidedSpec | None:
    """The structured-output constraint of `guided_type` (a kind's code, 0 = none) and
    `guided_guide` (its text as UTF-8 bytes)."""
    if "guided_type" not in inputs:
        return None
    code = int(_scalar(inputs, "guided_type"))
    if code == 0:
        return None
    kind = KIND_BY_CODE.get(code)
    if kind is None:
        raise InvalidRequestError(
            f"guided_type: {code} is not a constraint kind; allowed: 0 (none) or "
            + ", ".join(f"{c} ({k})" for c, k in KIND_BY_CODE.items())
        )
    if kind == "json_object":
        return GuidedSpec(kind)
    guide = inputs.get("guided_guide")
    if guide is None:
        raise InvalidRequestError(f"guided_guide: missing; guided_type {code} ({kind}) needs its text")
    try:
        text = guide.reshape(-1).to(torch.uint8).numpy().tobytes().decode("utf-8")
    except UnicodeDecodeError as error:
        raise InvalidRequestError(f"guided_guide: the text is not valid UTF-8 ({error})") from None
    return GuidedSpec(kind, text)


def parse_engine_request(inputs: dict[str, torch.Tensor]) -> EngineRequest:
    """Validate the engine model's inputs (tensors with the leading batch dim) and
    build an EngineRequest. Ranges are checked by the engine on add_request."""
    missing = [name for name in ENGINE_INPUTS if name not in inputs and name not in OPTIONAL_INPUTS]
    if missing:
        raise InvalidRequestError(f"missing inputs: {', '.join(missing)}")
    input_ids = inputs["input_ids"]
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise InvalidRequestError(
            f"input_ids: expected shape [1, num_tokens] (one prompt per request), got {list(input_ids.shape)}"
        )
    prompt = input_ids[0].tolist()
    length = int(_scalar(inputs, "input_length"))
    if length != len(prompt):
        raise InvalidRequestError(f"input_length: {length} does not match the {len(prompt)} tokens of input_ids")
    seed = int(_scalar(inputs, "seed"))
    end_id = int(_scalar(inputs, "end_id"))
    streaming = bool(_scalar(inputs, "streaming"))
    params = SamplingParams(
        max_tokens=int(_scalar(inputs, "max_tokens")),
        min_tokens=int(_scalar(inputs, "min_tokens")),
        temperature=float(_scalar(inputs, "temperature")),
        top_k=int(_scalar(inputs, "top_k")),
        top_p=float(_scalar(inputs, "top_p")),
        min_p=float(_scalar(inputs, "min_p")),
        repetition_penalty=float(_scalar(inputs, "repetition_penalty")),
        presence_penalty=float(_scalar(inputs, "presence_penalty")),
        frequency_penalty=float(_scalar(inputs, "frequency_penalty")),
        seed=None if seed < 0 else seed,
        stop_sequences=unpack_token_sequences(inputs["stop_words"].reshape(-1).tolist(), "stop_words"),
        bad_words=unpack_token_sequences(inputs["bad_words"].reshape(-1).tolist(), "bad_words"),
        end_id=None if end_id < 0 else end_id,
        ignore_eos=bool(_scalar(inputs, "ignore_eos")),
        logprobs=bool(_scalar(inputs, "return_log_probs")),
        top_logprobs=int(_scalar(inputs, "num_top_logprobs")),
        guided=_guided_spec(inputs),
    )
    early_stopping = int(_scalar(inputs, "early_stopping"))
    by_code = {code: value for value, code in EARLY_STOPPING_CODES.items()}
    if early_stopping not in by_code:
        raise InvalidRequestError(
            f"early_stopping: {early_stopping} is out of range; allowed: 0 (false), 1 (true) or 2 (\"never\")")
    best_of = int(_scalar(inputs, "best_of"))
    group = GroupParams(
        n=int(_scalar(inputs, "n")),
        best_of=best_of if best_of > 0 else None,
        beam_width=int(_scalar(inputs, "beam_width")),
        length_penalty=float(_scalar(inputs, "length_penalty")),
        early_stopping=by_code[early_stopping],
    )
    return EngineRequest(
        group=group if group != GroupParams() else None,
        prompt_token_ids=prompt,
        params=params,
        priority=int(_scalar(inputs, "priority")),
        streaming=streaming,
        echo_prompt=not streaming and not bool(_scalar(inputs, "exclude_input_in_output")),
        timeout_ms=int(_scalar(inputs, "timeout_ms")),
        arrival_time=time.monotonic(),
    )


def _dense(tensor: torch.Tensor) -> torch.Tensor:
    """A zero-size tensor with the strides Triton's DLPack import accepts.

    torch gives a [1, n, 0] tensor strides (n, 1, 1); Triton checks row-major strides
    computed from the shape, (0, 0, 1), and rejects the tensor as not contiguous.
    """
    if tensor.numel() != 0:
        return tensor.contiguous()
    strides = [1] * tensor.dim()
    for axis in range(tensor.dim() - 2, -1, -1):
        strides[axis] = strides[axis + 1] * tensor.shape[axis + 1]
    return torch.empty(0, dtype=tensor.dtype).as_strided(tuple(tensor.shape), tuple(strides))


_EMPTY: dict[tuple, torch.Tensor] = {}  # (shape, dtype) -> a zero-size tensor (no data: shared by responses)


def _array(values, dtype: np.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """`values` as a torch tensor of `shape` (leading batch dim 1), built through NumPy.

    Built for every streamed response, eleven times: `torch.tensor` costs ~3 us a call,
    `torch.from_numpy(np.array(...))` ~1 us. Zero-size ones come from a cache with the
    strides Triton accepts (`_dense`); no response writes into a tensor it sent."""
    if 0 in shape:
        key = (shape, dtype)
        empty = _EMPTY.get(key)
        if empty is None:
            empty = _EMPTY[key] = _dense(torch.from_numpy(np.zeros(shape, dtype=dtype)))
        return empty
    return torch.from_numpy(np.array(values, dtype=dtype).reshape(shape))


# [1, 1] int32 tensors of the counts and codes below INT32_SCALAR_CACHE_LIMIT, built once
# per process and shared by every response that carries that value (finish reason, token
# counts): like the zero-size ones, never written to; Triton copies a response's tensors
# into its shared memory when the response is sent. At most INT32_SCALAR_CACHE_LIMIT small
# tensors are ever held.
INT32_SCALAR_CACHE_LIMIT = 8192
_INT32_SCALARS: dict[int, torch.Tensor] = {}
_FLOAT32_ZERO = torch.zeros((1, 1), dtype=torch.float32)


def _int32_scalar(value: int) -> torch.Tensor:
    """`value` as a [1, 1] int32 tensor (shared for small non-negative values)."""
    tensor = _INT32_SCALARS.get(value)
    if tensor is None:
        tensor = torch.from_numpy(np.array(value, dtype=np.int32).reshape(1, 1))
        if 0 <= value < INT32_SCALAR_CACHE_LIMIT:
            _INT32_SCALARS[value] = tensor
    return tensor


def _float32_scalar(value: float) -> torch.Tensor:
    """`value` as a [1, 1] float32 tensor (+0.0, a request without log probs, shared)."""
    if value == 0.0 and math.copysign(1.0, value) > 0:
        return _FLOAT32_ZERO
    return torch.from_numpy(np.array(value, dtype=np.float32).reshape(1, 1))


def output_tensors(output: RequestOutput, request: EngineRequest, handle: int = 0,
                   ledger_id: int = 0, ticket: int = -1) -> dict[str, torch.Tensor]:
    """The engine model's response tensors for one output (leading batch dim 1): the
    documented ones, or `request_handle` and the two packed ones when the request asked
    for those (`request.packed_outputs`, the ensemble's case). A beam search output gets
    the beam dimension (`_beam_tensors`).

    `handle` identifies the request to the engine (postprocessing sends it back in a
    `cancel_request` control request when the client cancels); `ledger_id` names, in a
    packed response, where postprocessing counts it answered, and `ticket` the piece's slot
    there, which postprocessing marks once it has sent the piece on (inflightllm/piece_ledger.py)."""
    if output.beam_token_ids is not None:
        return _beam_tensors(output, request, handle, ledger_id, ticket)
    token_ids = output.new_token_ids
    context = output.context_ids
    if request.echo_prompt and (output.finished if output.sequence_finished is None else output.sequence_finished):
        token_ids = request.prompt_token_ids + token_ids
        context = []
    top_k = request.params.top_logprobs
    num_new = len(output.new_token_ids)
    if not (top_k and output.new_top_ids):
        top_k = 0
    cached_handle = _handle_tensor(request, handle)
    if request.packed_outputs:
        ints, floats = packed_outputs.pack(
            finish_reason=int(output.finish_reason), num_input_tokens=output.num_prompt_tokens,
            num_output_tokens=output.num_output_tokens, num_cached_tokens=output.num_cached_tokens,
            output_ids=token_ids, context_ids=context, cum_log_probs=output.cum_logprob,
            output_log_probs=output.new_logprobs, top_logprob_ids=output.new_top_ids,
            top_logprobs=output.new_top_logprobs, top_k=top_k, num_top_rows=num_new,
            sender=ledger_id, sequence_index=output.sequence_index, ticket=ticket,
        )
        return {
            "request_handle": cached_handle[1],
            packed_outputs.PACKED_I32: torch.from_numpy(ints),
            packed_outputs.PACKED_F32: torch.from_numpy(floats),
        }
    int32, float32 = np.int32, np.float32
    return {
        "request_handle": cached_handle[1],
        "output_ids": _array(token_ids, int32, (1, len(token_ids))),
        "context_ids": _array(context, int32, (1, len(context))),
        "finish_reason": _int32_scalar(int(output.finish_reason)),
        "num_input_tokens": _int32_scalar(output.num_prompt_tokens),
        "num_output_tokens": _int32_scalar(output.num_output_tokens),
        "num_cached_tokens": _int32_scalar(output.num_cached_tokens),
        "cum_log_probs": _float32_scalar(output.cum_logprob),
        "output_log_probs": _array(output.new_logprobs, float32, (1, len(output.new_logprobs))),
        "top_logprob_ids": _array(output.new_top_ids, int32, (1, num_new, top_k)),
        "top_logprobs": _array(output.new_top_logprobs, float32, (1, num_new, top_k)),
        "sequence_index": _int32_scalar(output.sequence_index),
        "sequence_length": _int32_scalar(len(token_ids)),
    }


def _handle_tensor(request: EngineRequest, handle: int) -> tuple[int, torch.Tensor]:
    cached = request.handle_tensor
    if cached is None or cached[0] != handle:
        cached = request.handle_tensor = (handle, _array(handle, np.int64, (1, 1)))
    return cached


def _beam_tensors(output: RequestOutput, request: EngineRequest, handle: int,
                  ledger_id: int, ticket: int = -1) -> dict[str, torch.Tensor]:
    """A beam search response: every beam at once, best first, with TensorRT-LLM's beam
    dimension (`output_ids` [1, beams, longest] padded with the end id, `sequence_length`,
    `cum_log_probs` [1, beams], `output_log_probs` [1, beams, longest] when asked); each
    beam's whole ids so far, since beams change from step to step."""
    beams = [list(ids) for ids in output.beam_token_ids]
    cums = list(output.beam_cum_logprobs or [])
    logprobs = [list(values) for values in output.beam_logprobs or [[] for _ in beams]]
    if not beams:  # cancelled before the first beam step: the one sequence's output
        beams, cums, logprobs = [list(output.new_token_ids)], [output.cum_logprob], [[]]
    if not request.params.logprobs:
        logprobs = [[] for _ in beams]
    if request.echo_prompt and output.finished:
        beams = [request.prompt_token_ids + ids for ids in beams]
    cached_handle = _handle_tensor(request, handle)
    counts = dict(finish_reason=int(output.finish_reason), num_input_tokens=output.num_prompt_tokens,
                  num_output_tokens=output.num_output_tokens, num_cached_tokens=output.num_cached_tokens)
    if request.packed_outputs:
        ints, floats = packed_outputs.pack_beams(
            **counts, beam_token_ids=beams, beam_cum_logprobs=cums, beam_logprobs=logprobs,
            pad_id=output.beam_pad_id, sender=ledger_id, ticket=ticket)
        return {
            "request_handle": cached_handle[1],
            packed_outputs.PACKED_I32: torch.from_numpy(ints),
            packed_outputs.PACKED_F32: torch.from_numpy(floats),
        }
    int32, float32 = np.int32, np.float32
    rows = [np.array(ids, int32) for ids in beams]
    return {
        "request_handle": cached_handle[1],
        "output_ids": _dense(torch.from_numpy(packed_outputs.pad_rows(rows, int32, output.beam_pad_id))),
        "context_ids": _array([], int32, (1, 0)),
        **{name: _int32_scalar(value) for name, value in counts.items()},
        "cum_log_probs": _array(cums, float32, (1, len(cums))),
        "output_log_probs": _dense(torch.from_numpy(
            packed_outputs.pad_rows([np.array(v, float32) for v in logprobs], float32, 0.0))),
        "top_logprob_ids": _array([], int32, (1, 0, 0)),
        "top_logprobs": _array([], float32, (1, 0, 0)),
        "sequence_index": _int32_scalar(0),
        "sequence_length": _array([len(ids) for ids in beams], int32, (1, len(beams))),
    }
