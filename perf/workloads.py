"""Request sets for the load generator: each request is the ensemble's inputs plus a label.

Workloads (all seeded, so two runs send the same requests in the same order):
- `fixed`: raw prompts of exactly `input_len` tokens; `max_tokens = min_tokens = output_len`,
  so every request generates exactly `output_len` tokens (EOS is banned until then).
- `mixed`: as `fixed`, but one request in `long_every` is long (`long_len` output tokens,
  label `long`) and the others short (`short_len`, label `short`): the in-flight batching
  article's "most answers ~50 tokens, some ~2,000". Long requests sit at evenly spaced
  positions, so no run starts or ends with a burst of them.
- `shared-prefix`: one of `num_prefixes` common prefixes of `prefix_len` tokens followed by
  a distinct suffix of `input_len` tokens (label `prefix N`): what the prefix cache serves.
- `chat`: one-turn chat questions (`messages`, the model's chat template), natural answer
  lengths up to `output_len` (EOS allowed).
- `priorities`: as `fixed`, with the ensemble's `priority` input drawn from
  0 … `priority_levels - 1` (label `priority N`).

Prompts of an exact token count are built from words that are one token each with a
leading space, checked by encoding the final text; the server's `num_input_tokens`
confirms it (the load generator records it per request).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

WORKLOADS = ("fixed", "mixed", "shared-prefix", "chat", "priorities")

CHAT_QUESTIONS = [
    "What is the capital of France?", "Why is the sky blue?", "How do volcanoes form?",
    "Explain the water cycle in simple terms.", "What is a prime number?",
    "Give me three tips for learning to cook.", "How does a bicycle stay upright?",
    "What causes the seasons on Earth?", "Describe the life cycle of a butterfly.",
    "What is the difference between weather and climate?", "How do vaccines work?",
    "Write a short poem about the sea.", "What is photosynthesis?",
    "Why do cats purr?", "How does a refrigerator keep food cold?",
    "Name three famous painters and one work by each.",
]


@dataclass
class BenchRequest:
    """One request: the ensemble inputs (docs/INTERFACE.md names) and a class label."""

    inputs: dict
    label: str
    expected_input_tokens: int | None = None  # exact prompts only
    expected_output_tokens: int | None = None  # fixed lengths only
    extra: dict = field(default_factory=dict)


@dataclass
class WorkloadSpec:
    """Sizes of a workload; every field has a small CPU-friendly default."""

    name: str = "fixed"
    num_requests: int = 24
    input_len: int = 64
    output_len: int = 32
    short_len: int = 50
    long_len: int = 2000
    long_every: int = 10
    prefix_len: int = 512
    num_prefixes: int = 1
    priority_levels: int = 3
    seed: int = 0

    def describe(self) -> str:
        if self.name == "fixed":
            return f"fixed: {self.num_requests} requests, prompts {self.input_len} tokens, outputs {self.output_len} tokens"
        if self.name == "mixed":
            return (f"mixed: {self.num_requests} requests, prompts {self.input_len} tokens; 1 in {self.long_every} "
                    f"long ({self.long_len} output tokens), the rest short ({self.short_len})")
        if self.name == "shared-prefix":
            return (f"shared-prefix: {self.num_requests} requests, {self.num_prefixes} shared prefix(es) of "
                    f"{self.prefix_len} tokens + {self.input_len}-token suffix, outputs {self.output_len} tokens")
        if self.name == "chat":
            return f"chat: {self.num_requests} one-turn chat questions, max_tokens {self.output_len} (EOS allowed)"
        if self.name == "priorities":
            return (f"priorities: {self.num_requests} requests, prompts {self.input_len} tokens, outputs "
                    f"{self.output_len} tokens, priority drawn from 0..{self.priority_levels - 1}")
        raise ValueError(f"unknown workload {self.name!r}; allowed: {', '.join(WORKLOADS)}")


class ExactPrompts:
    """Builds prompt texts that tokenize to an exact number of tokens."""

    def __init__(self, tokenizer, seed: int = 0):
        self.tokenizer = tokenizer
        self.rng = random.Random(seed)
        self.words = self._single_token_words()

    def _single_token_words(self) -> list[str]:
        words = []
        for token, _token_id in sorted(self.tokenizer.get_vocab().items(), key=lambda item: item[1]):
            if not token.startswith("Ġ"):  # byte-level BPE's leading space
                continue
            word = token[1:]
            if not (word.isascii() and word.isalpha() and word.islower() and 3 <= len(word) <= 9):
                continue
            if self.count(" " + word) == 1:
                words.append(word)
            if len(words) >= 2000:
                break
        if len(words) < 100:
            raise RuntimeError("the tokenizer has too few single-token words to build exact prompts")
        return words

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def make(self, num_tokens: int, lead: str = "") -> str:
        """A text of exactly `num_tokens` tokens (`lead`, a space, then random words); `lead`
        must itself fit."""
        words = [self.rng.choice(self.words) for _ in range(num_tokens - (self.count(lead) if lead else 0))]
        text = lead + "".join(" " + word for word in words) if lead else " ".join(words)
        # Words tokenize independently after a space; only the first word may split. Trim.
        while self.count(text) > num_tokens and words:
            words.pop()
            text = lead + "".join(" " + word for word in words) if lead else " ".join(words)
        while self.count(text) < num_tokens:
            words.append(self.rng.choice(self.words))
            text = lead + "".join(" " + word for word in words) if lead else " ".join(words)
        if self.count(text) != num_tokens:
            raise RuntimeError(f"could not build a prompt of exactly {num_tokens} tokens")
        return text


def _fixed_request(prompt: str, input_len: int, output_len: int, label: str, **extra_inputs) -> BenchRequest:
    inputs = {"text_input": prompt, "max_tokens": output_len, "min_tokens": output_len, "stream": True}
    inputs.update(extra_inputs)
    return BenchRequest(inputs, label, expected_input_tokens=input_len, expected_output_tokens=output_len)


def build_requests(spec: WorkloadSpec, tokenizer) -> list[BenchRequest]:
    """The workload's requests, in sending order."""
    spec.describe()  # rejects an unknown name
    rng = random.Random(spec.seed)
    if spec.name == "chat":
        questions = list(CHAT_QUESTIONS)
        rng.shuffle(questions)
        return [
            BenchRequest({"messages": [{"role": "user", "content": questions[i % len(questions)]}],
                          "max_tokens": spec.output_len, "stream": True}, "chat")
            for i in range(spec.num_requests)
        ]
    prompts = ExactPrompts(tokenizer, seed=spec.seed)
    requests = []
    if spec.name == "shared-prefix":
        prefixes = [prompts.make(spec.prefix_len) for _ in range(spec.num_prefixes)]
        for i in range(spec.num_requests):
            group = i % spec.num_prefixes
            prefix = prefixes[group]
            text = prompts.make(spec.prefix_len + spec.input_len, lead=prefix)
            requests.append(_fixed_request(text, spec.prefix_len + spec.input_len, spec.output_len, f"prefix {group}"))
        return requests
    for i in range(spec.num_requests):
        text = prompts.make(spec.input_len)
        if spec.name == "fixed":
            requests.append(_fixed_request(text, spec.input_len, spec.output_len, "fixed"))
        elif spec.name == "mixed":
            is_long = i % spec.long_every == spec.long_every // 2
            length = spec.long_len if is_long else spec.short_len
            requests.append(_fixed_request(text, spec.input_len, length, "long" if is_long else "short"))
        elif spec.name == "priorities":
            priority = rng.randrange(spec.priority_levels)
            requests.append(_fixed_request(text, spec.input_len, spec.output_len, f"priority {priority}",
                                           priority=priority))
    return requests
