"""Runs one step described by a `StepDescription`: keeps its own per-request state,
packs the step into flat tensors, runs the model, samples. Knows tensors, not policy.

`ModelRunner` is the CPU runner (the exact torch reference attention, the reference
sampler). `make_model_runner` picks the CUDA runner (`inflightllm.gpu.runner`) for GPU
engines; both take the same step descriptions and return the same `SampledTokens`.
"""

from __future__ import annotations

import torch

from inflightllm.attention import AttentionBackend, SequenceSlice, make_attention_backend
from inflightllm.guided.matcher import apply_step_bitmask
from inflightllm.host_kv_tier import num_host_blocks
from inflightllm.kv_pressure import measure_host_link
from inflightllm.models.loader import LoadedModel
from inflightllm.request import Request
from inflightllm.sampler import Sampler
from inflightllm.step import NewRequestData, SampledTokens, StepDescription


def state_for(states: dict[str, Request], new: NewRequestData) -> Request:
    """The runner's copy of a request sent whole: created on first sight, reused when it
    comes back after a preemption (so a seeded generator keeps its stream); its tokens
    are the prompt plus what it generated so far."""
    state = states.get(new.request_id)
    if state is None:
        state = Request(
            request_id=new.request_id,
            prompt_token_ids=list(new.prompt_token_ids),
            params=new.params,
            eos_token_ids=frozenset(new.eos_token_ids),
        )
        states[new.request_id] = state
    state.token_ids = list(new.prompt_token_ids) + list(new.output_token_ids)
    return state


class RequestStates:
    """The runner's own copy of each request: tokens, block table, computed count, and
    the sampling state (seeded generator, stop/ban sets) in a private `Request`."""

    def __init__(self):
        self.requests: dict[str, Request] = {}
        self.swapped: dict[str, object] = {}  # request id -> attention backend's swap handle

    def update(self, step: StepDescription) -> None:
        if step.beam_updates:
            self.apply_beam_updates(step.beam_updates)
        for request_id in step.finished_request_ids:
            self.requests.pop(request_id, None)
            self.swapped.pop(request_id, None)
        for new in step.new_requests:
            state = state_for(self.requests, new)
            state.block_table = list(new.block_ids)
            state.num_computed_tokens = new.num_computed_tokens
        for cached in step.cached_requests:
            state = self.requests[cached.request_id]
            if cached.block_ids is not None:  # copy-on-write rewrote it
                state.block_table = list(cached.block_ids)
            state.block_table.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    def apply_beam_updates(self, updates: list[tuple[str, str, int]]) -> None:
        """`StepDescription.beam_updates`: every source read first (its tokens, table and
        count as the last step left them), then each request rewritten."""
        requests = self.requests
        sources = {source: (requests[source].token_ids, requests[source].block_table,
                            requests[source].num_computed_tokens) for _, source, _ in updates}
        for request_id, source, token in updates:
            state = requests[request_id]
            tokens, table, computed = sources[source]
            if request_id == source:  # in place: a copy of it reads all but its last token
                state.token_ids[-1] = token
            else:
                state.token_ids = tokens[:-1] + [token]
                state.block_table = list(table)
                state.num_computed_tokens = computed

    def __getitem__(self, request_id: str) -> Request:
        return self.requests[request_id]


