"""Per-request generation settings and their validation."""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_TOP_LOGPROBS = 20
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
        if not 1 <= self.max_tokens <= limit:
            raise bad("max_tokens", self.max_tokens, f"1 to {limit}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise bad("min_tokens", self.min_tokens, f"0 to max_tokens ({self.max_tokens})")
        if not 0.0 <= self.temperature <= 100.0:
            raise bad("temperature", self.temperature, "0 to 100 (0 = greedy)")
        if self.top_k < 0:
            raise bad("top_k", self.top_k, "0 (off) or more")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", self.top_p, "greater than 0, up to 1 (1 = off)")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", self.min_p, "0 to 1 (0 = off)")
        if not 0.0 < self.repetition_penalty <= 100.0:
            raise bad("repetition_penalty", self.repetition_penalty, "greater than 0, up to 100 (1 = off)")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", self.presence_penalty, "-2 to 2")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", self.frequency_penalty, "-2 to 2")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise bad("seed", self.seed, "0 to 2**63 - 1")
        if self.end_id is not None and not 0 <= self.end_id < vocab_size:
            raise bad("end_id", self.end_id, f"0 to {vocab_size - 1} (the vocabulary)")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise bad("num_top_logprobs", self.top_logprobs, f"0 to {MAX_TOP_LOGPROBS}")
        for name, sequences in (("stop_words", self.stop_sequences), ("bad_words", self.bad_words)):
            for sequence in sequences:
                if not sequence:
                    raise InvalidRequestError(f"{name}: an empty token sequence is not allowed")
                for token in sequence:
                    if not 0 <= token < vocab_size:
                        raise InvalidRequestError(
                            f"{name}: token id {token} is out of range; allowed: 0 to {vocab_size - 1}"
                        )
