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
    "sequence_index",  # which output of the request (n > 1, beams: docs/SEQUENCE-GROUPS.md); 0 otherwise
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
) -> tuple[np.ndarray, np.ndarray]:
    """(engine_out_i32, engine_out_f32), each [1, n] (leading batch dimension 1).
    `num_top_rows`: the generated tokens of this response (the top log prob tensors are
    [1, num_top_rows, top_k], also when top_k is 0)."""
    rows = num_top_rows
    if top_k and len(top_logprob_ids) != rows:
        raise ValueError(f"top log probs: {len(top_logprob_ids)} rows for {rows} generated tokens")
    ints = [finish_reason, num_input_tokens, num_output_tokens, num_cached_tokens,
            len(output_ids), len(context_ids), len(output_log_probs), rows, top_k, sender, sequence_index]
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


def sender(inputs: Mapping[str, np.ndarray | None]) -> int:
    """The piece ledger id of the engine that sent this packed response (0: none, or not a
    well-formed packed response)."""
    ints = inputs.get(PACKED_I32)
    if ints is None:
        return 0
    ints = np.asarray(ints).reshape(-1)
    return int(ints[HEADER.index("sender")]) if len(ints) >= HEADER_LEN else 0


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
        "cum_log_probs": floats[:1].reshape(1, 1),
        "output_log_probs": floats[1:1 + n_lp].reshape(1, n_lp),
        "top_logprob_ids": ints[at:].reshape(1, rows, k),
        "top_logprobs": floats[1 + n_lp:].reshape(1, rows, k),
    }
    handle = inputs.get("request_handle")
    if handle is not None:
        unpacked["request_handle"] = handle
    return unpacked
