"""The CUDA model runner: persistent rows, preallocated device buffers, CUDA graphs.

Each running request owns a row of host arrays (its token ids, block table, counts),
written when it joins and appended to as it grows. A step's inputs (token ids,
positions, slot mapping, block tables, context lengths, query offsets) are built from
those arrays with vectorised NumPy, with no per-sequence loop and no gathering of whole
contexts, and copied into static device buffers. Decodes come first in the packed
batch. A decode-only step of up to `max_batch_size` requests replays a CUDA graph
captured for the smallest bucket that holds it (1, 2, 4, 8, 16, 24, then every 16); other
steps run eagerly. Sampling runs batched on the GPU with one host copy of the ids.

The KV cache is sized after the weights are loaded and a step of the largest size (a
`max_num_tokens` prefill, logits and sampling for `max_batch_size` rows) has run:
`gpu_memory_utilization` of the device, less what the process holds and the step's
peak activations.
"""

from __future__ import annotations

import logging
import math
import time

import numpy as np
import torch

from inflightllm.config import EngineConfig
from inflightllm.gpu import ops
from inflightllm.gpu.sampler import GpuSampler
from inflightllm.gpu.staging import ALIGN, PinnedStaging
from inflightllm.guided.matcher import apply_step_bitmask
from inflightllm.host_kv_tier import num_host_blocks
from inflightllm.kv_pressure import measure_host_link
from inflightllm.model_runner import state_for
from inflightllm.models.loader import LoadedModel
from inflightllm.request import Request
from inflightllm.step import SampledTokens, StepDescription

logger = logging.getLogger(__name__)

GRAPH_RESERVE_BYTES = 2 << 30  # CUDA-graph pools and workspaces left out of the KV budget
# Decode graphs up to this bucket also run the LM head, and under tensor parallelism its
# all-gather (their [bucket, vocab] logits, in the model's dtype, stay allocated: 0.25 MiB
# a row in bf16 at a 128k vocab); larger buckets keep only hidden states and run the LM head on the sampling rows
# after the replay.
LOGITS_GRAPH_MAX_BUCKET = 16


# Cascade decode graphs (`_cascade_graph_key`): groups and widths rounded up to these, and
# at most this many shapes captured.
CASCADE_WIDTH_BUCKETS = (2, 4, 8, 16)
CASCADE_GRAPHS_MAX = 48


