"""The engine's response to postprocessing in three tensors instead of eleven.

Every response the engine model sends costs a round trip to the server per response and
a shared-memory copy per tensor, in the engine's own process (where the engine loop
shares the GIL with the sender), in tritonserver's ensemble and again in postprocessing.
With the documented outputs that is eleven tensors per streamed response, most of them a
single number. Inside the ensemble the engine sends the same values packed:

- `request_handle` INT64 [1], unchanged (postprocessing reads it alone to relay a
  cancellation);
- `engine_out_i32` INT32 [-1]: the header below (its last value is the engine's piece
  ledger id), then `output_ids`, `context_ids` and the `top_logprob_ids`
  rows (row-major);
- `engine_out_f32` FP32 [-1]: `cum_log_probs`, then `output_log_probs` and the
  `top_logprobs` rows.

A beam search response (`num_beams` > 0 in the header, `pack_beams`) carries every beam:
after the header, each beam's number of ids and of log probs, then the beams' ids one
after another (no context ids, no top log probs); the floats are each beam's cumulative
log prob, then the beams' log probs one after another. `unpack` gives it the beam
dimension TensorRT-LLM's outputs have: `output_ids` [1, beams, longest] padded with the
header's `pad_id`, `sequence_length` [1, beams], `cum_log_probs` [1, beams],
`output_log_probs` [1, beams, longest] padded with 0.

The engine sends them when a request asks for `engine_out_i32` (the ensemble does); a
client that calls `engine` directly and asks for the documented names gets those.
`unpack` gives postprocessing the documented tensors back, with the shapes they have
when sent one by one (docs/INTERFACE.md, "engine -> postprocessing"). NumPy only: the
postprocessing environment has no torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

PACKED_I32 = "engine_out_i32"
PACKED_F32 = "engine_out_f32"

# engine_out_i32[0:HEADER_LEN]
HEADER = (
    "finish_reason",
    "num_input_tokens",
    "num_output_tokens",
    "num_cached_tokens",
    "num_output_ids",  # length of output_ids
    "num_context_ids",  # length of context_ids
    "num_log_probs",  # length of output_log_probs
    "num_top_rows",  # rows of top_logprob_ids / top_logprobs
    "top_k",  # their columns
    "sender",  # the engine's piece ledger id (0: none), where postprocessing counts answered pieces (inflightllm/piece_ledger.py)
    "sequence_index",  # which output of the request (n > 1: docs/SEQUENCE-GROUPS.md); 0 otherwise
    "num_beams",  # beam search: the beams this response carries (pack_beams); 0 otherwise
    "pad_id",  # beam search: what pads the beams' output_ids to one length
    "ticket",  # the piece's slot in the sender's ledger, marked when postprocessing has sent it on (-1: none)
)
HEADER_LEN = len(HEADER)


def pack(
    *,
    finish_reason: int,
    num_input_tokens: int,
    num_output_tokens: int,
    num_cached_tokens: int,
    output_ids: Sequence[int],
    context_ids: Sequence[int],
    cum_log_probs: float,
    output_log_probs: Sequence[float],
    top_logprob_ids: Sequence[Sequence[int]],
    top_logprobs: Sequence[Sequence[float]],
    top_k: int,
    num_top_rows: int,
    sender: int = 0,
    sequence_index: int = 0,
    ticket: int = -1,
) -> tuple[np.ndarray, np.ndarray]:
    """(engine_out_i32, engine_out_f32), each [1, n] (leading batch dimension 1).
    `num_top_rows`: the generated tokens of this response (the top log prob tensors are
    [1, num_top_rows, top_k], also when top_k is 0)."""
    rows = num_top_rows
    if top_k and len(top_logprob_ids) != rows:
        raise ValueError(f"top log probs: {len(top_logprob_ids)} rows for {rows} generated tokens")
    ints = [finish_reason, num_input_tokens, num_output_tokens, num_cached_tokens,
            len(output_ids), len(context_ids), len(output_log_probs), rows, top_k, sender, sequence_index, 0, 0, ticket]
    ints += output_ids
    ints += context_ids
    floats = [cum_log_probs]
    floats += output_log_probs
    if top_k:
        for ids, values in zip(top_logprob_ids, top_logprobs, strict=True):
            if len(ids) != top_k or len(values) != top_k:
                raise ValueError(f"top log probs: a row of {len(ids)} ids / {len(values)} values, expected {top_k}")
            ints += ids
            floats += values
    return np.array(ints, np.int32).reshape(1, -1), np.array(floats, np.float32).reshape(1, -1)


def pack_beams(
    *,
    finish_reason: int,
    num_input_tokens: int,
    num_output_tokens: int,
    num_cached_tokens: int,
    beam_token_ids: Sequence[Sequence[int]],
    beam_cum_logprobs: Sequence[float],
    beam_logprobs: Sequence[Sequence[float]],
    pad_id: int,
    sender: int = 0,
    ticket: int = -1,
) -> tuple[np.ndarray, np.ndarray]:
    """(engine_out_i32, engine_out_f32) of a beam search response, each [1, n]: every beam's
    ids (the prompt first where echoed), cumulative log prob and per-token log probs
    (empty lists when not asked), best first."""
    num_beams = len(beam_token_ids)
    if not num_beams or len(beam_cum_logprobs) != num_beams or len(beam_logprobs) != num_beams:
        raise ValueError(f"beams: {num_beams} id lists, {len(beam_cum_logprobs)} cumulative log probs and "
                         f"{len(beam_logprobs)} log prob lists; expected one or more beams, the same number of each")
    id_lengths = [len(ids) for ids in beam_token_ids]
    logprob_lengths = [len(values) for values in beam_logprobs]
    ints = [finish_reason, num_input_tokens, num_output_tokens, num_cached_tokens,
            sum(id_lengths), 0, sum(logprob_lengths), 0, 0, sender, 0, num_beams, pad_id, ticket]
    ints += id_lengths
    ints += logprob_lengths
    for ids in beam_token_ids:
        ints += ids
    floats = list(beam_cum_logprobs)
    for values in beam_logprobs:
        floats += values
    return np.array(ints, np.int32).reshape(1, -1), np.array(floats, np.float32).reshape(1, -1)


def pad_rows(rows: Sequence[np.ndarray], dtype, pad) -> np.ndarray:
    """[1, len(rows), longest] with each row's values first, then `pad`."""
    longest = max((len(row) for row in rows), default=0)
    padded = np.full((1, len(rows), longest), pad, dtype=dtype)
    for index, row in enumerate(rows):
        padded[0, index, : len(row)] = row
    return padded


