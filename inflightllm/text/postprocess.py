"""The `postprocessing` model's logic: one engine response -> one client response.

Stateless: the text of a piece comes from its own `output_ids` and the `context_ids`
the engine sends with it (`inflightllm.detokenizer.decode_piece`), so any instance may
handle any piece of any request. The numeric outputs pass through unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from inflightllm.detokenizer import decode_piece

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
}

# Other backends' output names: vLLM's `cumulative_logprob` (= cum_log_probs) and
# TensorRT-LLM's `batch_index` (the prompt's index in the request: always 0, one prompt each).
OUTPUT_NAMES = ("text_output", "finish_reason", *PASS_THROUGH_DEFAULTS, "cumulative_logprob", "batch_index")


def finish_reason_text(code: int) -> str:
    """0 -> "" (not finished), 1 -> "stop", 2 -> "length", 3 -> "cancelled"."""
    try:
        return FINISH_REASONS[int(code)]
    except KeyError:
        raise ValueError(f"finish_reason: unknown code {int(code)}; known: {sorted(FINISH_REASONS)}") from None


def build_text_response(inputs: Mapping[str, np.ndarray | None], tokenizer) -> dict[str, np.ndarray]:
    """The "Ensemble outputs" tensors for one engine response.

    `inputs` maps the "engine -> postprocessing" names to arrays with the leading batch
    dimension of 1. A response with a non-zero `finish_reason` is the request's last,
    so an incomplete character at its end is kept (as U+FFFD); earlier pieces hold it
    back until the tokens that complete it arrive.
    """
    output_ids = inputs.get("output_ids")
    output_ids = np.zeros((1, 0), np.int32) if output_ids is None else output_ids
    context_ids = inputs.get("context_ids")
    context = [] if context_ids is None else np.asarray(context_ids).reshape(-1).tolist()
    finish_array = inputs.get("finish_reason")
    finish_code = 0 if finish_array is None else int(np.asarray(finish_array).reshape(-1)[0])
    reason = finish_reason_text(finish_code)

    text = decode_piece(tokenizer, context, np.asarray(output_ids).reshape(-1).tolist(), final=finish_code != 0)
    response = {
        "text_output": np.array([[text.encode("utf-8")]], dtype=object),  # [1, 1] BYTES
        "finish_reason": np.array([[reason.encode("utf-8")]], dtype=object),  # [1, 1] BYTES
    }
    for name, (dtype, empty_shape) in PASS_THROUGH_DEFAULTS.items():
        array = inputs.get(name)
        response[name] = np.zeros(empty_shape, dtype) if array is None else array
    response["cumulative_logprob"] = response["cum_log_probs"]
    response["batch_index"] = np.zeros((1, 1), np.int32)
    return response