class ModelRunner:
    """Owns the model and the KV cache of one CPU device."""

    def __init__(
        self,
        loaded: LoadedModel,
        num_blocks: int,
        block_size: int,
        device_kind: str = "cpu",
        sampler_seed: int | None = None,
        kv_cache_dtype: str = "auto",
        host_kv_cache_bytes: int = 0,
    ):
        self.loaded = loaded
        self.model = loaded.model
        self.device = loaded.device
        arch = loaded.arch
        self.attention: AttentionBackend = make_attention_backend(
            device_kind,
            num_heads=arch.num_heads,
            num_kv_heads=arch.num_kv_heads,
            head_dim=arch.head_dim,
            sliding_window=arch.sliding_window,
            kv_cache_dtype=kv_cache_dtype,
            kv_scales=getattr(loaded, "kv_scales", None),
        )
        self.attention.allocate_kv_cache(
            num_blocks, block_size, arch.num_layers, arch.num_kv_heads, arch.head_dim, loaded.dtype, self.device
        )
        self.num_blocks = num_blocks
        # Measured once, before any request: what `preemption_mode: auto` weighs a swap by.
        self.host_link = measure_host_link(self.attention.key_cache, self.attention.value_cache, num_blocks)
        # The host KV tier (engine.host_kv_cache_bytes): ordinary CPU tensors of the cache's
        # shape, so CI runs the tier's copies for real.
        self.num_host_blocks = num_host_blocks(host_kv_cache_bytes, self.host_link.bytes_per_block)
        self.host_kv_bytes_per_block = 0
        if self.num_host_blocks:
            self.host_kv_bytes_per_block = self.attention.allocate_host_tier(self.num_host_blocks)
        self.states = RequestStates()
        self.sampler = Sampler(sampler_seed)

    # The engine may send a step whose constrained rows' masks come after `launch`
    # (`sample_guided`), filled while the step runs (asynchronous scheduling).
    defers_guided_sampling = True

    def launch(self, step: StepDescription) -> CompletedStep | DeferredSamplingStep:
        """Asynchronous scheduling's entry: on the CPU the step runs at once. A step whose
        guided masks are not in it yet (`guided_bitmask` None) runs its model now and
        samples when `sample_guided` brings them."""
        if step.guided_request_ids and step.guided_bitmask is None:
            prepared = self._run_model(step)
            if prepared is None:
                return CompletedStep(SampledTokens())
            return DeferredSamplingStep(lambda bitmask: self._sample(step, *prepared, bitmask))
        return CompletedStep(self.execute(step))

    def execute(self, step: StepDescription) -> SampledTokens:
        prepared = self._run_model(step)
        if prepared is None:
            return SampledTokens()
        return self._sample(step, *prepared, step.guided_bitmask)

    def _run_model(self, step: StepDescription) -> tuple[list[Request], torch.Tensor] | None:
        """Apply the step's state changes and run the model: (the requests that sample,
        their logits [num_sampling, vocab] float32), or None when none samples."""
        # Swaps first: a swapped-out request's blocks may be handed to another request in
        # this very step, and this step's forward writes into them.
        for request_id, block_ids in step.swap_out:
            self.states.swapped[request_id] = self.attention.swap_out(block_ids)
        if step.kv_offloads:  # host tier: evicted blocks out before anything writes them
            self.attention.offload_blocks(step.kv_offloads)
        if step.block_copies:  # copy-on-write: after the swap-outs read, before anything writes
            self.attention.copy_blocks(step.block_copies)
        for request_id, block_ids in step.swap_in:
            self.attention.swap_in(self.states.swapped.pop(request_id), block_ids)
        if step.kv_onloads:  # host tier: prefix hits back into their fresh blocks
            self.attention.onload_blocks(step.kv_onloads)
        for request_id in step.finished_request_ids:
            handle = self.states.swapped.pop(request_id, None)
            if handle is not None:
                self.attention.discard_swapped(handle)
        self.states.update(step)
        if not step.scheduled:
            return None
        sequences: list[SequenceSlice] = []
        token_chunks: list[list[int]] = []
        last_positions: list[int] = []
        sampling: list[Request] = []
        offset = 0
        for request_id, num_new in step.scheduled:
            state = self.states[request_id]
            start = state.num_computed_tokens
            end = start + num_new
            token_chunks.append(state.token_ids[start:end])
            sequences.append(
                SequenceSlice(query_start=offset, query_len=num_new, context_len=end, block_table=tuple(state.block_table))
            )
            offset += num_new
            if end == state.num_tokens:
                last_positions.append(offset - 1)
                sampling.append(state)
        input_ids = torch.tensor([t for chunk in token_chunks for t in chunk], dtype=torch.int64, device=self.device)
        metadata = self.attention.build_metadata(sequences, self.device)
        hidden = self.model(input_ids, self.attention, metadata)  # [num_tokens, hidden]
        if not sampling:
            return None
        selected = hidden[torch.tensor(last_positions, dtype=torch.int64, device=self.device)]
        return sampling, self.model.compute_logits(selected)  # [num_sampling, vocab] float32

    def _sample(self, step: StepDescription, sampling: list[Request], logits: torch.Tensor,
                bitmask) -> SampledTokens:
        result = SampledTokens()
        if step.guided_request_ids:  # structured output: the constrained rows' masks, one call
            apply_step_bitmask(logits, step.guided_request_ids, bitmask, [state.request_id for state in sampling])
        sampled = self.sampler(logits, sampling)
        for row, state in enumerate(sampling):
            if sampled.errors[row] is not None:  # this request fails alone; the others go on
                result.failed[state.request_id] = sampled.errors[row]
                self.states.requests.pop(state.request_id, None)
                continue
            state.token_ids.append(sampled.token_ids[row])
            result.request_ids.append(state.request_id)
            result.token_ids.append(sampled.token_ids[row])
            result.logprobs.append(sampled.logprobs[row])
            result.top_ids.append(sampled.top_ids[row])
            result.top_logprobs.append(sampled.top_logprobs[row])
        return result


class CompletedStep:
    """A launched step whose result is already there (runners that run synchronously)."""

    def __init__(self, result: SampledTokens):
        self._result = result

    def sample_guided(self, bitmask) -> None:
        """Nothing waits for masks here (see DeferredSamplingStep)."""

    def result(self) -> SampledTokens:
        return self._result


class DeferredSamplingStep:
    """A launched step whose model has run and whose sampling waits for the constrained
    rows' masks (`sample_guided`, [len(step.guided_request_ids), words] int32)."""

    def __init__(self, sample):
        self._sample = sample
        self._result: SampledTokens | None = None

    def sample_guided(self, bitmask) -> None:
        self._result = self._sample(bitmask)

    def result(self) -> SampledTokens:
        if self._result is None:
            raise RuntimeError("the step's guided masks never came (sample_guided was not called)")
        return self._result


def make_model_runner(loaded: LoadedModel, config, num_blocks: int | None, sampler_seed: int | None):
    """The runner for the engine's device: CPU reference, or the CUDA runner (which sizes
    its KV cache itself when `num_blocks` is None). tensor_parallel_size > 1: the
    tensor-parallel runner (inflightllm.parallel), which starts and owns the workers."""
    if config.tensor_parallel_size > 1:
        from inflightllm.parallel.tp_runner import TensorParallelRunner

        return TensorParallelRunner(loaded.spec, config, loaded, num_blocks, sampler_seed)
    if config.device == "cpu":
        return ModelRunner(loaded, num_blocks, config.block_size, "cpu", sampler_seed, config.kv_cache_dtype,
                           config.host_kv_cache_bytes)
    from inflightllm.gpu.runner import GpuModelRunner

    return GpuModelRunner(loaded, config, num_blocks, sampler_seed)