def _unpack_beams(header: dict[str, int], ints: np.ndarray, floats: np.ndarray) -> dict[str, np.ndarray]:
    beams = header["num_beams"]
    at = HEADER_LEN
    if len(ints) < at + 2 * beams or len(floats) < beams:
        raise ValueError(f"packed beam response: header {header} needs {2 * beams} lengths after it and "
                         f"{beams} cumulative log probs; got {len(ints)} int32 and {len(floats)} float32 values")
    id_lengths = ints[at:at + beams]
    logprob_lengths = ints[at + beams:at + 2 * beams]
    at += 2 * beams
    want_i, want_f = at + int(id_lengths.sum()), beams + int(logprob_lengths.sum())
    if (id_lengths < 0).any() or (logprob_lengths < 0).any() or len(ints) != want_i or len(floats) != want_f \
            or int(id_lengths.sum()) != header["num_output_ids"]:
        raise ValueError(f"packed beam response: header {header}, id lengths {id_lengths.tolist()} and log prob "
                         f"lengths {logprob_lengths.tolist()} need {want_i} int32 and {want_f} float32 values, "
                         f"got {len(ints)} and {len(floats)}")
    ids, values = [], []
    for length in id_lengths.tolist():
        ids.append(ints[at:at + length])
        at += length
    at = beams
    for length in logprob_lengths.tolist():
        values.append(floats[at:at + length])
        at += length
    return {
        "output_ids": pad_rows(ids, np.int32, header["pad_id"]),
        "sequence_length": id_lengths.astype(np.int32).reshape(1, beams),
        "context_ids": np.zeros((1, 0), np.int32),
        "finish_reason": np.array([[header["finish_reason"]]], np.int32),
        "num_input_tokens": np.array([[header["num_input_tokens"]]], np.int32),
        "num_output_tokens": np.array([[header["num_output_tokens"]]], np.int32),
        "num_cached_tokens": np.array([[header["num_cached_tokens"]]], np.int32),
        "sequence_index": np.zeros((1, 1), np.int32),
        "cum_log_probs": floats[:beams].reshape(1, beams),
        "output_log_probs": pad_rows(values, np.float32, 0.0),
        "top_logprob_ids": np.zeros((1, 0, 0), np.int32),
        "top_logprobs": np.zeros((1, 0, 0), np.float32),
    }