def cascade_group_buckets(max_batch_size: int) -> list[int]:
    """Group counts of cascade graphs: a group has two sequences at least."""
    return graph_buckets(max(1, max_batch_size // 2))


def graph_buckets(max_batch_size: int) -> list[int]:
    """Decode batch sizes that get a CUDA graph: 1, 2, 4, 8, 16, 24, then every 16 (24: the FP8
    GEMMs' 3-tile layout, ops.FP8_SMALL_M_DEFAULT_LAYOUT)."""
    buckets = [b for b in (1, 2, 4, 8, 16, 24) if b < max_batch_size]
    size = 16
    while size + 16 < max_batch_size:
        size += 16
        buckets.append(size)
    buckets.append(max_batch_size)
    return sorted(set(buckets))


class GpuModelRunner:
    """Owns the model, the CUDA KV cache and the step buffers of one GPU."""

    # A step whose constrained rows' masks are not in it yet samples on `sample_guided`
    # (the engine fills them while the forward runs: asynchronous scheduling).
    defers_guided_sampling = True
    # Its sampler keeps penalty rows' token counts on the device, updated from the sampled
    # ids: penalties need no wait for the step in flight (the engine's `_needs_history`).
    penalties_follow_sampled_ids = True

    def __init__(self, loaded: LoadedModel, config: EngineConfig, num_blocks: int | None, sampler_seed: int | None):
        from inflightllm.attention.cuda.backend import CudaPagedAttention

        self.loaded = loaded
        self.model = loaded.model
        self.config = config
        self.device = loaded.device
        arch = loaded.arch
        self.arch = arch
        self.block_size = config.block_size
        self.max_rows = config.max_batch_size
        self.max_model_len = self.model.cos_sin.shape[0]  # gpu.model.model_len: context capped by the request limits
        self.max_num_tokens = max(config.max_num_tokens, self.max_rows)
        self.max_blocks_per_seq = math.ceil(self.max_model_len / self.block_size)

        # Host state, one row per running request.
        self.token_ids = np.zeros((self.max_rows, self.max_model_len), np.int64)
        self.num_tokens = np.zeros(self.max_rows, np.int64)
        self.num_computed = np.zeros(self.max_rows, np.int64)
        self.block_table = np.zeros((self.max_rows, self.max_blocks_per_seq), np.int32)
        self.prompt_lens = np.zeros(self.max_rows, np.int64)
        self.rows: dict[str, int] = {}
        self.free_rows = list(range(self.max_rows - 1, -1, -1))
        self.states: dict[str, Request] = {}
        self.swapped: dict[str, object] = {}  # request id -> the attention backend's swap handle

        # Static device buffers (CUDA graphs replay against these addresses).
        def zeros(*shape, dtype=torch.int64):
            return torch.zeros(*shape, dtype=dtype, device=self.device)

        self.input_ids = zeros(self.max_num_tokens)
        self.positions = zeros(self.max_num_tokens)
        self.slot_mapping = zeros(self.max_num_tokens)
        self.block_tables = zeros(self.max_rows, self.max_blocks_per_seq, dtype=torch.int32)
        self.context_lens = zeros(self.max_rows, dtype=torch.int32)
        self.query_start_loc = zeros(self.max_rows + 1, dtype=torch.int32)
        self._row_offsets = torch.arange(self.max_rows + 1, dtype=torch.int32, device=self.device)
        self.last_sampled = zeros(self.max_rows)  # the previous launch's sampled ids, by row

        # engine.kv_cache_dtype fp8: e4m3 K/V with the checkpoint's per-layer scales (1.0 without)
        self.kv_cache_dtype = getattr(config, "kv_cache_dtype", "auto")

        def new_attention():
            return CudaPagedAttention(
                arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.sliding_window, max_model_len=self.max_model_len,
                kv_cache_dtype=self.kv_cache_dtype, kv_scales=getattr(loaded, "kv_scales", None),
            )

        # Cascade decode (INFLIGHTLLM_CASCADE_DECODE: auto, always, off): decode steps whose
        # groups share prefix blocks run eagerly with the prefix attended once per group.
        from inflightllm.attention.cuda.backend import cascade_mode

        self.cascade_mode = cascade_mode()
        self.cascade_steps = 0
        self.cascade_saved_tokens = 0  # K/V token reads saved, summed over steps
        self.staging = PinnedStaging(self.device)
        # Guided masks' own pinned ring (`_mask_staging`), made at the first constrained step:
        # 1,024 rows of a 128k vocabulary are 16.4 MB, past `staging`'s 16 MiB buffers.
        self._masks: PinnedStaging | None = None
        self.sampler = GpuSampler(self.device, self.max_rows, sampler_seed, upload=self.staging.upload)
        if num_blocks is None:
            num_blocks = self._size_kv_cache(new_attention)
        self.attention = new_attention()
        self.attention.allocate_kv_cache(
            num_blocks, self.block_size, arch.num_layers, arch.num_kv_heads, arch.head_dim, loaded.dtype, self.device
        )
        # cuDNN's plans for padded prompt lengths (INFLIGHTLLM_PREFILL_CUDNN_PAD), built now, not by steps.
        warm = getattr(self.attention, "warm_padded_prefill", None)
        if warm is not None:
            warm(min(config.max_num_tokens, self.max_model_len), loaded.dtype)
        self.num_blocks = num_blocks
        self.kv_cache_bytes = num_blocks * self._bytes_per_block()
        self._kv_bytes_per_token = self._bytes_per_block() // self.block_size  # cascade decode's threshold
        # A timed pinned copy over the (still unused) cache: what preemption_mode auto weighs a swap by.
        self.host_link = measure_host_link(self.attention.key_cache, self.attention.value_cache, num_blocks)
        logger.info(
            "KV cache: %d blocks of %d tokens = %d tokens, %.2f GiB (%s)",
            num_blocks, self.block_size, num_blocks * self.block_size, self.kv_cache_bytes / 2**30,
            "fp8 e4m3" if self.kv_cache_dtype == "fp8" else loaded.dtype,
        )
        # The host KV tier (engine.host_kv_cache_bytes): pinned host slots, copies on their own
        # stream (CudaPagedAttention.offload_blocks / onload_blocks).
        self.num_host_blocks = num_host_blocks(config.host_kv_cache_bytes, self._bytes_per_block())
        self.host_kv_bytes_per_block = 0
        if self.num_host_blocks:
            self.host_kv_bytes_per_block = self.attention.allocate_host_tier(self.num_host_blocks)
            logger.info("host KV tier: %d blocks, %.2f GiB pinned", self.num_host_blocks,
                        self.num_host_blocks * self.host_kv_bytes_per_block / 2**30)
        # bucket -> (graph, its hidden states, its logits or None)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor | None]] = {}
        self.graph_pool = None
        self._capture_stream = None
        # Cascade decode steps' graphs, captured the second time a shape is seen (the first
        # runs eagerly: kernels compiled, nothing captured for a shape seen once):
        # (decode bucket, groups bucket, width bucket) -> (graph, its hidden states).
        self.cascade_graphs: dict[tuple[int, int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._cascade_shapes_seen: set[tuple[int, int, int]] = set()
        self._cascade_buffers: dict[str, torch.Tensor] | None = None
        self.cascade_graph_steps = 0
        if getattr(config, "cuda_graphs", True):
            self._capture_graphs()

    # ---- memory ---------------------------------------------------------------------
    def _bytes_per_block(self) -> int:
        arch = self.arch
        element = 1 if self.kv_cache_dtype == "fp8" else torch.empty(0, dtype=self.loaded.dtype).element_size()
        return 2 * arch.num_layers * self.block_size * arch.num_kv_heads * arch.head_dim * element

    def _size_kv_cache(self, new_attention) -> int:
        import cupy

        arch = self.arch
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        baseline = torch.cuda.memory_allocated(self.device)
        tokens = min(self.max_num_tokens, self.max_blocks_per_seq * self.block_size)
        probe_blocks = math.ceil(tokens / self.block_size)
        probe = new_attention()
        probe.allocate_kv_cache(
            probe_blocks, self.block_size, arch.num_layers, arch.num_kv_heads, arch.head_dim, self.loaded.dtype, self.device
        )
        self.attention = probe
        # The largest step: one prefill of max_num_tokens tokens (at most the model length),
        # then logits and sampling for every row.
        self.block_table[0, :probe_blocks] = np.arange(probe_blocks)
        metadata = self._metadata_from_host(
            rows=np.array([0]), query_lens=np.array([tokens]), num_computed=np.array([0]), num_decodes=0,
            input_ids=np.zeros(tokens, np.int64),
        )
        with ops.torch_stream():
            hidden = self.model.forward(self.input_ids[:tokens], self.positions[:tokens], probe, metadata)
            logits = self.model.compute_logits(hidden[-1:].expand(self.max_rows, -1).contiguous(), dtype=None)
            # (a step that samples converts its 16-bit logits to float32: both are alive then)
            self.sampler.sample(logits.float(), np.arange(self.max_rows), [None] * self.max_rows)
        torch.cuda.synchronize(self.device)
        peak_activations = torch.cuda.max_memory_allocated(self.device) - baseline
        del hidden, logits, probe, metadata
        self.attention = None
        cupy.get_default_memory_pool().free_all_blocks()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        used = total - free
        budget = total * self.config.gpu_memory_utilization - used - peak_activations - GRAPH_RESERVE_BYTES
        num_blocks = int(budget // self._bytes_per_block())
        logger.info(
            "GPU memory: %.1f GiB total, %.1f GiB in use after loading, %.2f GiB peak activations; "
            "utilization %.2f leaves %.1f GiB for the KV cache",
            total / 2**30, used / 2**30, peak_activations / 2**30, self.config.gpu_memory_utilization,
            max(budget, 0) / 2**30,
        )
        if num_blocks < 1:
            raise RuntimeError(
                f"gpu_memory_utilization={self.config.gpu_memory_utilization} leaves no room for a KV block "
                f"({used / 2**30:.1f} GiB in use of {total / 2**30:.1f} GiB after loading the weights)"
            )
        return num_blocks

    # ---- request state ----------------------------------------------------------------
    def _update_states(self, step: StepDescription) -> None:
        if step.beam_updates:
            self._apply_beam_updates(step.beam_updates)
        for request_id in step.finished_request_ids:
            self.states.pop(request_id, None)
            self._free_row(request_id)
        for request_id in step.preempted_request_ids:
            self._free_row(request_id)
        for new in step.new_requests:
            state = state_for(self.states, new)
            row = self.free_rows.pop()
            self.rows[new.request_id] = row
            count = len(state.token_ids)
            self.token_ids[row, :count] = state.token_ids
            self.num_tokens[row] = count
            self.num_computed[row] = new.num_computed_tokens
            self.prompt_lens[row] = len(new.prompt_token_ids)
            self.block_table[row, : len(new.block_ids)] = new.block_ids
            state.block_table = list(new.block_ids)
            self.sampler.add_row(row, state)
        for cached in step.cached_requests:
            row = self.rows[cached.request_id]
            state = self.states[cached.request_id]
            if cached.block_ids is not None:  # copy-on-write rewrote its table
                self.block_table[row, : len(cached.block_ids)] = cached.block_ids
                state.block_table = list(cached.block_ids)
            if cached.new_block_ids:
                start = len(state.block_table)
                self.block_table[row, start : start + len(cached.new_block_ids)] = cached.new_block_ids
                state.block_table.extend(cached.new_block_ids)
            self.num_computed[row] = cached.num_computed_tokens

    def _apply_beam_updates(self, updates: list[tuple[str, str, int]]) -> None:
        """`StepDescription.beam_updates`: reassigned beams take their source's row (tokens
        up to its length, block table up to its blocks, counts) by one vectorised copy of
        every such row, then each beam's last token is set. Every source is read before any
        row is written (NumPy's fancy-indexed right-hand sides are copies)."""
        rows, states = self.rows, self.states
        targets = np.fromiter((rows[request_id] for request_id, _, _ in updates), np.int64, len(updates))
        sources = np.fromiter((rows[source] for _, source, _ in updates), np.int64, len(updates))
        tokens = np.fromiter((token for _, _, token in updates), np.int64, len(updates))
        moved = np.flatnonzero(targets != sources)
        if len(moved):
            source_states = {source: (states[source].token_ids, states[source].block_table)
                             for _, source, _ in (updates[i] for i in moved)}
            src, dst = sources[moved], targets[moved]
            length = int(self.num_tokens[src].max())
            self.token_ids[dst, :length] = self.token_ids[src, :length]
            blocks = max(len(table) for _, table in source_states.values())
            self.block_table[dst, :blocks] = self.block_table[src, :blocks]
            self.num_tokens[dst] = self.num_tokens[src]
            self.num_computed[dst] = self.num_computed[src]
            self.prompt_lens[dst] = self.prompt_lens[src]
            for i in moved:
                request_id, source, token = updates[i]
                state = states[request_id]
                source_tokens, source_table = source_states[source]
                state.token_ids = source_tokens[:-1] + [token]
                state.block_table = list(source_table)
        self.token_ids[targets, self.num_tokens[targets] - 1] = tokens
        for request_id, source, token in updates:
            if request_id == source:  # in place: a copy of it reads all but its last token
                states[request_id].token_ids[-1] = token

    def _free_row(self, request_id: str) -> None:
        row = self.rows.pop(request_id, None)
        if row is not None:
            self.sampler.remove_row(row)
            self.free_rows.append(row)

    # ---- inputs -----------------------------------------------------------------------
    def _metadata_from_host(self, rows, query_lens, num_computed, num_decodes, input_ids=None):
        """Fill the static buffers for sequences `rows` (decodes first) and return the
        attention metadata. Vectorised over tokens and sequences."""
        from inflightllm.attention.cuda.backend import CudaAttentionMetadata

        num_seqs = len(rows)
        cu = np.zeros(num_seqs + 1, np.int64)
        np.cumsum(query_lens, out=cu[1:])
        total = int(cu[-1])
        token_rows = np.repeat(rows, query_lens)
        offsets = np.arange(total) - np.repeat(cu[:-1], query_lens)
        positions = np.repeat(num_computed, query_lens) + offsets
        pending = None
        if input_ids is None:
            input_ids = self.token_ids[token_rows, positions]
            pending = np.flatnonzero(input_ids < 0)  # sampled by the previous launch, still on the device
        bs = self.block_size
        slots = self.block_table[token_rows, positions // bs].astype(np.int64) * bs + positions % bs
        context = num_computed + query_lens
        max_blocks = int(-(-int(context.max()) // bs))
        staged = self.staging.upload(np.concatenate([input_ids, positions, slots]))
        self.positions[:total].copy_(staged[total : 2 * total])
        self.slot_mapping[:total].copy_(staged[2 * total :])
        if pending is not None and len(pending) == total:  # all from the previous launch (asynchronous decodes)
            torch.index_select(self.last_sampled, 0, self.staging.upload(token_rows), out=self.input_ids[:total])
        else:
            self.input_ids[:total].copy_(staged[:total])
            if pending is not None and len(pending):
                where = self.staging.upload(np.stack([pending, token_rows[pending]]))
                self.input_ids.index_copy_(0, where[0], self.last_sampled.index_select(0, where[1]))
        small = self.staging.upload(np.concatenate([context.astype(np.int32), cu.astype(np.int32)]))
        self.context_lens[:num_seqs].copy_(small[:num_seqs])
        self.query_start_loc[: num_seqs + 1].copy_(small[num_seqs:])
        self.block_tables[:num_seqs, :max_blocks].copy_(self.staging.upload(self.block_table[rows, :max_blocks]))
        prefill_lens = query_lens[num_decodes:]
        return CudaAttentionMetadata(
            num_decodes=num_decodes,
            num_prefills=num_seqs - num_decodes,
            num_decode_tokens=num_decodes,
            max_query_len=int(prefill_lens.max()) if len(prefill_lens) else 0,
            max_context_len=int(context.max()),
            slot_mapping=self.slot_mapping[:total],
            positions=self.positions[:total],
            block_tables=self.block_tables[:num_seqs],
            context_lens=self.context_lens[:num_seqs],
            query_start_loc=self.query_start_loc[: num_seqs + 1],
            prefill_query_lens=prefill_lens,
            prefill_context_lens=context[num_decodes:],
        )

    def _cascade_plan(self, rows: np.ndarray, num_computed: np.ndarray, num_decodes: int):
        """The step's cascade decode (attention/cuda/backend.py plan_cascade): decodes that
        share whole prefix blocks (a request's n sequences or beams; requests with a common
        cached prefix) attend them once per group. None: not worth it, or off."""
        if num_decodes < 2 or self.cascade_mode == "off" or self.attention.sliding_window:
            return None
        from inflightllm.attention.cuda.backend import plan_cascade

        context = num_computed[:num_decodes] + 1
        width = int(-(-int(context.max()) // self.block_size))
        return plan_cascade(self.block_table[rows[:num_decodes], :width], context, self.block_size,
                            self.cascade_mode, self._kv_bytes_per_token, graphs=self.graph_pool is not None)

    # ---- CUDA graphs ------------------------------------------------------------------
    def _graph_metadata(self, batch: int):
        from inflightllm.attention.cuda.backend import CudaAttentionMetadata

        return CudaAttentionMetadata(
            num_decodes=batch,
            num_prefills=0,
            num_decode_tokens=batch,
            max_query_len=0,
            max_context_len=self.max_model_len,
            slot_mapping=self.slot_mapping[:batch],
            positions=self.positions[:batch],
            block_tables=self.block_tables[:batch],
            context_lens=self.context_lens[:batch],
            query_start_loc=self.query_start_loc[: batch + 1],
        )

    def _capture_graphs(self) -> None:
        start = time.monotonic()
        buckets = graph_buckets(self.max_rows)
        # Harmless inputs: every row one token at position 0 of block 0, written nowhere.
        self.input_ids.zero_()
        self.positions.zero_()
        self.slot_mapping.fill_(-1)
        self.block_tables.zero_()
        self.context_lens.fill_(1)
        self.query_start_loc.copy_(self._row_offsets)
        self.graph_pool = torch.cuda.graph_pool_handle()
        # This GPU's own capture stream: torch.cuda.graph's default one is created once per
        # process, on the GPU current at the first capture, and entering it makes that GPU
        # current. A second engine on another GPU in the same process (two data-parallel
        # engines driven from one program) then captured its kernels on the first GPU's
        # stream, with its own GPU's pointers: an illegal address at replay.
        capture_stream = self._capture_stream = torch.cuda.Stream(device=self.device)
        for batch in sorted(buckets, reverse=True):
            metadata = self._graph_metadata(batch)
            with ops.torch_stream():  # warm-up outside capture (kernel compilation, cuBLAS handles)
                self.model.compute_logits(
                    self.model.forward(self.input_ids[:batch], self.positions[:batch], self.attention, metadata),
                    dtype=None,
                )
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            # Small buckets run the LM head in the graph too (at batch 1 its eager launch and
            # the row selection before it were a few percent of the step). Larger ones keep
            # just their hidden states ([bucket, hidden_size]) alive, not [bucket, vocab]
            # logits, and the LM head runs after the replay on the rows that sample.
            # Under tensor parallelism the LM head's all-gather is captured with it.
            with_logits = batch <= LOGITS_GRAPH_MAX_BUCKET
            with torch.cuda.graph(graph, pool=self.graph_pool, stream=capture_stream):
                with ops.torch_stream():
                    hidden = self.model.forward(self.input_ids[:batch], self.positions[:batch], self.attention, metadata)
                    logits = self.model.compute_logits(hidden, dtype=None) if with_logits else None
            self.graphs[batch] = (graph, hidden, logits)
        torch.cuda.synchronize(self.device)
        logger.info("captured %d decode CUDA graphs (%s) in %.1f s", len(buckets), buckets, time.monotonic() - start)

    def release_graphs(self) -> None:
        """Drop the CUDA graphs and their memory pool. A tensor-parallel rank does this before
        it leaves its NCCL group: a communicator whose collectives live in captured graphs
        does not finish its teardown while they exist (pytorch/pytorch#115388)."""
        torch.cuda.synchronize(self.device)
        self.graphs.clear()
        self.cascade_graphs.clear()
        self.graph_pool = None
        torch.cuda.synchronize(self.device)

    def _bucket(self, batch: int) -> int | None:
        candidates = [size for size in self.graphs if size >= batch]
        return min(candidates) if candidates else None

    # ---- cascade decode graphs ----------------------------------------------------------
    def _cascade_graph_key(self, bucket: int | None, plan) -> tuple[int, int, int] | None:
        """The graph shape of a cascade step of `bucket` decodes (None: the step runs
        eagerly): the plan's groups and width rounded up to buckets. A shape gets its graph
        the second time it comes; the first runs eagerly, and at most
        CASCADE_GRAPHS_MAX shapes are captured (the rest run eagerly)."""
        if plan is None or bucket is None or self.graph_pool is None:
            return None
        groups = next(size for size in cascade_group_buckets(self.max_rows) if size >= plan.num_groups)
        width = next(size for size in CASCADE_WIDTH_BUCKETS if size >= plan.width)
        key = (bucket, groups, width)
        if key in self.cascade_graphs:
            return key
        if key not in self._cascade_shapes_seen:
            self._cascade_shapes_seen.add(key)
            return None
        return key if len(self.cascade_graphs) < CASCADE_GRAPHS_MAX else None

    def _cascade_graph(self, key: tuple[int, int, int], plan, batch: int):
        """The step's plan into the cascade graphs' static buffers (padded to the key's
        shape: padded decodes in no group, padded groups with empty prefixes), and the graph
        of that shape, captured now if it is new. Returns (graph, its hidden states)."""
        bucket, groups, width = key
        if self._cascade_buffers is None:
            def zeros(*shape, dtype=torch.int64):
                return torch.zeros(*shape, dtype=dtype, device=self.device)

            most = cascade_group_buckets(self.max_rows)[-1]
            self._cascade_buffers = {
                "member_rows": zeros(most * CASCADE_WIDTH_BUCKETS[-1]),
                "prefix_slot": zeros(self.max_rows),
                "prefix_tables": zeros(most, self.max_blocks_per_seq, dtype=torch.int32),
                "prefix_lens": zeros(most, dtype=torch.int32),
                "suffix_tables": zeros(self.max_rows, self.max_blocks_per_seq, dtype=torch.int32),
                "suffix_lens": zeros(self.max_rows, dtype=torch.int32),
            }
        buffers = self._cascade_buffers
        member_rows, slot, prefix_tables, prefix_lens = plan.padded(groups, width)
        slots = np.full(bucket, groups * width, np.int64)  # padding decodes: in no group
        slots[:batch] = slot
        suffix_lens = np.ones(bucket, np.int32)  # padding decodes: one harmless key of block 0
        suffix_lens[:batch] = plan.suffix_lens
        longs = self.staging.upload(np.concatenate([member_rows, slots]))
        ints = self.staging.upload(np.concatenate([prefix_lens, suffix_lens]))
        buffers["member_rows"][: groups * width].copy_(longs[: groups * width])
        buffers["prefix_slot"][:bucket].copy_(longs[groups * width :])
        buffers["prefix_lens"][:groups].copy_(ints[:groups])
        buffers["suffix_lens"][:bucket].copy_(ints[groups:])
        blocks = prefix_tables.shape[1]
        buffers["prefix_tables"][:groups, :blocks].copy_(self.staging.upload(prefix_tables))
        blocks = plan.suffix_tables.shape[1]
        buffers["suffix_tables"][:batch, :blocks].copy_(self.staging.upload(plan.suffix_tables))
        if bucket > batch:
            buffers["suffix_tables"][batch:bucket, 0].zero_()
        if key not in self.cascade_graphs:
            self.cascade_graphs[key] = self._capture_cascade(key)
        return self.cascade_graphs[key]

    def _capture_cascade(self, key: tuple[int, int, int]):
        """Capture the decode step of `key`'s shape over the static buffers (filled for the
        step about to replay it); nothing runs until the replay. Thread-local capture mode:
        other threads' CUDA calls (the engine's, NCCL's watchdog) are not the capture's."""
        from inflightllm.attention.cuda.backend import CascadeDecode

        bucket, groups, width = key
        buffers = self._cascade_buffers
        metadata = self._graph_metadata(bucket)
        metadata.cascade = CascadeDecode(
            num_groups=groups, width=width,
            member_rows=buffers["member_rows"][: groups * width], prefix_slot=buffers["prefix_slot"][:bucket],
            prefix_tables=buffers["prefix_tables"][:groups], prefix_lens=buffers["prefix_lens"][:groups],
            suffix_tables=buffers["suffix_tables"][:bucket], suffix_lens=buffers["suffix_lens"][:bucket],
        )
        start = time.monotonic()
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.graph_pool, stream=self._capture_stream,
                              capture_error_mode="thread_local"):
            with ops.torch_stream():
                hidden = self.model.forward(self.input_ids[:bucket], self.positions[:bucket], self.attention, metadata)
        logger.info("captured a cascade decode CUDA graph (%d decodes, %d groups of %d) in %.2f s",
                    bucket, groups, width, time.monotonic() - start)
        return graph, hidden

    # ---- the step ---------------------------------------------------------------------
    def execute(self, step: StepDescription) -> SampledTokens:
        """Run a step and wait for its tokens."""
        return self.launch(step).result()

    @torch.inference_mode()
    def launch(self, step: StepDescription) -> LaunchedStep:
        """Queue a step on the GPU and return at once; `result()` waits for its tokens.

        A token sampled by the previous launch may not have reached the host yet: its
        place in the host arrays holds -1, and the device copies it from `last_sampled`
        (the previous step's samples, by row) into the input ids. Only sampled ids cross
        to the host, once per step, asynchronously."""
        # The current CUDA device is per host thread, and the engine loop's thread is not the
        # one that loaded the model: without this an engine on any GPU but 0 (a data-parallel
        # instance, gpu_ids [1]) launches its CuPy kernels on GPU 0 with GPU 1's pointers.
        if torch.cuda.current_device() != self.device.index:
            torch.cuda.set_device(self.device)
        # Swaps first (preemption_mode: swap): a swapped-out request's blocks may be handed
        # to another request in this very step, and this step's forward writes into them.
        for request_id, block_ids in step.swap_out:
            self.swapped[request_id] = self.attention.swap_out(block_ids)
        if step.kv_offloads:  # host tier: evicted blocks out before anything writes them
            self.attention.offload_blocks(step.kv_offloads)
        if step.block_copies:  # copy-on-write: after the swap-outs read, before anything writes
            self.attention.copy_blocks(step.block_copies)
        for request_id, block_ids in step.swap_in:
            self.attention.swap_in(self.swapped.pop(request_id), block_ids)
        if step.kv_onloads:  # host tier: prefix hits back into their fresh blocks, before the forward
            self.attention.onload_blocks(step.kv_onloads)
        for request_id in step.finished_request_ids:
            handle = self.swapped.pop(request_id, None)
            if handle is not None:
                self.attention.discard_swapped(handle)
        self._update_states(step)
        if not step.scheduled:
            return LaunchedStep(self, [], None, None)
        self.staging.begin_step()
        if self._masks is not None:
            self._masks.begin_step()
        ids = [request_id for request_id, _ in step.scheduled]
        rows = np.fromiter((self.rows[request_id] for request_id in ids), np.int64, len(ids))
        query_lens = np.fromiter((count for _, count in step.scheduled), np.int64, len(ids))
        order = np.argsort(query_lens > 1, kind="stable")  # decodes first
        rows, query_lens = rows[order], query_lens[order]
        num_computed = self.num_computed[rows]
        num_decodes = int(np.count_nonzero(query_lens == 1))
        batch = len(rows)
        last_token = np.cumsum(query_lens) - 1
        samples = num_computed + query_lens == self.num_tokens[rows]

        plan = self._cascade_plan(rows, num_computed, num_decodes)
        bucket = self._bucket(batch) if num_decodes == batch else None
        cascade_key = self._cascade_graph_key(bucket, plan)
        if bucket is not None and (plan is None or cascade_key is not None):
            self._metadata_from_host(rows, query_lens, num_computed, num_decodes)
            if bucket > batch:  # padding rows: nothing written, one harmless key read
                self.slot_mapping[batch:bucket].fill_(-1)
                self.input_ids[batch:bucket].zero_()
                self.positions[batch:bucket].zero_()
                self.context_lens[batch:bucket].fill_(1)
                self.block_tables[batch:bucket, 0].zero_()
                self.query_start_loc[batch + 1 : bucket + 1].copy_(self._row_offsets[batch + 1 : bucket + 1])
            if plan is None:
                graph, graph_hidden, graph_logits = self.graphs[bucket]
            else:
                graph, graph_hidden = self._cascade_graph(cascade_key, plan, batch)
                graph_logits = None
                self.cascade_steps += 1
                self.cascade_graph_steps += 1
                self.cascade_saved_tokens += plan.saved_tokens
            graph.replay()
            if graph_logits is not None and samples.all():
                logits = graph_logits[:batch]
            else:
                selected = self.staging.upload(np.flatnonzero(samples))
                logits = self.model.compute_logits(graph_hidden.index_select(0, selected), dtype=None)
        else:
            metadata = self._metadata_from_host(rows, query_lens, num_computed, num_decodes)
            if plan is not None:  # eager: a cascade shape seen for the first time, or no graphs
                metadata.cascade = plan.upload(self.staging.upload)
                self.cascade_steps += 1
                self.cascade_saved_tokens += plan.saved_tokens
            total = int(query_lens.sum())
            with ops.torch_stream():
                hidden = self.model.forward(self.input_ids[:total], self.positions[:total], self.attention, metadata)
                selected = self.staging.upload(last_token[samples])
                logits = self.model.compute_logits(hidden.index_select(0, selected), dtype=None)

        self.num_computed[rows] = num_computed + query_lens
        sample_rows = rows[samples]
        if len(sample_rows) == 0:
            return LaunchedStep(self, [], None, None)
        request_ids = [ids[i] for i in order[samples]]
        if step.guided_request_ids and step.guided_bitmask is None:
            # The engine fills the constrained rows' masks while the forward runs (from the
            # previous step's tokens, which it is reading meanwhile), then samples.
            return DeferredLaunchedStep(
                lambda bitmask: self._sample_step(step, logits, sample_rows, request_ids, bitmask),
                lambda num_rows, num_words: self._mask_staging(num_words).host_array((num_rows, num_words), np.int32))
        return self._sample_step(step, logits, sample_rows, request_ids, step.guided_bitmask)

    def _mask_staging(self, num_words: int) -> PinnedStaging:
        """The guided masks' pinned ring: room for a mask row per batch row (plus the two
        row-index arrays `apply_step_bitmask` may upload), `PinnedStaging`'s depth, turned
        with the step staging's, so no step's masks fall back to a fresh pinned copy."""
        if self._masks is None:
            rows = self.max_rows
            self._masks = PinnedStaging(self.device, rows * num_words * 4 + 2 * rows * 8 + 3 * ALIGN)
        return self._masks

    @torch.inference_mode()
    def _sample_step(self, step: StepDescription, logits: torch.Tensor, sample_rows: np.ndarray,
                     request_ids: list[str], bitmask) -> LaunchedStep:
        """Sample the launched step's rows (guided masks first) and queue the ids' copy home."""
        states = [self.states[request_id] for request_id in request_ids]
        if step.guided_request_ids:  # structured output: the constrained rows' masks, applied
            # to the logits (after any graph replay) in one batched call, no host sync
            upload = self._mask_staging(np.shape(bitmask)[1]).upload
            apply_step_bitmask(logits, step.guided_request_ids, bitmask, request_ids, upload)
        positions = self.num_tokens[sample_rows]  # where each new token goes
        sampled = self.sampler.sample(logits, sample_rows, states, positions - self.prompt_lens[sample_rows])
        self.last_sampled.index_copy_(0, self.staging.upload(sample_rows), sampled.token_ids)
        host = sampled.to_host(non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self.token_ids[sample_rows, positions] = -1  # known once the step's result is read
        self.num_tokens[sample_rows] = positions + 1
        failed = {request_ids[index]: message for index, message in sampled.errors.items()}
        return LaunchedStep(self, list(zip(request_ids, sample_rows.tolist(), positions.tolist())), host, event, failed)


class DeferredLaunchedStep:
    """A step whose forward is queued and whose sampling waits for the constrained rows'
    masks: `sample_guided(bitmask)` queues it, then `result()` as LaunchedStep's.
    `mask_buffer(rows, words)`: pinned memory for the engine to gather the masks into
    (None when it has no room), which `sample_guided` then uploads without a copy."""

    def __init__(self, sample, mask_buffer):
        self._sample = sample
        self.mask_buffer = mask_buffer
        self._launched: LaunchedStep | None = None

    def sample_guided(self, bitmask) -> None:
        self._launched = self._sample(bitmask)

    def result(self) -> SampledTokens:
        if self._launched is None:
            raise RuntimeError("the step's guided masks never came (sample_guided was not called)")
        return self._launched.result()


class LaunchedStep:
    """A step queued on the GPU; `result()` waits for its sampled tokens and records
    them in the runner's host state (unless the request left its row meanwhile)."""

    def __init__(self, runner: GpuModelRunner, placed: list[tuple[str, int, int]], host, event, failed=None):
        self.runner = runner
        self.failed = failed or {}  # request id -> why its sampling failed (it gets no token)
        self.placed = placed  # (request id, row, position of the new token)
        self.host = host
        self.event = event

    def sample_guided(self, bitmask) -> None:
        """Its masks were in the step (or it has no constrained row): nothing to do."""

    def result(self) -> SampledTokens:
        result = SampledTokens(failed=dict(self.failed))
        if not self.placed:
            return result
        self.event.synchronize()
        token_ids, logprobs, top_ids, top_values = self.host.lists()
        runner = self.runner
        for (request_id, row, position), token in zip(self.placed, token_ids):
            if runner.rows.get(request_id) == row:
                runner.token_ids[row, position] = token
            state = runner.states.get(request_id)
            if state is not None and len(state.token_ids) == position:
                state.token_ids.append(token)
        m = len(token_ids)
        result.request_ids = [request_id for request_id, _, _ in self.placed]
        result.token_ids = token_ids
        result.logprobs = logprobs if logprobs is not None else [None] * m
        result.top_ids = top_ids if top_ids is not None else [[] for _ in range(m)]
        result.top_logprobs = top_values if top_values is not None else [[] for _ in range(m)]
        return result
