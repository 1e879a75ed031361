"""The request rules, written once: ranges of the sampling settings and the length and
priority limits. `preprocessing` (inflightllm/text/preprocess.py, which names the input or
JSON key) and the engine (SamplingParams.validate and Engine.validate_request, which name
the engine input) call the same checks; each formats its own message around `allowed`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class Range:
    """A closed (or left-open) numeric range and how an error message describes it."""

    low: float
    high: float
    allowed: str
    low_open: bool = False

    def contains(self, value) -> bool:
        number = value.item() if hasattr(value, "item") else value  # NumPy scalars compare as Python numbers
        if isinstance(number, float) and math.isnan(number):
            return False
        below = number <= self.low if self.low_open else number < self.low
        return not below and number <= self.high


# Sampling settings: name (as the engine input and SamplingParams field) -> range.
SAMPLING_RANGES: dict[str, Range] = {
    "temperature": Range(0.0, 100.0, "0 to 100 (0 = greedy)"),
    "top_p": Range(0.0, 1.0, "greater than 0, up to 1 (1 = off)", low_open=True),
    "min_p": Range(0.0, 1.0, "0 to 1 (0 = off)"),
    "repetition_penalty": Range(0.0, 100.0, "greater than 0, up to 100 (1 = off)", low_open=True),
    "presence_penalty": Range(-2.0, 2.0, "-2 to 2"),
    "frequency_penalty": Range(-2.0, 2.0, "-2 to 2"),
}
TOP_LOGPROBS = Range(0, MAX_TOP_LOGPROBS, f"0 to {MAX_TOP_LOGPROBS}")
TOP_K = Range(0, math.inf, "0 (off) or more")
SEED = Range(0, 2**63 - 1, "0 to 2**63 - 1")
LENGTH_PENALTY = Range(-10.0, 10.0, "-10 to 10")  # beam search (docs/SEQUENCE-GROUPS.md)
TIMEOUT_MS = Range(0, 2**31 - 1, "0 (the profile's default_timeout_microseconds) or more milliseconds")


def max_tokens_range(max_output_len: int) -> Range:
    return Range(1, max_output_len, f"1 to {max_output_len}")


def min_tokens_range(max_tokens: int) -> Range:
    return Range(0, max_tokens, f"0 to max_tokens ({max_tokens})")


def priority_range(priority_levels: int) -> Range:
    return Range(0, priority_levels - 1, f"0 to {priority_levels - 1}")


def token_id_range(vocab_size: int) -> Range:
    return Range(0, vocab_size - 1, f"0 to {vocab_size - 1}")


def prompt_length_range(max_input_length: int) -> Range:
    return Range(1, max_input_length, f"1 to {max_input_length} tokens")


def room_for_output(prompt_length: int, max_tokens: int, max_model_len: int) -> int | None:
    """None when prompt + max_tokens fits the model context, else the most max_tokens allowed."""
    if prompt_length + max_tokens <= max_model_len:
        return None
    return max(0, max_model_len - prompt_length)