def _header_value(inputs: Mapping[str, np.ndarray | None], name: str, missing: int) -> int:
    """One header value of a packed response (`missing` when it is not a well-formed one)."""
    ints = inputs.get(PACKED_I32)
    if ints is None:
        return missing
    ints = np.asarray(ints).reshape(-1)
    return int(ints[HEADER.index(name)]) if len(ints) >= HEADER_LEN else missing


def sender(inputs: Mapping[str, np.ndarray | None]) -> int:
    """The piece ledger id of the engine that sent this packed response (0: none, or not a
    well-formed packed response)."""
    return _header_value(inputs, "sender", 0)


def ticket(inputs: Mapping[str, np.ndarray | None]) -> int:
    """The piece's ticket in its sender's ledger (-1: none, or not a well-formed packed response)."""
    return _header_value(inputs, "ticket", -1)


def unpack(inputs: Mapping[str, np.ndarray | None]) -> dict[str, np.ndarray]:
    """The documented "engine -> postprocessing" tensors from a packed response (the
    `request_handle` passes through). Raises ValueError naming what is inconsistent."""
    ints = inputs.get(PACKED_I32)
    floats = inputs.get(PACKED_F32)
    if ints is None or floats is None:
        raise ValueError(f"a packed engine response needs both {PACKED_I32} and {PACKED_F32}")
    ints = np.asarray(ints).reshape(-1)
    floats = np.asarray(floats).reshape(-1)
    if len(ints) < HEADER_LEN or len(floats) < 1:
        raise ValueError(f"{PACKED_I32} has {len(ints)} values (its header alone is {HEADER_LEN}); "
                         f"{PACKED_F32} has {len(floats)} (at least 1)")
    header = dict(zip(HEADER, (int(v) for v in ints[:HEADER_LEN]), strict=True))
    if header["num_beams"] > 0:
        unpacked = _unpack_beams(header, ints, floats)
        if inputs.get("request_handle") is not None:
            unpacked["request_handle"] = inputs["request_handle"]
        return unpacked
    n_out, n_ctx, n_lp = header["num_output_ids"], header["num_context_ids"], header["num_log_probs"]
    rows, k = header["num_top_rows"], header["top_k"]
    want_i, want_f = HEADER_LEN + n_out + n_ctx + rows * k, 1 + n_lp + rows * k
    if min(n_out, n_ctx, n_lp, rows, k) < 0 or len(ints) != want_i or len(floats) != want_f:
        raise ValueError(f"packed engine response: header {header} needs {want_i} int32 and {want_f} float32 "
                         f"values, got {len(ints)} and {len(floats)}")
    at = HEADER_LEN
    output_ids = ints[at:at + n_out]
    at += n_out
    context_ids = ints[at:at + n_ctx]
    at += n_ctx
    unpacked = {
        "output_ids": output_ids.reshape(1, n_out),
        "context_ids": context_ids.reshape(1, n_ctx),
        "finish_reason": np.array([[header["finish_reason"]]], np.int32),
        "num_input_tokens": np.array([[header["num_input_tokens"]]], np.int32),
        "num_output_tokens": np.array([[header["num_output_tokens"]]], np.int32),
        "num_cached_tokens": np.array([[header["num_cached_tokens"]]], np.int32),
        "sequence_index": np.array([[header["sequence_index"]]], np.int32),
        "sequence_length": np.array([[n_out]], np.int32),
        "cum_log_probs": floats[:1].reshape(1, 1),
        "output_log_probs": floats[1:1 + n_lp].reshape(1, n_lp),
        "top_logprob_ids": ints[at:].reshape(1, rows, k),
        "top_logprobs": floats[1 + n_lp:].reshape(1, rows, k),
    }
    handle = inputs.get("request_handle")
    if handle is not None:
        unpacked["request_handle"] = handle
    return unpacked
