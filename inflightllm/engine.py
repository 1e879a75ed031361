"""The engine: requests in, one step at a time, tokens out.

`Engine.step()` asks the scheduler what to run, runs the model once over that packed
batch, samples, appends tokens, checks stop conditions, frees finished requests' KV
blocks in the same step, and returns the outputs due to be sent. It is single-threaded:
the Triton adapter owns it from one loop thread and feeds it through a queue.
"""

from __future__ import annotations

import dataclasses
import gc
import heapq
import logging
import os
import time
from concurrent.futures import FIRST_COMPLETED
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field

import numpy as np

from inflightllm import request_rules as rules
from inflightllm.beam_search import token_logprobs_of
from inflightllm.block_manager import BlockManager
from inflightllm.config import RUNNERS, EngineConfig
from inflightllm.detokenizer import context_window, tokenizer_vocabulary
from inflightllm.guided.spec import GuidedSpecError, check_spec
from inflightllm.host_kv_tier import HostKVTier
from inflightllm.kv_pressure import PreemptionCostModel
from inflightllm.model_runner import make_model_runner
from inflightllm.model_source import ModelDims, ModelSpec, kv_element_bytes
from inflightllm.models.loader import LoadedModel, load_model
from inflightllm.request import FinishReason, Request, RequestStatus
from inflightllm.sampling_params import InvalidRequestError, SamplingParams
from inflightllm.scheduler import Scheduler, SchedulerOutput
from inflightllm.sequence_group import GroupParams, SequenceGroup
from inflightllm.step import CachedRequestData, NewRequestData, StepDescription
from inflightllm.step_trace import StepTrace

logger = logging.getLogger(__name__)

# Python's cyclic garbage collector: its default youngest-generation threshold (700 container
# allocations) runs a collection every few hundred objects, and a step allocates thousands
# (requests' deltas, outputs, lists): with 1,024 sequences a step, young collections and the
# older ones they trigger took a quarter of the engine's host time outside the model (CPU,
# 256 x beam_width 4: 17.6-19.9 ms a step at the default thresholds, 12.9-14.4 at these).
# The engine sets these when it is made (a process-wide setting: the serving process runs one
# engine); INFLIGHTLLM_GC=default leaves Python's own.
GC_THRESHOLDS = (50_000, 20, 100)
GC_MODES = ("tuned", "default")


def tune_gc() -> tuple[int, ...]:
    """Set GC_THRESHOLDS unless INFLIGHTLLM_GC=default; returns the thresholds in force."""
    mode = os.environ.get("INFLIGHTLLM_GC", "").strip() or "tuned"
    if mode not in GC_MODES:
        raise ValueError(f"INFLIGHTLLM_GC={mode!r}; allowed: {', '.join(GC_MODES)}")
    if mode == "tuned":
        gc.set_threshold(*GC_THRESHOLDS)
    return gc.get_threshold()


class QueueFullError(InvalidRequestError):
    """The waiting queue holds max_queue_size requests: the new one is refused at once."""


@dataclass(slots=True)
class RequestOutput:
    """What one request has to report after a step (or an abort)."""

    request_id: str
    new_token_ids: list[int]
    context_ids: list[int]  # up to CONTEXT_WINDOW generated tokens the decode shows, sent before these
    new_logprobs: list[float]
    new_top_ids: list[list[int]]
    new_top_logprobs: list[list[float]]
    cum_logprob: float
    finished: bool
    finish_reason: FinishReason
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    # Latencies in seconds, set on the final output.
    time_to_first_token: float | None = None
    time_per_output_token: float | None = None
    e2e_latency: float | None = None
    error: str | None = None  # the request failed alone: send this as its error response
    # Several outputs per request (inflightllm.sequence_group). `finished` is the whole
    # request's; `sequence_finished` this sequence's (n, best_of: each output streams alone).
    sequence_index: int = 0
    sequence_finished: bool | None = None  # None: the request has one sequence (= finished)
    # Beam search: every beam's generated ids so far (running beams while streaming, the
    # finished beams best first in the final output), their cumulative log probs and scores.
    beam_token_ids: list[list[int]] | None = None
    beam_cum_logprobs: list[float] | None = None
    beam_scores: list[float] | None = None
    beam_logprobs: list[list[float]] | None = None  # each beam's per-token log probs
    beam_pad_id: int = 0  # what pads the beams' ids to one length (the end id: TensorRT-LLM's output_ids)


def coalesce_outputs(outputs: list[RequestOutput]) -> RequestOutput:
    """Consecutive outputs of one request merged into one: the new tokens (and their log
    probs) of all, in order; the context of the first; counts and finish of the last. A
    beam search output holds the whole beams (they change from step to step): the last wins."""
    first, last = outputs[0], outputs[-1]
    if last.beam_token_ids is not None:
        return last
    return RequestOutput(
        request_id=first.request_id,
        new_token_ids=[t for o in outputs for t in o.new_token_ids],
        context_ids=first.context_ids,
        new_logprobs=[v for o in outputs for v in o.new_logprobs],
        new_top_ids=[v for o in outputs for v in o.new_top_ids],
        new_top_logprobs=[v for o in outputs for v in o.new_top_logprobs],
        cum_logprob=last.cum_logprob,
        finished=last.finished,
        finish_reason=last.finish_reason,
        num_prompt_tokens=last.num_prompt_tokens,
        num_output_tokens=last.num_output_tokens,
        num_cached_tokens=last.num_cached_tokens,
        time_to_first_token=last.time_to_first_token,
        time_per_output_token=last.time_per_output_token,
        e2e_latency=last.e2e_latency,
        error=last.error,
        sequence_index=last.sequence_index,
        sequence_finished=last.sequence_finished,
    )


@dataclass
class EngineStats:
    """Counters and gauges of the engine (exported as Triton metrics by the adapter)."""

    num_running: int
    num_waiting: int
    num_preemptions_total: int
    num_blocks_total: int
    num_blocks_used: int
    num_blocks_free: int
    num_blocks_cached: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_tokens_last_step: int
    prompt_tokens_total: int
    generation_tokens_total: int
    num_steps_total: int
    kv_usage_at_first_preemption: float | None = None  # blocks in use when the first preemption was needed
    num_swapped_out_total: int = 0
    num_failed_total: int = 0
    num_timed_out_total: int = 0
    num_rejected_total: int = 0
    num_shared_blocks: int = 0  # blocks held by more than one sequence (sequence groups, prefix hits)
    num_cow_copies_total: int = 0  # blocks copied on a shared block's first write
    # KV pressure (docs/KV-PRESSURE.md): tokens computed again after preemptions (what the
    # victims had computed less what they got back: swapped in or found in the prefix
    # cache), blocks and bytes copied to host memory and back by swap preemptions.
    num_recomputed_tokens_total: int = 0
    num_swapped_out_blocks_total: int = 0
    num_swapped_in_blocks_total: int = 0
    swapped_out_bytes_total: int = 0
    swapped_in_bytes_total: int = 0
    # The figures `preemption_mode: auto` decides by (None: not measured).
    host_link_bytes_per_second: float | None = None
    prefill_seconds_per_token: float | None = None
    # Host KV tier (engine.host_kv_cache_bytes; all 0 when off).
    host_kv_blocks_total: int = 0  # host slots
    host_kv_blocks_held: int = 0  # slots holding a block
    host_kv_offloaded_blocks_total: int = 0  # evicted device blocks copied to host memory
    host_kv_onloaded_blocks_total: int = 0  # host blocks copied back on a prefix hit
    host_kv_bytes_per_block: int = 0  # bytes one block copy moves (either way)
    prefix_cache_host_hits: int = 0  # of prefix_cache_hits: tokens whose blocks came from the host tier

    @property
    def host_kv_offloaded_bytes_total(self) -> int:
        return self.host_kv_offloaded_blocks_total * self.host_kv_bytes_per_block

    @property
    def host_kv_onloaded_bytes_total(self) -> int:
        return self.host_kv_onloaded_blocks_total * self.host_kv_bytes_per_block

    @property
    def kv_usage(self) -> float:
        return self.num_blocks_used / self.num_blocks_total if self.num_blocks_total else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


