"""The step description: what the engine core tells a model runner to run.

Self-contained and serializable (plain dataclasses of ints, lists and SamplingParams), so
a runner can live in another process (tensor-parallel workers get the same message).
A runner keeps its own per-request state; the engine sends each request whole once
(`NewRequestData`: on first scheduling and on resumption after a preemption) and then
only deltas (`CachedRequestData`: new block ids and the computed-token count). Tokens a
runner sampled itself are never sent back to it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from inflightllm.sampling_params import SamplingParams


@dataclass(slots=True)
class NewRequestData:
    """A request the runner does not hold (or holds only as preempted state)."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # non-empty when resumed after a preemption
    block_ids: list[int]  # its whole block table
    num_computed_tokens: int  # tokens whose K/V are already in those blocks (prefix-cache hits)
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()


@dataclass(slots=True)
class CachedRequestData:
    """A request the runner holds: what changed since the last step."""

    request_id: str
    new_block_ids: list[int]  # appended to its block table
    num_computed_tokens: int
    # Copy-on-write replaced a block of its table (sequence groups): its whole new table,
    # which replaces the runner's (then new_block_ids is empty). Its tokens are unchanged.
    block_ids: list[int] | None = None


@dataclass(slots=True)
class StepDescription:
    """One step: state changes first, then the packed batch to run."""

    new_requests: list[NewRequestData] = field(default_factory=list)
    cached_requests: list[CachedRequestData] = field(default_factory=list)
    # (request id, tokens to compute this step), in packed order.
    scheduled: list[tuple[str, int]] = field(default_factory=list)
    # Preempted since the last step: the runner frees their slots, keeps their state
    # (tokens, generator) until they come back as new requests.
    preempted_request_ids: list[str] = field(default_factory=list)
    # Finished or aborted since the last step: the runner forgets them.
    finished_request_ids: list[str] = field(default_factory=list)
    # Swap-mode preemption, done before the forward: (request id, device block ids) whose
    # K/V go to host memory (the request is also in `preempted_request_ids`), and
    # (request id, fresh device block ids) that get a swapped-out request's K/V back.
    swap_out: list[tuple[str, list[int]]] = field(default_factory=list)
    swap_in: list[tuple[str, list[int]]] = field(default_factory=list)
    # Structured output: the constrained requests that sample this step and their allowed
    # next tokens, one row each ([len(guided_request_ids), ceil(vocab / 32)] int32 NumPy,
    # bit set = allowed). The runner applies them to those rows' logits in one call.
    guided_request_ids: list[str] = field(default_factory=list)
    guided_bitmask: object | None = None
    # Copy-on-write (sequence groups): (source block, destination block) pairs whose K/V
    # are copied after the swap-outs and before the swap-ins and the forward.
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # Host KV tier (engine.host_kv_cache_bytes): (device block, host slot) copies of evicted
    # cached blocks, done first of all (before anything in the step writes those blocks),
    # and (host slot, device block) copies of prefix hits found in host memory, done after
    # the copy-on-write copies and before the forward.
    kv_offloads: list[tuple[int, int]] = field(default_factory=list)
    kv_onloads: list[tuple[int, int]] = field(default_factory=list)
    # Beam search: (request id, source request id, token id), applied before every other
    # change of the step, all sources read before any request changes. The request takes
    # the source's tokens with the last one (which the runner sampled itself) replaced by
    # this token, and the source's block table and computed count; a beam that continues
    # itself is its own source. So a fork or a reassigned beam costs the runner a row
    # copy, not the request sent whole. Only requests the runner holds.
    beam_updates: list[tuple[str, str, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(count for _, count in self.scheduled)


@dataclass(slots=True)
class SampledTokens:
    """What a runner returns: one sampled token per request whose step reached the end
    of its known tokens, in `request_ids` order."""

    request_ids: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)  # of the chosen token, when asked
    top_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)
    # Requests whose sampling failed this step (request id -> why): they get no token and
    # fail alone; the runner already forgot them.
    failed: dict[str, str] = field(default_factory=dict)
