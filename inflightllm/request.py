"""The state of one request (sequence) inside the engine."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from inflightllm.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.IntEnum):
    """Wire codes of the engine's `finish_reason` output (docs/INTERFACE.md)."""

    NONE = 0
    STOP = 1
    LENGTH = 2
    CANCELLED = 3
    ERROR = 4  # engine-internal: the request failed alone; it gets an error response, never this code

    @property
    def text(self) -> str:
        return "" if self is FinishReason.NONE else self.name.lower()


@dataclass(eq=False)  # compared and hashed by identity: queue operations never compare fields
class Request:
    """One sequence: its tokens, counters, KV block table and emission state.

    `token_ids` holds the prompt followed by every generated token. A token is
    *computed* once its K/V are in the cache (`num_computed_tokens`); the last sampled
    token is not computed until the next step feeds it back in.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    priority: int = 0
    streaming: bool = False
    arrival_time: float = field(default_factory=time.monotonic)
    arrival_seq: int = 0

    status: RequestStatus = RequestStatus.WAITING
    token_ids: list[int] = field(init=False)
    num_prompt_tokens: int = field(init=False)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # chained SHA-256 keys of the full blocks so far
    num_registered_blocks: int = 0  # leading blocks of block_table already offered to the prefix cache
    num_preemptions: int = 0
    num_swapped_blocks: int = 0  # swap mode: its computed blocks held in host memory while preempted
    admitted_seq: int = -1  # order of (re-)admission into the running set
    num_computed_before_preemption: int = 0  # preempted: the tokens it had computed (recomputed-token count)

    # Generated-token bookkeeping.
    logprobs: list[float] = field(default_factory=list)
    # One entry per generated token, kept only when the request asks for top log probs
    # (params.top_logprobs > 0); empty otherwise.
    top_logprob_ids: list[list[int]] = field(default_factory=list)
    top_logprob_values: list[list[float]] = field(default_factory=list)
    num_sent_tokens: int = 0  # generated tokens already handed out in outputs
    cum_logprob_sent: float = 0.0  # sum of the log probs of the sent tokens (kept as they are sent)
    error: str | None = None  # set when the request failed alone (sampling, stop handling, its step)
    deadline: float | None = None  # monotonic time after which a still-waiting request times out
    finish_reason: FinishReason = FinishReason.NONE
    generator: torch.Generator | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finish_time: float | None = None
    first_admitted: bool = False
    # Asynchronous scheduling: tokens being sampled on the device, not yet in token_ids.
    num_inflight: int = 0
    final_pending: bool = False  # the token in flight ends it by length: schedule nothing more
    # Structured output (params.guided): its compile in flight, then its grammar state
    # (inflightllm.guided.GuidedState), advanced by the engine with each appended token.
    grammar_future: object | None = None
    guided: object | None = None
    # Sequence groups (n, best_of, beam search: inflightllm.sequence_group).
    group: object | None = None  # its SequenceGroup, when the request has several outputs
    sequence_index: int = 0  # its index in the group
    fork_at: int = 0  # > 0: compute only this many tokens, then the group forks (the engine)
    may_share: bool = False  # its block table was shared: writes check for copy-on-write
    table_rewritten: bool = False  # copy-on-write replaced a block: the runner gets the table again

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        if self.params.seed is not None:
            self.generator = torch.Generator()
            self.generator.manual_seed(self.params.seed)
        stop_singles = {seq[0] for seq in self.params.stop_sequences if len(seq) == 1}
        if not self.params.ignore_eos:
            stop_singles |= set(self.eos_token_ids)
        if self.params.end_id is not None:
            stop_singles.add(self.params.end_id)
        self.stop_token_ids = frozenset(stop_singles)
        self.stop_multi = tuple(seq for seq in self.params.stop_sequences if len(seq) > 1)
        self.banned_single = frozenset(seq[0] for seq in self.params.bad_words if len(seq) == 1)
        self.banned_multi = tuple(seq for seq in self.params.bad_words if len(seq) > 1)
        # Sampling reads its earlier tokens' values (not just their count).
        self.needs_history = self.params.needs_penalties or bool(self.banned_multi)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def num_uncomputed_tokens(self) -> int:
        """Tokens to compute before the next one can be sampled (those in flight count)."""
        return self.num_tokens + self.num_inflight - self.num_computed_tokens
