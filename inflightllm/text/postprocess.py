"""The `postprocessing` model's logic: one engine response -> one client response.

Stateless: the text of a piece comes from its own `output_ids` and the `context_ids`
the engine sends with it (`inflightllm.detokenizer.decode_piece`), so any instance may
handle any piece of any request. The numeric outputs pass through unchanged.

`build_text_responses` handles every piece of one `execute` call together: one
tokenizer call decodes them all (`inflightllm.detokenizer.decode_pieces`), each with its
own context, and the texts equal `build_text_response`'s piece by piece. A piece with bad
inputs fails alone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from inflightllm.detokenizer import decode_piece, decode_pieces
from inflightllm.packed_outputs import PACKED_I32, unpack

FINISH_REASONS = {0: "", 1: "stop", 2: "length", 3: "cancelled"}

# Outputs copied from the engine's tensors unchanged, with the value sent when the
# engine left one out (an optional input of the model): name -> (dtype, empty value).
PASS_THROUGH_DEFAULTS: dict[str, tuple[type, tuple[int, ...]]] = {
    "num_input_tokens": (np.int32, (1, 1)),
    "num_output_tokens": (np.int32, (1, 1)),
    "num_cached_tokens": (np.int32, (1, 1)),
    "output_ids": (np.int32, (1, 0)),
    "cum_log_probs": (np.float32, (1, 1)),
    "output_log_probs": (np.float32, (1, 0)),
    "top_logprob_ids": (np.int32, (1, 0, 0)),
    "top_logprobs": (np.float32, (1, 0, 0)),
    "sequence_index": (np.int32, (1, 1)),  # which output of the request (n > 1)
}

# Other backends' output names: vLLM's `cumulative_logprob` (= cum_log_probs) and
# TensorRT-LLM's `batch_index` (the prompt's index in the request: always 0, one prompt each).
# `sequence_length`: the ids of each row of `output_ids` (TensorRT-LLM's; with beams, each
# beam's, the rest of its row padding).
OUTPUT_NAMES = ("text_output", "finish_reason", *PASS_THROUGH_DEFAULTS, "sequence_length", "cumulative_logprob",
                "batch_index")


def finish_reason_text(code: int) -> str:
    """0 -> "" (not finished), 1 -> "stop", 2 -> "length", 3 -> "cancelled"."""
    try:
        return FINISH_REASONS[int(code)]
    except KeyError:
        raise ValueError(f"finish_reason: unknown code {int(code)}; known: {sorted(FINISH_REASONS)}") from None


@dataclass
class _Piece:
    """What the decode of one engine response needs, read from its tensors: one
    `(context_ids, new_ids)` decode, or one per beam (a beam search response, whose
    `output_ids` are [1, beams, longest]: each beam's whole ids so far, no context)."""

    decodes: list[tuple[list[int], list[int]]]
    final: bool
    reason: str


def _read_piece(inputs: Mapping[str, np.ndarray | None]) -> _Piece:
    finish_array = inputs.get("finish_reason")
    finish_code = 0 if finish_array is None else int(np.asarray(finish_array).reshape(-1)[0])
    final, reason = finish_code != 0, finish_reason_text(finish_code)
    output_ids = inputs.get("output_ids")
    if output_ids is not None and np.asarray(output_ids).ndim == 3:  # [1, beams, longest]
        rows = np.asarray(output_ids)[0]
        lengths = inputs.get("sequence_length")
        if lengths is None or np.asarray(lengths).size != len(rows):
            raise ValueError(f"output_ids: {len(rows)} beams need sequence_length with one length each, got "
                             f"{None if lengths is None else list(np.asarray(lengths).shape)}")
        lengths = np.asarray(lengths).reshape(-1).tolist()
        if not all(0 <= length <= rows.shape[1] for length in lengths):
            raise ValueError(f"sequence_length: {lengths} out of range for rows of {rows.shape[1]} ids")
        return _Piece([([], row[:length].tolist()) for row, length in zip(rows, lengths, strict=True)],
                      final, reason)
    new_ids = [] if output_ids is None else np.asarray(output_ids).reshape(-1).tolist()
    context_ids = inputs.get("context_ids")
    context = [] if context_ids is None else np.asarray(context_ids).reshape(-1).tolist()
    return _Piece([(context, new_ids)], final, reason)


def _response(inputs: Mapping[str, np.ndarray | None], piece: _Piece, texts: list[str]) -> dict[str, np.ndarray]:
    response = {
        # [1, 1] BYTES, or [1, beams]: each beam's whole text so far, best first
        "text_output": np.array([[text.encode("utf-8") for text in texts]], dtype=object),
        "finish_reason": np.array([[piece.reason.encode("utf-8")]], dtype=object),  # [1, 1] BYTES
    }
    for name, (dtype, empty_shape) in PASS_THROUGH_DEFAULTS.items():
        array = inputs.get(name)
        response[name] = np.zeros(empty_shape, dtype) if array is None else array
    lengths = inputs.get("sequence_length")
    if lengths is None:
        lengths = np.array([[len(piece.decodes[0][1])]], np.int32)
    response["sequence_length"] = lengths
    response["cumulative_logprob"] = response["cum_log_probs"]
    response["batch_index"] = np.zeros((1, 1), np.int32)
    return response


def _decode_one(tokenizer, piece: _Piece) -> list[str]:
    return [decode_piece(tokenizer, context, new_ids, final=piece.final) for context, new_ids in piece.decodes]


def _unpacked(inputs: Mapping[str, np.ndarray | None]) -> Mapping[str, np.ndarray | None]:
    """The documented tensors of a packed engine response (the ensemble's case: three
    tensors, not eleven); `inputs` itself when they are already the documented ones."""
    return unpack(inputs) if inputs.get(PACKED_I32) is not None else inputs


def build_text_response(inputs: Mapping[str, np.ndarray | None], tokenizer) -> dict[str, np.ndarray]:
    """The "Ensemble outputs" tensors for one engine response.

    `inputs` maps the "engine -> postprocessing" names to arrays with the leading batch
    dimension of 1, or holds the packed ones (`inflightllm.packed_outputs`). A response
    with a non-zero `finish_reason` is the request's last,
    so an incomplete character at its end is kept (as U+FFFD); earlier pieces hold it
    back until the tokens that complete it arrive.
    """
    inputs = _unpacked(inputs)
    piece = _read_piece(inputs)
    return _response(inputs, piece, _decode_one(tokenizer, piece))


def build_text_responses(
    batch: Sequence[Mapping[str, np.ndarray | None] | Exception], tokenizer
) -> list[dict[str, np.ndarray] | Exception]:
    """`build_text_response` for every engine response of one `execute` call, decoded
    with one tokenizer call. Returns, in order, each piece's tensors or the exception
    that failed it (bad inputs, ids the tokenizer refuses): the others are unaffected.
    An entry of `batch` may already be an exception (its tensors could not be read):
    it is passed through as that piece's failure.
    """
    pieces: list[_Piece | Exception] = []
    unpacked: list[Mapping[str, np.ndarray | None] | Exception] = []
    for inputs in batch:
        if isinstance(inputs, Exception):
            pieces.append(inputs)
            unpacked.append(inputs)
            continue
        try:
            inputs = _unpacked(inputs)
            pieces.append(_read_piece(inputs))
        except Exception as error:
            pieces.append(error)
        unpacked.append(inputs)
    batch = unpacked
    good = [piece for piece in pieces if isinstance(piece, _Piece)]
    try:
        texts: list[str] | None = decode_pieces(
            tokenizer, [(context, new_ids, piece.final) for piece in good for context, new_ids in piece.decodes]
        )
    except Exception:  # some piece's ids are bad: decode one by one to fail that one alone
        texts = None
    results: list[dict[str, np.ndarray] | Exception] = []
    next_text = iter(texts or [])
    for inputs, piece in zip(batch, pieces, strict=True):
        if isinstance(piece, Exception):
            results.append(piece)
            continue
        try:
            if texts is None:
                piece_texts = _decode_one(tokenizer, piece)
            else:
                piece_texts = [next(next_text) for _ in piece.decodes]
            results.append(_response(inputs, piece, piece_texts))
        except Exception as error:
            results.append(error)
    return results
