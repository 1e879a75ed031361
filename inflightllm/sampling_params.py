"""Per-request generation settings and their validation."""

from __future__ import annotations

from dataclasses import dataclass, field

from inflightllm import request_rules as rules
from inflightllm.guided.spec import GuidedSpec
from inflightllm.request_rules import MAX_TOP_LOGPROBS

__all__ = ["MAX_TOP_LOGPROBS", "GREEDY_TEMPERATURE_THRESHOLD", "InvalidRequestError", "SamplingParams"]
# Temperatures below this are greedy: dividing logits by a tinier one overflows float32
# (1e-38 turned every logit into inf and multinomial into an error). Every sampler (CPU
# reference, GPU) reads `SamplingParams.greedy`, so all paths agree.
GREEDY_TEMPERATURE_THRESHOLD = 1e-5


class InvalidRequestError(ValueError):
    """A request setting is out of range; the message names it, its value and what is allowed."""


@dataclass(frozen=True)
class SamplingParams:
    """How one request generates. Defaults are greedy decoding of up to 16 tokens.

    Token sequences (`stop_sequences`, `bad_words`) are tuples of token ids; a stop token
    id is a stop sequence of length 1. The model's EOS tokens always stop generation
    unless `ignore_eos`; `end_id` adds one more stop token.
    """

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    repetition_penalty: float = 1.0  # 1 = off; HF semantics over prompt + output
    presence_penalty: float = 0.0  # OpenAI semantics over output tokens
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop_sequences: tuple[tuple[int, ...], ...] = field(default_factory=tuple)
    bad_words: tuple[tuple[int, ...], ...] = field(default_factory=tuple)
    end_id: int | None = None
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    # Structured output: the grammar every generated token must follow (inflightllm.guided).
    guided: GuidedSpec | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_THRESHOLD or self.top_k == 1

    @property
    def needs_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    def validate(self, vocab_size: int, max_output_len: int | None = None) -> None:
        """Raise InvalidRequestError naming the first bad setting."""

        def bad(name: str, value, allowed: str) -> InvalidRequestError:
            return InvalidRequestError(f"{name}: {value!r} is out of range; allowed: {allowed}")

        limit = max_output_len if max_output_len is not None else 2**31 - 1
        checks = [
            ("max_tokens", self.max_tokens, rules.max_tokens_range(limit)),
            ("min_tokens", self.min_tokens, rules.min_tokens_range(self.max_tokens)),
            *((name, getattr(self, name), rule) for name, rule in rules.SAMPLING_RANGES.items()),
            ("top_k", self.top_k, rules.TOP_K),
        ]
        if self.seed is not None:
            checks.append(("seed", self.seed, rules.SEED))
        if self.end_id is not None:
            checks.append(("end_id", self.end_id, rules.token_id_range(vocab_size)))
        checks.append(("num_top_logprobs", self.top_logprobs, rules.TOP_LOGPROBS))
        for name, value, rule in checks:
            if not rule.contains(value):
                allowed = rule.allowed + (" (the vocabulary)" if name == "end_id" else "")
                raise bad(name, value, allowed)
        for name, sequences in (("stop_words", self.stop_sequences), ("bad_words", self.bad_words)):
            for sequence in sequences:
                if not sequence:
                    raise InvalidRequestError(f"{name}: an empty token sequence is not allowed")
                for token in sequence:
                    if not 0 <= token < vocab_size:
                        raise InvalidRequestError(
                            f"{name}: token id {token} is out of range; allowed: 0 to {vocab_size - 1}"
                        )
