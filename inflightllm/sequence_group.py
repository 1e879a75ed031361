"""Sequence groups: one request, several outputs (docs/SEQUENCE-GROUPS.md).

A request with `n` > 1, `best_of` > 1 or `beam_width` > 1 is a group of sequences. Each
sequence is an engine `Request` of its own (id `<request id>\\x1f<index>`), scheduled,
computed and sampled like any other; the group ties them together:

- Parallel sampling (`n`, `best_of`): the first sequence computes the prompt but its last
  token (`Request.fork_at`); then the group forks: every other sequence shares those
  blocks (`BlockManager.share`) and each computes the last prompt token itself, so each
  samples its first token from its own row, with its own seed (`seed + index`). The
  shared partial block is copied on each sequence's first write (copy-on-write).
- Beam search (`beam_width`): the first sequence computes the whole prompt; each step
  the runner returns the top `2 * beam_width` log probs of every live beam (its top
  log probs), and `inflightllm.beam_search` picks the next beams of all groups at once: a
  beam that continues keeps its sequence, one more continuation of the same beam takes
  the sequence of a beam nobody continues (its blocks freed, the parent's shared; a new
  sequence on the first step, when the group has one).

The scheduler admits, preempts and resumes a group's sequences together.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from inflightllm import request_rules as rules
from inflightllm.request import Request
from inflightllm.sampling_params import InvalidRequestError, SamplingParams

SEQUENCE_SEPARATOR = "\x1f"  # between a request id and a sequence index: never in a client's id
EARLY_STOPPING_VALUES = (True, False, "never")


@dataclass(frozen=True)
class GroupParams:
    """How many outputs one request has (defaults: one, no group).

    n: outputs returned (OpenAI and vLLM `n`, TensorRT-LLM `num_return_sequences`).
    best_of: sequences sampled, the `n` with the highest cumulative log probability are
      returned (vLLM); None = n.
    beam_width: beam search over this many beams (TensorRT-LLM); all beams are returned.
    length_penalty, early_stopping: beam search scoring and stopping, as `transformers`'
      `generate` has them (the score of a finished beam is its cumulative log prob divided
      by its generated length ** length_penalty; early_stopping True, False or "never").
    """

    n: int = 1
    best_of: int | None = None
    beam_width: int = 1
    length_penalty: float = 1.0
    early_stopping: bool | str = False

    @property
    def num_sequences(self) -> int:
        if self.beam_width > 1:
            return self.beam_width
        return self.best_of if self.best_of is not None else self.n

    @property
    def is_group(self) -> bool:
        return self.num_sequences > 1

    def validate(self, params: SamplingParams, max_n: int, max_beam_width: int, max_batch_size: int,
                 streaming: bool = False) -> None:
        """Raise InvalidRequestError naming the first bad setting."""
        if not 1 <= self.n <= max_n:
            raise InvalidRequestError(f"n: {self.n!r} is out of range; allowed: 1 to {max_n} (engine.max_n)")
        if self.best_of is not None:
            if not self.n <= self.best_of <= max_n:
                raise InvalidRequestError(
                    f"best_of: {self.best_of!r} is out of range; allowed: n ({self.n}) to {max_n} (engine.max_n)")
            if streaming and self.best_of > self.n:
                raise InvalidRequestError(
                    f"best_of: {self.best_of} > n ({self.n}) cannot stream (the best are known at the end); "
                    "allowed: best_of equal to n, or stream false")
        if not 1 <= self.beam_width <= max_beam_width:
            raise InvalidRequestError(
                f"beam_width: {self.beam_width!r} is out of range; allowed: 1 to {max_beam_width} "
                "(engine.max_beam_width)")
        if self.beam_width > 1 and (self.n not in (1, self.beam_width) or self.best_of is not None):
            raise InvalidRequestError(
                f"n: {self.n} with beam_width {self.beam_width}: beam search returns its beams; "
                "allowed: n 1 (or equal to beam_width), best_of unset")
        if self.early_stopping not in EARLY_STOPPING_VALUES or isinstance(self.early_stopping, int) and \
                not isinstance(self.early_stopping, bool):
            raise InvalidRequestError(
                f"early_stopping: {self.early_stopping!r} is not allowed; allowed: true, false or \"never\"")
        if not rules.LENGTH_PENALTY.contains(self.length_penalty):
            raise InvalidRequestError(
                f"length_penalty: {self.length_penalty!r} is out of range; allowed: {rules.LENGTH_PENALTY.allowed}")
        if self.num_sequences > max_batch_size:
            raise InvalidRequestError(
                f"{'beam_width' if self.beam_width > 1 else 'best_of' if self.best_of else 'n'}: "
                f"{self.num_sequences} sequences exceed max_batch_size ({max_batch_size}); "
                f"allowed: up to {max_batch_size}")
        if params.seed is not None and params.seed + self.num_sequences - 1 > 2**63 - 1:
            raise InvalidRequestError(
                f"seed: {params.seed} + {self.num_sequences - 1} (one seed per output) exceeds 2**63 - 1")


@dataclass(eq=False)
class SequenceGroup:
    """The sequences of one request and what ties them together."""

    request_id: str
    params: SamplingParams  # as the client sent them
    group_params: GroupParams
    sequences: list[Request] = field(default_factory=list)  # its sequences (beam search: the dead ones dropped)
    num_unfinished: int = 0
    next_index: int = 0  # the index of the next sequence made
    forked: bool = False  # the sequences after the first exist (parallel sampling: shared prompt)
    beam: object | None = None  # its BeamSearch (beam search only)
    # Beam search: the live beams' sequences, in beam order, and their candidates this step
    # (sequence id -> (top ids, top log probs)).
    live: list[Request] = field(default_factory=list)
    candidates: dict[str, tuple[list[int], list[float]]] = field(default_factory=dict)
    finished_outputs: list = field(default_factory=list)  # best_of: the sequences' finals, held back
    beam_params: SamplingParams | None = None  # beam search: the params of all its sequences

    @property
    def is_beam(self) -> bool:
        return self.group_params.beam_width > 1

    @property
    def num_sequences(self) -> int:
        return self.group_params.num_sequences

    def sequence_params(self, index: int) -> SamplingParams:
        """The params of sequence `index`: seed + index (so output i equals a request run
        alone with that seed); best_of tracks log probs to rank; beams are scored on the
        top log probs the runner returns."""
        params = self.params
        if self.is_beam:  # greedy rows: no seed, and one params object for every beam
            if self.beam_params is None:
                self.beam_params = dataclasses.replace(params, seed=None, temperature=0.0, logprobs=True,
                                                       top_logprobs=self.beam.candidates_per_beam)
            return self.beam_params
        changes: dict = {}
        if params.seed is not None:
            changes["seed"] = params.seed + index
        if self.group_params.best_of is not None and self.group_params.best_of > self.group_params.n:
            changes["logprobs"] = True
        return dataclasses.replace(params, **changes) if changes else params

    def new_sequence(self, template: Request) -> Request:
        """A new sequence of the group: the next index, the template's prompt and settings."""
        index = self.next_index
        self.next_index += 1
        sequence = Request(
            request_id=f"{self.request_id}{SEQUENCE_SEPARATOR}{index}",
            prompt_token_ids=template.prompt_token_ids,
            params=self.sequence_params(index),
            eos_token_ids=template.eos_token_ids,
            priority=template.priority,
            streaming=template.streaming,
            arrival_time=template.arrival_time,
        )
        sequence.group = self
        sequence.sequence_index = index
        sequence.arrival_seq = template.arrival_seq
        sequence.deadline = template.deadline
        self.sequences.append(sequence)
        self.num_unfinished += 1
        return sequence