@dataclass
class _Counters:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    steps: int = 0
    tokens_last_step: int = 0
    failed: int = 0
    timed_out: int = 0
    rejected: int = 0
    swapped_out_blocks: int = 0
    swapped_in_blocks: int = 0
    pending: list[RequestOutput] = field(default_factory=list)


def num_kv_blocks(config: EngineConfig, dims: ModelDims, dtype: str) -> int | None:
    """KV blocks that fit the profile's memory budget (or the explicit count). None on a
    GPU: the CUDA runner sizes its cache from `gpu_memory_utilization` after loading the
    weights and measuring a step of the largest size."""
    if config.num_kv_blocks > 0:
        return config.num_kv_blocks
    if config.device != "cpu":
        return None
    element = kv_element_bytes(dtype, config.kv_cache_dtype)
    bytes_per_block = config.block_size * dims.kv_bytes_per_token(element, config.tensor_parallel_size)
    return config.kv_cache_bytes // bytes_per_block


class Engine:
    """Paged-KV, in-flight batching LLM engine over one model."""

    def __init__(
        self,
        model_spec: ModelSpec,
        config: EngineConfig,
        sampler_seed: int | None = None,
        loaded: LoadedModel | None = None,
        runner=None,
    ):
        """`runner`: a ready runner (`execute(step) -> SampledTokens`, `num_blocks`) to use
        instead of building one for `loaded` (tests drive the engine with a stub model)."""
        self.model_spec = model_spec
        self.config = config
        # What the runner's buffers and CUDA graphs are sized for: reconfigure may lower these.
        self.built_limits = {"max_batch_size": config.max_batch_size, "max_num_tokens": config.max_num_tokens}
        if config.runner not in RUNNERS:
            raise ValueError(f"engine runner {config.runner!r} is not one of {', '.join(RUNNERS)}")
        if config.runner == "dummy" and (config.device != "cpu" or config.tensor_parallel_size != 1):
            raise ValueError("the dummy runner runs on the host alone: device 'cpu', tensor_parallel_size 1")
        if loaded is not None:
            self.loaded = loaded
        elif config.runner == "dummy":  # no weights: the config, tokenizer folder and EOS ids only
            from inflightllm.dummy_runner import describe_model

            self.loaded = describe_model(model_spec)
        elif config.device == "cpu":
            self.loaded = load_model(model_spec, device="cpu")
        else:
            from inflightllm.gpu.model import load_gpu_model

            self.loaded = load_gpu_model(model_spec, config)
        arch = self.loaded.arch
        self.vocab_size = arch.vocab_size
        # The tokenizer's ids: streamed pieces' contexts count only the ids its decode shows
        # (inflightllm.detokenizer); the model never samples ids beyond it (models/loader.py).
        folder = getattr(self.loaded, "folder", None)
        self.vocabulary = tokenizer_vocabulary(folder) if folder is not None else None
        self.max_model_len = model_spec.max_model_len or arch.max_position_embeddings
        if runner is None:
            blocks = num_kv_blocks(config, ModelDims.from_config(self.loaded.config), model_spec.dtype)
            if blocks is not None and blocks < 1:
                raise ValueError(
                    f"kv_cache_bytes={config.kv_cache_bytes} holds no KV block of {config.block_size} tokens"
                )
            if config.runner == "dummy":
                from inflightllm.dummy_runner import DummyRunner

                runner = DummyRunner.for_model(self.loaded, blocks)
            else:
                runner = make_model_runner(self.loaded, config, blocks, sampler_seed)
        self.runner = runner
        if config.fault_injection:
            from inflightllm.faults import FaultInjectingRunner

            self.runner = FaultInjectingRunner(self.runner)
        blocks = self.runner.num_blocks
        # The host KV tier: as many host slots as the runner allocated (it sizes them from
        # engine.host_kv_cache_bytes and its own bytes per block); runners without one: off.
        host_blocks = int(getattr(self.runner, "num_host_blocks", 0) or 0)
        if host_blocks > 0 and not config.enable_kv_cache_reuse:
            raise ValueError("host_kv_cache_bytes > 0 needs enable_kv_cache_reuse: true (the host tier extends "
                             "the prefix cache)")
        self._new_block_manager(blocks, host_blocks)
        # The cost model of `preemption_mode: auto`: the runner's host link, measured at its
        # start (None for runners without one: auto recomputes), and the prefill seconds per
        # token of this engine's own steps (`_observe_step`).
        self.host_link = getattr(self.runner, "host_link", None)
        self.costs = PreemptionCostModel(self.host_link)
        if self.host_link is not None:
            logger.info("KV host link: %.2f GB/s measured, %d bytes per block",
                        self.host_link.bytes_per_second / 1e9, self.host_link.bytes_per_block)
        self.scheduler = Scheduler(config, self.block_manager, self.costs)
        self._last_result_time = 0.0  # asynchronous scheduling: when the previous step's tokens came
        self._inflight_timing: tuple[float, int] | None = None  # its launch time and tokens, if it had prefill
        # What the runner holds: blocks of each request it knows, and what to tell it next.
        self._runner_blocks: dict[str, int] = {}  # running in the runner: block ids sent
        self._runner_held: set[str] = set()  # the runner has state for these (preempted too)
        self._runner_finished: list[str] = []
        # Asynchronous scheduling: the launched step whose tokens are not yet emitted.
        self.async_scheduling = config.async_scheduling
        self._inflight = None
        self.requests: dict[str, Request] = {}
        self._counters = _Counters()
        # Host seconds of the asynchronous step loop by part (perf/bench_gpu.py reads them):
        # schedule (scheduler + step description), launch (the runner queues the step),
        # wait (the previous step's tokens: GPU time not hidden by the host work), emit.
        # beam: the beam steps (part of emit; recorded in both loops). Structured output:
        # masks (the constrained rows' masks: fill, gather, upload and the sampling's launch
        # after the step's launch, `_sample_guided`; or, when the runner takes them in the step, filled while the
        # step is described, part of schedule) and advance (the emitted tokens into the matchers and
        # their next masks filled in one batch, `_advance_grammars`, part of emit).
        self.host_seconds = {"schedule": 0.0, "launch": 0.0, "wait": 0.0, "emit": 0.0, "beam": 0.0,
                             "masks": 0.0, "advance": 0.0, "steps": 0}
        self._trace = StepTrace.from_env()  # None unless INFLIGHTLLM_STEP_TRACE names a folder
        self._deadlines: list[tuple[float, int, Request]] = []  # heap of waiting requests' queue deadlines
        self._deadline_seq = 0
        # Structured output: the grammar compiler (made with the first constrained request)
        # and the requests waiting for their grammar, queued outside the scheduler.
        self._grammars = None
        self._compiling: list[Request] = []
        # Asynchronous scheduling with a runner that samples after `launch` when told to
        # (`sample_guided`): constrained rows' masks are filled while the step runs, from
        # the tokens of the step before it (emitted meanwhile). Other runners (tensor
        # parallel) get the masks in the step, which then waits for the step in flight.
        self._defer_masks = self.async_scheduling and bool(getattr(self.runner, "defers_guided_sampling", False))
        # A runner whose sampler counts the sampled ids on the device (the GPU runner) needs
        # no host copy of the tokens in flight for penalties: only bad words wait for them.
        self._penalties_on_device = bool(getattr(self.runner, "penalties_follow_sampled_ids", False))
        # Sequence groups by client request id; group leaders still to fork; sequences whose
        # runner state is stale (copy-on-write, beam reassignment): sent whole next step.
        self.groups: dict[str, SequenceGroup] = {}
        self._unforked: list[Request] = []
        self._runner_reset: list[str] = []
        self._beam_updates: list[tuple[str, str, int]] = []  # for the next step (StepDescription.beam_updates)
        self._num_beam_groups = 0
        tune_gc()

    # ---- requests ---------------------------------------------------------------------
    def validate_request(self, prompt_token_ids: list[int], params: SamplingParams, priority: int = 0,
                         group: GroupParams | None = None, streaming: bool = False) -> None:
        """Raise InvalidRequestError naming the first problem. Reads only fixed settings,
        so it is safe to call from another thread than the one running steps."""
        if not prompt_token_ids:
            raise InvalidRequestError("input_ids: the prompt is empty; at least 1 token is required")
        if not rules.prompt_length_range(self.config.max_input_length).contains(len(prompt_token_ids)):
            raise InvalidRequestError(
                f"input_ids: the prompt has {len(prompt_token_ids)} tokens; allowed: up to "
                f"{self.config.max_input_length} (max_input_length)"
            )
        vocab = rules.token_id_range(self.vocab_size)
        bad = next((t for t in prompt_token_ids if not vocab.contains(t)), None)
        if bad is not None:
            raise InvalidRequestError(
                f"input_ids: token id {bad} is out of range; allowed: 0 to {self.vocab_size - 1}"
            )
        params.validate(self.vocab_size, self.config.max_output_len)
        if params.guided is not None:
            if self.config.runner == "dummy":
                raise InvalidRequestError(
                    f"{params.guided.field}: the dummy runner has no model to constrain; allowed: no constraint")
            try:
                # Parsing only (no tokenizer). Not the JSON Schema meta-schema check: 1.4-2.5 ms a
                # new schema in `jsonschema`, on the step thread (a burst of 200 distinct schemas
                # cost the running requests a third of their token rate); the compile worker runs
                # it, and a schema that fails it fails its request alone with the same error.
                check_spec(params.guided, meta_schema=False)
            except GuidedSpecError as error:
                raise InvalidRequestError(str(error)) from None
            if group is not None and group.is_group:
                raise InvalidRequestError(
                    f"{params.guided.field}: a constrained request has one output; n, best_of and "
                    "beam_width must be 1 with it (or drop the constraint)"
                )
        priorities = rules.priority_range(self.config.priority_levels)
        if not priorities.contains(priority):
            raise InvalidRequestError(f"priority: {priority} is out of range; allowed: {priorities.allowed}")
        total = len(prompt_token_ids) + params.max_tokens
        if rules.room_for_output(len(prompt_token_ids), params.max_tokens, self.max_model_len) is not None:
            raise InvalidRequestError(
                f"max_tokens: prompt ({len(prompt_token_ids)} tokens) + max_tokens ({params.max_tokens}) = "
                f"{total} exceeds the model context of {self.max_model_len} tokens"
            )
        capacity = self.block_manager.num_blocks * self.block_manager.block_size
        if total > capacity:
            raise InvalidRequestError(
                f"max_tokens: prompt + max_tokens = {total} tokens exceeds the KV cache of {capacity} tokens"
            )
        if group is not None:
            config = self.config
            group.validate(params, config.max_n, config.max_beam_width, config.max_batch_size, streaming)
        if group is not None and group.is_group:
            # A group is admitted and resumed whole. Running, its sequences share the prompt's
            # blocks; resumed after a preemption they share only what the prefix cache still
            # holds (nothing once evicted, or swapped): the unshared worst case must fit, or
            # a preempted group could wait for room that never comes.
            manager = self.block_manager
            sequences = group.num_sequences
            worst = sequences * manager.blocks_for_tokens(total)
            if worst > manager.num_blocks:
                raise InvalidRequestError(
                    f"max_tokens: {sequences} sequences of prompt + max_tokens = {total} tokens need up "
                    f"to {worst} KV blocks; the cache has {manager.num_blocks}"
                )

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        streaming: bool = False,
        arrival_time: float | None = None,
        timeout_s: float | None = None,
        group: GroupParams | None = None,
    ) -> Request:
        """Validate and enqueue a request; raises InvalidRequestError naming the problem
        (QueueFullError when `max_queue_size` requests are waiting already).

        `timeout_s`: how long it may wait in the queue before it is failed (None or 0:
        the profile's `default_timeout_microseconds`; both 0: no limit).

        `group`: several outputs (n, best_of, beam search; inflightllm.sequence_group);
        the returned request is then the group's first sequence."""
        if request_id in self.requests or request_id in self.groups:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        self.validate_request(prompt_token_ids, params, priority, group, streaming)
        limit = self.config.max_queue_size
        if limit and self.num_waiting >= limit:
            self._counters.rejected += 1
            raise QueueFullError(
                f"the engine's queue is full: {self.num_waiting} requests are waiting "
                f"(max_queue_size {limit}); try again later"
            )
        request = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            params=params,
            eos_token_ids=self.loaded.eos_token_ids,
            priority=priority,
            streaming=streaming,
            arrival_time=arrival_time if arrival_time is not None else time.monotonic(),
        )
        if group is not None and group.is_group:
            request = self._start_group(request_id, request, group)
        if not timeout_s and self.config.default_timeout_microseconds:
            timeout_s = self.config.default_timeout_microseconds / 1e6
        if timeout_s:
            request.deadline = request.arrival_time + timeout_s
            self._deadline_seq += 1
            heapq.heappush(self._deadlines, (request.deadline, self._deadline_seq, request))
        self.requests[request.request_id] = request
        if self._trace is not None:
            self._trace.added += 1
        if params.guided is not None:  # queued here until its grammar is compiled
            request.grammar_future = self.grammar_compiler().submit(params.guided)
            self._compiling.append(request)
        else:
            self.scheduler.add_request(request)
            group_ = request.group
            if group_ is not None and not group_.is_beam and request.num_prompt_tokens == 1:
                self._fork_waiting(request)
        self._counters.prompt_tokens += len(prompt_token_ids)
        return request

    def grammar_compiler(self, tokenizer=None):
        """The compiler of guided-decoding grammars (its worker thread starts on first use;
        it loads the model's tokenizer there unless given one, e.g. a test's own)."""
        if self._grammars is None:
            from inflightllm.guided.compiler import GrammarCompilerPool

            self._grammars = GrammarCompilerPool(
                getattr(self.loaded, "folder", None), self.vocab_size, self.loaded.eos_token_ids,
                tokenizer=tokenizer,
            )
        return self._grammars

    def _admit_compiled(self, outputs: list[RequestOutput]) -> None:
        """Constrained requests whose grammar is ready join the scheduler's queue; a compile
        error fails its request alone. When nothing else could run, waits briefly for a
        compile rather than spinning."""
        if not self.scheduler.has_unfinished() and self._inflight is None and not outputs:
            wait_futures([r.grammar_future for r in self._compiling], timeout=0.05, return_when=FIRST_COMPLETED)
        still: list[Request] = []
        for request in self._compiling:
            future = request.grammar_future
            if not future.done():
                still.append(request)
                continue
            request.grammar_future = None
            error = future.exception()
            if error is not None:
                message = str(error) if isinstance(error, GuidedSpecError) else (
                    f"{request.params.guided.field}: the grammar did not compile: {type(error).__name__}: {error}")
                self._fail(request, message, outputs)
                continue
            from inflightllm.guided.matcher import GuidedState

            request.guided = GuidedState(future.result(), self.vocab_size)
            self.scheduler.add_request(request)
        self._compiling = still

    # ---- sequence groups --------------------------------------------------------------
    def _start_group(self, request_id: str, template: Request, group_params: GroupParams) -> Request:
        """The group of a request with several outputs, and its first sequence (which
        takes the template's place in the queue and its deadline)."""
        from inflightllm.beam_search import BeamSearch

        group = SequenceGroup(request_id, template.params, group_params)
        if group.is_beam:
            group.beam = BeamSearch(
                beam_width=group_params.beam_width,
                max_tokens=template.params.max_tokens,
                stop_token_ids=template.stop_token_ids,
                num_eos=max(1, len(template.eos_token_ids)),
                length_penalty=group_params.length_penalty,
                early_stopping=group_params.early_stopping,
            )
            self._num_beam_groups += 1
        first = group.new_sequence(template)
        if group.is_beam:
            group.live = [first]
        elif template.num_prompt_tokens > 1:
            first.fork_at = template.num_prompt_tokens - 1  # then every sequence computes the last token
            self._unforked.append(first)
        self.groups[request_id] = group
        return first

    def _drop_group(self, group: SequenceGroup) -> None:
        if self.groups.pop(group.request_id, None) is not None and group.is_beam:
            self._num_beam_groups -= 1

    def _fork_waiting(self, first: Request) -> None:
        """A one-token prompt: nothing to share; the sequences wait to be admitted together."""
        group = first.group
        group.forked = True
        for _ in range(1, group.num_sequences):
            sequence = group.new_sequence(first)
            self.requests[sequence.request_id] = sequence
            self.scheduler.add_request(sequence)
            sequence.arrival_seq = first.arrival_seq

    def _fork(self, first: Request) -> None:
        """Parallel sampling: the first sequence computed all the prompt but its last token;
        the others share its blocks and start running beside it."""
        group = first.group
        first.fork_at = 0
        group.forked = True
        for _ in range(1, group.num_sequences):
            sequence = group.new_sequence(first)
            sequence.token_ids = list(first.token_ids)
            self.block_manager.share(first, sequence)
            sequence.num_computed_tokens = first.num_computed_tokens
            sequence.num_cached_tokens = first.num_cached_tokens
            self.requests[sequence.request_id] = sequence
            self.scheduler.start_running(sequence)

    def _fork_due(self) -> None:
        """Fork the group leaders that computed their share of the prompt."""
        still = []
        for first in self._unforked:
            if first.is_finished:
                continue
            if first.status is RequestStatus.RUNNING and first.num_computed_tokens >= first.fork_at:
                self._fork(first)
            else:
                still.append(first)
        self._unforked = still

    def _beam_steps(self, groups: list[SequenceGroup], outputs: list[RequestOutput]) -> None:
        """The groups whose live beams all have their candidates: one batched beam step
        (`step_searches`) picks every group's next beams, then each follows them."""
        from inflightllm.beam_search import step_searches

        top_ids, top_values, at_max_len = [], [], []
        max_model_len = self.max_model_len
        for group in groups:
            candidates = group.candidates
            rows = [candidates[request.request_id] for request in group.live]
            group.candidates = {}
            top_ids.append([ids for ids, _ in rows])
            top_values.append([values for _, values in rows])
            at_max_len.append(group.live[0].num_tokens + 1 >= max_model_len)
        # Per-token log probs of a finished beam (asked for): worked out from its sequence's
        # cumulative log prob after each token, only for hypotheses that finish.
        results = step_searches([group.beam for group in groups], top_ids, top_values, at_max_len,
                                lambda index, beam: groups[index].live[beam].output_token_ids,
                                lambda index, beam: groups[index].live[beam].logprobs
                                if groups[index].params.logprobs else None)
        for group, result in zip(groups, results, strict=True):
            if group.beam.done:
                self._finish_beams(group, outputs)
            else:
                self._follow_beams(group, result, outputs)

    def _follow_beams(self, group: SequenceGroup, result, outputs: list[RequestOutput]) -> None:
        """Sequences follow the next beams. A parent's first continuation keeps its sequence;
        each further one takes the sequence of a beam nobody continues (its blocks freed,
        the parent's shared: the runner copies the parent's row) or, while the group has
        fewer sequences than beams (its first step), a new one. The runner hears of it all
        through `StepDescription.beam_updates`, never by a sequence sent whole."""
        live = group.live
        group.forked = True
        continued = set(result.parents)
        dead = [request for index, request in enumerate(live) if index not in continued]
        manager = self.block_manager
        running = RequestStatus.RUNNING
        kept: set[int] = set()
        followers: list[tuple[Request, Request]] = []  # (sequence, the beam it continues)
        for parent_index in result.parents:
            parent = live[parent_index]
            if parent_index not in kept:
                kept.add(parent_index)
                followers.append((parent, parent))
                continue
            if dead and dead[-1].status is running and parent.status is running:
                sequence = dead.pop()
                # it stays in the running set, with the parent's blocks (free + share, only
                # where the two tables differ)
                manager.reassign(sequence, parent)
                sequence.table_rewritten = False
            else:
                sequence = group.new_sequence(parent)
                manager.share(parent, sequence)
                self.requests[sequence.request_id] = sequence
                if parent.status is running:
                    self.scheduler.start_running(sequence)
                else:
                    self.scheduler.add_request(sequence)
            sequence.token_ids = parent.token_ids[:]
            sequence.logprobs = parent.logprobs[:]
            sequence.num_computed_tokens = parent.num_computed_tokens
            sequence.num_cached_tokens = parent.num_cached_tokens
            sequence.first_token_time = parent.first_token_time
            followers.append((sequence, parent))
        if dead:
            for request in dead:
                self._finish(request, FinishReason.NONE, quiet=True)
            # Dead beams are forgotten (a long search would pile them up).
            group.sequences = [request for request in group.sequences if not request.is_finished]
        runner_blocks, updates = self._runner_blocks, self._beam_updates
        group.live = []
        for (sequence, parent), token, cum in zip(followers, result.token_ids, result.cum_logprobs, strict=True):
            sequence.token_ids.append(token)
            sequence.logprobs.append(cum)  # the beam's cumulative log prob so far
            parent_blocks = runner_blocks.get(parent.request_id)
            if parent_blocks is not None and sequence.request_id in runner_blocks:
                updates.append((sequence.request_id, parent.request_id, token))
                runner_blocks[sequence.request_id] = parent_blocks
            else:  # the runner does not hold them both: the sequence goes whole next step
                self._resend(sequence)
            group.live.append(sequence)
        if group.live[0].streaming:
            outputs.append(self._beam_output(group, finished=False))

    def _finish_beams(self, group: SequenceGroup, outputs: list[RequestOutput]) -> None:
        for request in list(group.live):
            self._finish(request, FinishReason.NONE, quiet=True)
        group.live = []
        outputs.append(self._beam_output(group, finished=True))

    def _beam_output(self, group: SequenceGroup, finished: bool) -> RequestOutput:
        first = group.sequences[0]
        now = time.monotonic()
        if finished:
            hypotheses = group.beam.finished
            beams = [self._strip_stop(first, hyp.token_ids) for hyp in hypotheses]
            cum = [hyp.cum_logprob for hyp in hypotheses]
            scores = [hyp.score for hyp in hypotheses]
            # A stripped stop token's log prob is left out (it stays in cum_logprob, as in transformers).
            logprobs = [hyp.token_logprobs[: len(ids)] if group.params.logprobs else []
                        for hyp, ids in zip(hypotheses, beams, strict=True)]
            reason = FinishReason.STOP if hypotheses and len(hypotheses[0].token_ids) != len(beams[0]) \
                else FinishReason.LENGTH
            self._drop_group(group)
        else:
            beams = [request.output_token_ids for request in group.live]
            cum = [request.logprobs[-1] if request.logprobs else 0.0 for request in group.live]
            scores = list(cum)
            # Per-token log probs only when asked: O(generated tokens) per beam per step.
            logprobs = [token_logprobs_of(request.logprobs) for request in group.live] \
                if group.params.logprobs else [[] for _ in group.live]
            reason = FinishReason.NONE
        best = beams[0] if beams else []
        output = RequestOutput(
            request_id=group.request_id,
            new_token_ids=list(best),
            context_ids=[],
            new_logprobs=[],
            new_top_ids=[],
            new_top_logprobs=[],
            cum_logprob=cum[0] if cum else 0.0,
            finished=finished,
            finish_reason=reason,
            num_prompt_tokens=first.num_prompt_tokens,
            num_output_tokens=len(best),
            num_cached_tokens=first.num_cached_tokens,
            beam_token_ids=[list(b) for b in beams],
            beam_cum_logprobs=cum,
            beam_scores=scores,
            beam_logprobs=logprobs,
            beam_pad_id=min(first.eos_token_ids, default=0) if first.params.end_id is None else first.params.end_id,
        )
        if finished:
            output.e2e_latency = now - first.arrival_time
            if first.first_token_time is not None:
                output.time_to_first_token = first.first_token_time - first.arrival_time
        return output

    @staticmethod
    def _strip_stop(request: Request, token_ids: list[int]) -> list[int]:
        """A finished beam's ids without its stop token (the engine never emits those)."""
        if token_ids and token_ids[-1] in request.stop_token_ids:
            return token_ids[:-1]
        return list(token_ids)

    def _resend(self, request: Request) -> None:
        """The runner's copy of this sequence is stale (its table or tokens were rewritten):
        it drops it as if preempted and gets it whole in the next step."""
        if self._runner_blocks.pop(request.request_id, None) is not None:
            self._runner_reset.append(request.request_id)

    def _group_outputs(self, request: Request, output: RequestOutput) -> list[RequestOutput]:
        """A sequence's output as its request's: the client's id, the sequence's index; the
        request is finished when its last sequence is. best_of > n: held back until all
        finished, then the n best by cumulative log probability, indexed 0 .. n - 1."""
        group = request.group
        output.request_id = group.request_id
        output.sequence_index = request.sequence_index
        output.sequence_finished = output.finished
        output.finished = group.num_unfinished == 0
        if output.finished:
            self._drop_group(group)
        params = group.group_params
        if params.best_of is None or params.best_of == params.n:
            return [output]
        if output.sequence_finished:
            output.cum_logprob = float(sum(request.logprobs[: output.num_output_tokens]))
            output.new_token_ids = request.output_token_ids
            output.new_logprobs = list(request.logprobs)
            group.finished_outputs.append(output)
        if not output.finished:
            return []
        if output.error is not None or output.finish_reason is FinishReason.CANCELLED:
            return [output]
        ranked = sorted(group.finished_outputs, key=lambda o: (-o.cum_logprob, o.sequence_index))[: params.n]
        wants = group.params.logprobs or group.params.top_logprobs > 0
        for rank, chosen in enumerate(ranked):
            chosen.sequence_index = rank
            chosen.finished = rank == len(ranked) - 1
            if not wants:
                chosen.new_logprobs = []
        return ranked

    def count_rejected(self) -> None:
        """A request refused before `add_request` (the serving loop saw the queue full)."""
        self._counters.rejected += 1

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting) + len(self._compiling)

    def _expire_waiting(self, outputs: list[RequestOutput], now: float) -> None:
        """Fail requests that waited in the queue past their deadline (never started)."""
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            deadline, _, request = heapq.heappop(heap)
            if request.is_finished or request.first_admitted:
                continue  # done, or started (a preempted request is not timed out again)
            waited_ms = (now - request.arrival_time) * 1e3
            limit_ms = (deadline - request.arrival_time) * 1e3
            self._counters.timed_out += 1
            self._fail(
                request,
                f"the request waited {waited_ms:.0f} ms in the queue, more than its timeout of "
                f"{limit_ms:.0f} ms; it was not started",
                outputs,
            )

    def _fail(self, request: Request, message: str, outputs: list[RequestOutput]) -> None:
        """End one request with an error of its own; its blocks are freed now. A sequence
        of a group fails its whole request (one error response)."""
        request.error = message
        self._counters.failed += 1
        group = request.group
        if group is not None:
            for other in group.sequences:
                if other is not request and not other.is_finished:
                    self._finish(other, FinishReason.ERROR, quiet=True)
            group.live = []
        self._finish(request, FinishReason.ERROR)
        output = self._output(request)
        if group is not None:
            if group.is_beam:
                self._drop_group(group)
                output.request_id = group.request_id
            else:
                output = self._group_outputs(request, output)[0]
        outputs.append(output)

    def abort(self, request_id: str) -> bool:
        """Cancel a request; its final output (finish_reason cancelled) comes with the next
        `step()`. Its KV blocks are freed now. Returns False if it is not in the engine."""
        group = self.groups.get(request_id)
        if group is not None:
            return self._abort_group(group)
        request = self.requests.get(request_id)
        if request is None or request.is_finished:
            return False
        self._finish(request, FinishReason.CANCELLED)
        self._counters.pending.append(self._output(request))
        return True

    def _abort_group(self, group: SequenceGroup) -> bool:
        live = [request for request in group.sequences if not request.is_finished]
        if not live:
            return False
        if group.is_beam:  # one final output: the beams so far (finished ones, else the live ones)
            for request in live:
                self._finish(request, FinishReason.CANCELLED, quiet=True)
            output = self._beam_output(group, finished=bool(group.beam.finished))
            if not group.beam.finished:
                self._drop_group(group)
                output.finished = True
            output.finish_reason = FinishReason.CANCELLED
            group.live = []
            self._counters.pending.append(output)
            return True
        for request in live:  # one at a time: only the last output finishes the request
            self._finish(request, FinishReason.CANCELLED)
            self._counters.pending.extend(self._group_outputs(request, self._output(request)))
        return True

    def has_unfinished(self) -> bool:
        return (self.scheduler.has_unfinished() or bool(self._counters.pending) or self._inflight is not None
                or bool(self._compiling))

    # ---- the step ---------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One engine iteration (`_step`), recorded by the step trace when it is on
        (`INFLIGHTLLM_STEP_TRACE`, inflightllm/step_trace.py)."""
        trace = self._trace
        if trace is None:
            return self._step()
        started = trace.begin(self.host_seconds)
        outputs = self._step()
        trace.end(started, self.host_seconds, self._counters.tokens_last_step, len(self.scheduler.running),
                  len(self.scheduler.waiting), len(outputs))
        return outputs

    def _step(self) -> list[RequestOutput]:
        """One engine iteration. Synchronous: schedule, run, sample, emit. Asynchronous
        (`async_scheduling`, GPU): schedule and launch step N+1 first, then wait for step
        N's sampled tokens and emit them, so the host work between steps overlaps the GPU."""
        outputs, self._counters.pending = self._counters.pending, []
        if self._deadlines:
            self._expire_waiting(outputs, time.monotonic())
        if self._compiling:
            self._admit_compiled(outputs)
        if self._unforked:
            self._fork_due()
        if not self.async_scheduling:
            scheduled = self.scheduler.schedule()
            self._counters.tokens_last_step = scheduled.num_batched_tokens
            if scheduled.is_empty and not scheduled.swapped_out:
                self._forget_preempted(scheduled)
                return outputs
            try:
                description = self._describe(scheduled)
                started = time.perf_counter()
                sampled = self.runner.execute(description)
            except Exception as error:  # fail this step's requests only; the engine goes on
                self._fail_step(scheduled, error, outputs)
                return outputs
            if self._counters.tokens_last_step > len(scheduled.scheduled):  # a prefill chunk in it
                self.costs.observe_step(time.perf_counter() - started, self._counters.tokens_last_step)
            self._counters.steps += 1
            self._count_swaps(scheduled)
            size = self.block_manager.block_size
            for item in scheduled.scheduled:
                request = item.request
                request.num_computed_tokens += item.num_new_tokens
                if request.num_computed_tokens >= (request.num_registered_blocks + 1) * size:
                    self.block_manager.cache_full_blocks(request)  # a block may have filled
            if self._unforked:
                self._fork_due()
            self._emit(sampled, outputs)
            return outputs
        if self._inflight is not None and self._needs_history():
            self._resolve(outputs)  # penalties and bad words read the tokens still in flight
        times = self.host_seconds
        start = time.perf_counter()
        scheduled = self.scheduler.schedule()
        self._counters.tokens_last_step = scheduled.num_batched_tokens
        launched = None
        launch_timing = None
        deferred: list[Request] = []  # constrained rows whose masks come after the launch
        if scheduled.is_empty and not scheduled.swapped_out:
            self._forget_preempted(scheduled)
        else:
            try:
                description = self._describe(scheduled)
                described = time.perf_counter()
                times["schedule"] += described - start
                handle = self.runner.launch(description)
                deferred = [self.requests[request_id] for request_id in description.guided_request_ids
                            ] if description.guided_bitmask is None else []
                start = time.perf_counter()
                times["launch"] += start - described
                times["steps"] += 1
            except Exception as error:
                self._fail_step(scheduled, error, outputs)
            else:
                self._counters.steps += 1
                self._count_swaps(scheduled)
                tokens = self._counters.tokens_last_step
                if tokens > len(scheduled.scheduled):  # a prefill chunk in it: timed when its tokens come
                    launch_timing = (described, tokens)
                for item in scheduled.scheduled:
                    request = item.request
                    samples = item.samples
                    request.num_computed_tokens += item.num_new_tokens
                    if samples:  # its next token is being sampled on the device
                        request.num_inflight += 1
                        if (request.num_output_tokens + request.num_inflight >= request.params.max_tokens
                                or request.num_tokens + request.num_inflight >= self.max_model_len):
                            request.final_pending = True  # finishes by length: nothing more to schedule
                launched = (handle, [item.request for item in scheduled.scheduled])
                if self._unforked:
                    self._fork_due()
        if self._inflight is not None:
            self._resolve(outputs)
        if launched is not None and deferred:
            self._sample_guided(launched[0], deferred, outputs)
        self._inflight = launched
        self._inflight_timing = launch_timing
        return outputs

    def _forget_preempted(self, scheduled: SchedulerOutput) -> None:
        """A step with nothing to run still preempted (a whole group can preempt itself):
        the runner hears of it with the next step, before it gets them whole again."""
        for request in scheduled.preempted:
            if self._runner_blocks.pop(request.request_id, None) is not None:
                self._runner_reset.append(request.request_id)

    def _count_swaps(self, scheduled: SchedulerOutput) -> None:
        """Blocks a step that ran copied to host memory and back (swap preemptions)."""
        if not (scheduled.swapped_out or scheduled.swapped_in):
            return
        counters = self._counters
        counters.swapped_out_blocks += sum(len(block_ids) for _, block_ids in scheduled.swapped_out)
        counters.swapped_in_blocks += sum(len(block_ids) for _, block_ids in scheduled.swapped_in)

    def reconfigure(self, **changes) -> None:
        """Change scheduling settings of an idle engine (perf/bench_rows.py compares capacity
        policies and preemption modes on one loaded model): `capacity_policy`,
        `kv_watermark`, `preemption_mode`, `swap_space_blocks`, and `max_batch_size` /
        `max_num_tokens` up to what the engine was built with (`built_limits`: its buffers
        and CUDA graphs), the token budget at least the batch. The block manager and the
        scheduler start afresh (an empty prefix cache, so variants compare fairly); the
        runner, its KV memory and the measured costs stay."""
        allowed = ("capacity_policy", "kv_watermark", "preemption_mode", "swap_space_blocks", *self.built_limits)
        unknown = sorted(set(changes) - set(allowed))
        if unknown:
            raise ValueError(f"reconfigure: {', '.join(unknown)} cannot change; allowed: {', '.join(allowed)}")
        for name, built in self.built_limits.items():
            value = changes.get(name)
            if value is not None and not (isinstance(value, int) and 1 <= value <= built):
                raise ValueError(f"reconfigure: {name} {value!r}: allowed 1 to {built} (what the engine was built with)")
        limits = {name: changes.get(name, getattr(self.config, name)) for name in self.built_limits}
        if limits["max_num_tokens"] < limits["max_batch_size"]:
            raise ValueError(f"reconfigure: max_num_tokens {limits['max_num_tokens']} is less than max_batch_size "
                             f"{limits['max_batch_size']}; a step must hold a token of every running request")
        if self.has_unfinished() or self.requests:
            raise RuntimeError("reconfigure: the engine has unfinished requests; allowed only when idle")
        self.config = dataclasses.replace(self.config, **changes)
        manager = self.block_manager  # the host tier starts empty too (its slots are overwritten as reused)
        self._new_block_manager(manager.num_blocks, manager.host_tier.num_blocks if manager.host_tier else 0)
        self.scheduler = Scheduler(self.config, self.block_manager, self.costs)

    def _new_block_manager(self, num_blocks: int, num_host_blocks: int) -> None:
        """An empty block manager (and host tier, with host blocks) for the config."""
        config = self.config
        host_tier = HostKVTier(num_host_blocks, config.block_size) if num_host_blocks > 0 else None
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_kv_cache_reuse, host_tier)
        self._step_transfers: tuple[list, list] = ([], [])  # the last described step's host-tier copies

    def _fail_step(self, scheduled: SchedulerOutput, error: Exception, outputs: list[RequestOutput]) -> None:
        """A step that raised fails its own requests only; the engine goes on."""
        logger.exception("engine step failed; failing the %d requests of the step", len(scheduled.scheduled))
        message = f"engine step failed: {type(error).__name__}: {error}"
        for request, _ in scheduled.swapped_out:  # their copies may not have happened: recompute
            self.scheduler._release_swap(request)
            request.num_computed_tokens = 0
        for item in scheduled.scheduled:
            if not item.request.is_finished:
                self._fail(item.request, message, outputs)
        # The step's host-tier copies may not have happened: forget what they filled.
        self.block_manager.discard_transfers(*self._step_transfers)
        self._step_transfers = ([], [])

    def _needs_history(self) -> bool:
        # Beam search picks the next tokens on the host: nothing runs ahead of it.
        if self._num_beam_groups > 0:
            return True
        needs = (lambda request: bool(request.banned_multi)) if self._penalties_on_device else (
            lambda request: request.needs_history)
        if self._defer_masks:
            return any(needs(request) for request in self.scheduler.running)
        return any(needs(request) or request.guided is not None for request in self.scheduler.running)

    def _resolve(self, outputs: list[RequestOutput]) -> None:
        """Wait for the step in flight and emit its tokens (asynchronous scheduling)."""
        handle, scheduled = self._inflight
        timing, self._inflight = self._inflight_timing, None
        self._inflight_timing = None
        start = time.perf_counter()
        try:
            sampled = handle.result()
            done = time.perf_counter()
            if timing is not None:  # the device ran it from its launch or the previous step's end
                launched_at, tokens = timing
                self.costs.observe_step(done - max(launched_at, self._last_result_time), tokens)
            self._last_result_time = done
        except Exception as error:  # the step failed on the device: its requests fail alone
            logger.exception("engine step failed; failing the %d requests of the step", len(scheduled))
            message = f"engine step failed: {type(error).__name__}: {error}"
            for request in scheduled:
                if not request.is_finished:
                    self._fail(request, message, outputs)
            return
        waited = time.perf_counter()
        # Only when a block may have filled (`cache_full_blocks` would return at once
        # otherwise): most steps add one token to each request, a block every block_size.
        size = self.block_manager.block_size
        for request in scheduled:
            if (request.num_computed_tokens >= (request.num_registered_blocks + 1) * size
                    and not request.is_finished):
                self.block_manager.cache_full_blocks(request)
        self._emit(sampled, outputs)
        self.host_seconds["wait"] += waited - start
        self.host_seconds["emit"] += time.perf_counter() - waited

    def _emit(self, sampled, outputs: list[RequestOutput]) -> None:
        """Append each sampled token to its request, check stops, collect outputs; a
        request whose sampling or stop handling failed fails alone."""
        for request_id, message in sampled.failed.items():
            request = self.requests.get(request_id)
            if request is not None and not request.is_finished:
                self._fail(request, message, outputs)
        now = time.monotonic()
        # Per generated token: the lookups hoisted out of the loop. A request that does not
        # stream and has not finished has nothing to send (`_output` would return None), so
        # it is not asked: with stream=false that is every token but each request's last.
        get = self.requests.get
        token_ids, logprobs = sampled.token_ids, sampled.logprobs
        top_ids, top_logprobs = sampled.top_ids, sampled.top_logprobs
        none = FinishReason.NONE
        check_stop, output_of = self._check_stop, self._output
        generated = 0
        beam_groups = None
        if self._grammars is not None and self._grammars.mask_threads:
            self._advance_grammars(sampled)
        for row, request_id in enumerate(sampled.request_ids):
            request = get(request_id)
            if request is None:
                continue  # finished or aborted while its step was in flight
            if request.num_inflight:
                request.num_inflight -= 1
            if request.group is not None and request.group.is_beam:  # candidates, not a token
                request.group.candidates[request_id] = (top_ids[row], top_logprobs[row])
                if request.first_token_time is None:
                    request.first_token_time = now
                beam_groups = beam_groups or []
                beam_groups.append(request.group)
                generated += 1
                continue
            request.token_ids.append(token_ids[row])
            request.logprobs.append(logprobs[row] or 0.0)
            if request.params.top_logprobs:  # read by `_output` only then: no list a token kept otherwise
                request.top_logprob_ids.append(top_ids[row])
                request.top_logprob_values.append(top_logprobs[row])
            if request.first_token_time is None:
                request.first_token_time = now
            request.last_token_time = now
            generated += 1
            try:
                if request.guided is not None:
                    reason = self._advance_grammar(request, token_ids[row])
                    if reason is FinishReason.ERROR:
                        self._fail(request, f"{request.params.guided.field}: the sampled token "
                                            f"{token_ids[row]} is not allowed by the grammar", outputs)
                        continue
                    if reason is none:
                        reason = check_stop(request)
                else:
                    reason = check_stop(request)
                if reason is not none:
                    self._finish(request, reason)
                elif not request.streaming:
                    continue
                output = output_of(request)
            except Exception as error:  # this request fails alone
                logger.exception("stop handling failed for request %s", request_id)
                if not request.is_finished:
                    self._fail(request, f"stop handling failed: {type(error).__name__}: {error}", outputs)
                continue
            if output is not None:
                if request.group is None:
                    outputs.append(output)
                else:
                    outputs.extend(self._group_outputs(request, output))
        self._counters.generation_tokens += generated
        if beam_groups:
            ready = [group for group in dict.fromkeys(beam_groups)
                     if group.live and all(r.request_id in group.candidates for r in group.live)]
            if ready:
                start = time.perf_counter()
                self._beam_steps(ready, outputs)
                self.host_seconds["beam"] += time.perf_counter() - start

    def _advance_grammars(self, sampled) -> None:
        """The constrained rows' matchers take their tokens and fill their next masks in one
        batch, before `_emit`'s loop (which then finds both done): the fills run on
        xgrammar's threads instead of one by one here."""
        states, tokens = [], []
        get = self.requests.get
        for row, request_id in enumerate(sampled.request_ids):
            request = get(request_id)
            if request is not None and request.guided is not None and (request.group is None
                                                                      or not request.group.is_beam):
                states.append(request.guided)
                tokens.append(sampled.token_ids[row])
        if len(states) > 1:
            from inflightllm.guided.matcher import advance_batch

            start = time.perf_counter()
            advance_batch(states, tokens, self._grammars.batch_matcher(), self._grammars.accept_executor(),
                          self._grammars.mask_ring)
            self.host_seconds["advance"] += time.perf_counter() - start

    def _advance_grammar(self, request: Request, token: int) -> FinishReason:
        """Move a constrained request's grammar over its new token. ERROR: the grammar
        refused it; STOP: the grammar is done (a stop token ended it, or nothing but a
        stop token may follow: the request ends now, so `min_tokens`, which bans stop
        tokens, never leaves a row with no token to sample); NONE: it goes on."""
        guided = request.guided
        if not guided.accept(token):
            return FinishReason.ERROR
        if guided.is_terminated:  # it took a stop token (EOS)
            if token in request.stop_token_ids:
                self._drop_last(request, 1)  # not part of the output, as `_check_stop` has it
            return FinishReason.STOP
        if guided.allows_only(request.eos_token_ids):
            self._check_stop(request)  # drops a stop sequence that ends here; the grammar is done: STOP
            return FinishReason.STOP
        return FinishReason.NONE

    def _guided_masks(self, step: StepDescription, scheduled: SchedulerOutput) -> None:
        """The allowed next tokens of the constrained requests that sample this step, one
        row each, filled on the host from their matchers."""
        rows = [item.request for item in scheduled.scheduled if item.request.guided is not None and item.samples]
        if rows:
            step.guided_request_ids = [request.request_id for request in rows]
            if not self._defer_masks:  # else filled after launch (`_sample_guided`)
                start = time.perf_counter()
                step.guided_bitmask = self._bitmask(rows)
                self.host_seconds["masks"] += time.perf_counter() - start  # here part of schedule

    def _bitmask(self, requests: list[Request], out: np.ndarray | None = None) -> np.ndarray:
        """[len(requests), words] int32: each request's allowed next tokens; all allowed for
        one that ended meanwhile (its token is dropped). `out`: where to write the rows (the
        GPU runner's pinned upload buffer), else a new array."""
        from inflightllm.guided.matcher import fill_masks, gather_masks

        batch = self.grammar_compiler().batch_matcher() if len(requests) > 1 else None
        if batch is not None:  # first masks of newly admitted requests, and any not filled yet
            fill_masks([r.guided for r in requests if not r.is_finished], batch, self._grammars.mask_ring)
        return gather_masks([None if request.is_finished or request.guided.is_terminated else request.guided
                             for request in requests], out)

    def _sample_guided(self, handle, requests: list[Request], outputs: list[RequestOutput]) -> None:
        """The launched step's constrained rows get their masks (their matchers have just
        taken the previous step's tokens) and the runner samples the step. A handle that
        offers `mask_buffer(rows, words)` (the GPU runner: pinned memory it uploads from)
        gets the rows gathered straight into it: one host copy, no per-step allocation."""
        start = time.perf_counter()
        try:
            mask_buffer = getattr(handle, "mask_buffer", None)
            out = mask_buffer(len(requests), requests[0].guided.num_words) if mask_buffer is not None else None
            handle.sample_guided(self._bitmask(requests, out))
        except Exception as error:  # its requests fail alone, as a failed step's do
            logger.exception("guided sampling failed; failing the %d constrained requests", len(requests))
            for request in requests:
                if not request.is_finished:
                    self._fail(request, f"engine step failed: {type(error).__name__}: {error}", outputs)
        self.host_seconds["masks"] += time.perf_counter() - start

    def _describe(self, scheduled: SchedulerOutput) -> StepDescription:
        """The step for the runner: requests it does not hold are sent whole, the others
        as deltas (new block ids, computed count); preempted and finished ids once."""
        step = StepDescription(finished_request_ids=self._runner_finished)
        self._runner_finished = []
        if self._beam_updates:
            step.beam_updates, self._beam_updates = self._beam_updates, []
        if self._runner_reset:
            step.preempted_request_ids.extend(self._runner_reset)
            self._runner_reset = []
        manager = self.block_manager
        if manager.pending_copies:
            step.block_copies, manager.pending_copies = manager.pending_copies, []
        step.kv_offloads, step.kv_onloads = self._step_transfers = manager.take_transfers()
        step.swap_out = [(request.request_id, block_ids) for request, block_ids in scheduled.swapped_out]
        step.swap_in = [(request.request_id, block_ids) for request, block_ids in scheduled.swapped_in]
        for request in scheduled.preempted:
            if self._runner_blocks.pop(request.request_id, None) is not None:
                step.preempted_request_ids.append(request.request_id)
        # Per scheduled request per step: the lookups hoisted; a held request's entries
        # (`_runner_held`, and `_runner_blocks` when it got no new block) are already right.
        runner_blocks = self._runner_blocks
        cached_requests, packed = step.cached_requests, step.scheduled
        for item in scheduled.scheduled:
            request = item.request
            request_id = request.request_id
            table = request.block_table
            sent = runner_blocks.get(request_id)
            if request.table_rewritten and sent is not None:  # copy-on-write replaced a block
                request.table_rewritten = False
                cached_requests.append(CachedRequestData(request_id, [], request.num_computed_tokens, list(table)))
                runner_blocks[request_id] = len(table)
            elif sent is None:
                request.table_rewritten = False
                step.new_requests.append(
                    NewRequestData(
                        request_id=request_id,
                        prompt_token_ids=request.prompt_token_ids,
                        output_token_ids=request.output_token_ids,
                        block_ids=list(table),
                        num_computed_tokens=request.num_computed_tokens,
                        params=request.params,
                        eos_token_ids=tuple(sorted(request.eos_token_ids)),
                    )
                )
                runner_blocks[request_id] = len(table)
                self._runner_held.add(request_id)
            else:
                cached_requests.append(CachedRequestData(request_id, table[sent:], request.num_computed_tokens))
                if sent != len(table):
                    runner_blocks[request_id] = len(table)
            packed.append((request_id, item.num_new_tokens))
        if self._grammars is not None:
            self._guided_masks(step, scheduled)
        return step

    def _drop_last(self, request: Request, count: int) -> None:
        del request.token_ids[-count:]
        del request.logprobs[-count:]
        del request.top_logprob_ids[-count:]
        del request.top_logprob_values[-count:]

    def _check_stop(self, request: Request) -> FinishReason:
        """Whether the token just appended ends the request. Costs O(stop sequence
        lengths), never O(output length): it looks at the tail of `token_ids` only."""
        tokens = request.token_ids
        token = tokens[-1]
        if token in request.stop_token_ids:  # the sampler bans these below min_tokens
            self._drop_last(request, 1)
            return FinishReason.STOP
        num_tokens = len(tokens)
        num_output = num_tokens - request.num_prompt_tokens
        if request.stop_multi:
            min_tokens = request.params.min_tokens
            for sequence in request.stop_multi:
                length = len(sequence)
                # A stop sequence counts only once min_tokens tokens precede it.
                if (
                    token == sequence[-1]
                    and num_output - length >= min_tokens
                    and tuple(tokens[-length:]) == sequence
                ):
                    self._drop_last(request, length)
                    return FinishReason.STOP
        if num_output >= request.params.max_tokens or num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return FinishReason.NONE

    @staticmethod
    def _holdback(request: Request) -> int:
        """Trailing tokens that could still become a stop sequence (never sent early).
        O(sum of squared stop lengths) per call, whatever the output length."""
        if not request.stop_multi:
            return 0
        tokens = request.token_ids
        num_output = request.num_output_tokens
        longest = 0
        for sequence in request.stop_multi:
            for length in range(min(len(sequence) - 1, num_output), longest, -1):
                if tokens[-length] == sequence[0] and tuple(tokens[-length:]) == sequence[:length]:
                    longest = length
                    break
        return longest

    def _finish(self, request: Request, reason: FinishReason, quiet: bool = False) -> None:
        """`quiet`: a sequence of a group that ends without an output of its own (a beam
        nobody continues, the siblings of a failed sequence)."""
        if request.grammar_future is not None:  # cancelled or timed out while its grammar compiled
            request.grammar_future = None
            self._compiling.remove(request)
        if request.group is not None and not request.is_finished:
            request.group.num_unfinished -= 1
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.finish_time = time.monotonic()
        self.scheduler.remove(request)
        del self.requests[request.request_id]
        self._runner_blocks.pop(request.request_id, None)
        if request.request_id in self._runner_held:
            self._runner_held.discard(request.request_id)
            self._runner_finished.append(request.request_id)

    def _output(self, request: Request) -> RequestOutput | None:
        """The output due for this request now, or None (nothing to send yet). Copies
        only the new tokens and the context window: O(new tokens) per call."""
        tokens = request.token_ids
        base = request.num_prompt_tokens
        num_output = len(tokens) - base
        finished = request.status is RequestStatus.FINISHED
        # `_holdback` is 0 without multi-token stop sequences: not called then.
        upto = num_output if finished or not request.stop_multi else num_output - self._holdback(request)
        start = request.num_sent_tokens
        if not finished:
            if not request.streaming or upto <= start:
                return None
            if start > 0 and upto - start < self.config.stream_interval:
                return None
        params = request.params
        wants_logprobs = params.logprobs or params.top_logprobs > 0
        if wants_logprobs:
            request.cum_logprob_sent += float(sum(request.logprobs[start:upto]))
        output = RequestOutput(
            request_id=request.request_id,
            new_token_ids=tokens[base + start : base + upto],
            context_ids=context_window(tokens, base + start, base, self.vocabulary),
            new_logprobs=request.logprobs[start:upto] if wants_logprobs else [],
            new_top_ids=request.top_logprob_ids[start:upto] if params.top_logprobs else [],
            new_top_logprobs=request.top_logprob_values[start:upto] if params.top_logprobs else [],
            cum_logprob=request.cum_logprob_sent if wants_logprobs else 0.0,
            finished=finished,
            finish_reason=request.finish_reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=upto,
            num_cached_tokens=request.num_cached_tokens,
            error=request.error,
        )
        request.num_sent_tokens = upto
        if finished:
            end = request.finish_time
            output.e2e_latency = end - request.arrival_time
            if request.first_token_time is not None:
                output.time_to_first_token = request.first_token_time - request.arrival_time
                if num_output > 1:
                    output.time_per_output_token = (request.last_token_time - request.first_token_time) / (
                        num_output - 1
                    )
        return output

    # ---- introspection ----------------------------------------------------------------
    def stats(self) -> EngineStats:
        manager = self.block_manager
        link = self.host_link
        block_bytes = link.bytes_per_block if link is not None else 0  # unknown without a host link
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_preemptions_total=self.scheduler.num_preemptions,
            num_blocks_total=manager.num_blocks,
            num_blocks_used=manager.num_used_blocks,
            num_blocks_free=manager.num_free_blocks,
            num_blocks_cached=manager.num_cached_blocks,
            prefix_cache_queries=manager.prefix_cache_queries,
            prefix_cache_hits=manager.prefix_cache_hits,
            num_tokens_last_step=self._counters.tokens_last_step,
            prompt_tokens_total=self._counters.prompt_tokens,
            generation_tokens_total=self._counters.generation_tokens,
            num_steps_total=self._counters.steps,
            kv_usage_at_first_preemption=self.scheduler.kv_usage_at_first_preemption,
            num_swapped_out_total=self.scheduler.num_swapped_out,
            num_failed_total=self._counters.failed,
            num_timed_out_total=self._counters.timed_out,
            num_rejected_total=self._counters.rejected,
            num_shared_blocks=manager.num_shared_blocks,
            num_cow_copies_total=manager.cow_copies_total,
            num_recomputed_tokens_total=self.scheduler.num_recomputed_tokens,
            num_swapped_out_blocks_total=self._counters.swapped_out_blocks,
            num_swapped_in_blocks_total=self._counters.swapped_in_blocks,
            swapped_out_bytes_total=self._counters.swapped_out_blocks * block_bytes,
            swapped_in_bytes_total=self._counters.swapped_in_blocks * block_bytes,
            host_link_bytes_per_second=link.bytes_per_second if link is not None else None,
            prefill_seconds_per_token=self.costs.prefill_seconds_per_token,
            **self._host_tier_stats(),
        )

    def _host_tier_stats(self) -> dict:
        tier = self.block_manager.host_tier
        if tier is None:
            return {}
        return {
            "host_kv_blocks_total": tier.num_blocks,
            "host_kv_blocks_held": tier.num_held_blocks,
            "host_kv_offloaded_blocks_total": tier.offloaded_blocks_total,
            "host_kv_onloaded_blocks_total": tier.onloaded_blocks_total,
            "host_kv_bytes_per_block": int(getattr(self.runner, "host_kv_bytes_per_block", 0) or 0),
            "prefix_cache_host_hits": self.block_manager.host_hit_tokens,
        }
