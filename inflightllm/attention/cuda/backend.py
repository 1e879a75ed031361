"""CUDA paged attention backend: KV cache in one CuPy allocation, kernels from kernels.cu.

- reshape_and_cache writes the step's new K/V into the cache (slot -1 = padding, skipped);
- decodes (the first `num_decodes` sequences, one token each) run flash-decoding
  (`paged_decode_v2`, split over the context, then `decode_reduce` when split; unsplit, at
  large batches, `paged_decode_v4`, the same with its loads pipelined);
- prefills / chunks run either `prefill_mma` (tensor cores, reads K/V through the block
  table) or gather + torch's flash varlen op (fp16/bf16), or `prefill_fma` (fp32).

`kv_cache_dtype="fp8"`: the cache holds e4m3 bytes of K / k_scale and V / v_scale (per-layer
scales, 1.0 where the checkpoint has none), as TorchReferenceAttention's FP8 cache does, byte
for byte: reshape_and_cache_fp8 quantizes, the v2 / v4 decode kernels read the bytes (k_scale
folded into the query scale, v_scale into their output), and prefills gather the context
dequantized into the query's dtype (gather_kv_fp8): packed for the flash op, or into a
scratch paged cache of its own for prefill_mma / prefill_fma. docs/FP8-KV-CACHE.md.

Everything in `forward` launches on torch's current stream, reads no device data on the host
and sizes launches from host ints only, so a decode step can be captured in a torch CUDA graph
(the decode split count depends only on `num_decodes` and `max_model_len`). CuPy is imported
lazily (in allocate_kv_cache and on the first kernel launch).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import numpy as np
import torch

from inflightllm.attention.base import AttentionBackend, SequenceSlice
from inflightllm.attention.cuda import ops
from inflightllm.env_settings import env_number

log = logging.getLogger(__name__)

# Which prefill implementation forward uses for fp16/bf16 ("mma" or "flash"); see
# docs/CUDA-KERNELS.md for the measurements behind the choice. fp32 always uses "fma".
PREFILL_DEFAULT = "flash"
# Which flash-decoding kernel forward uses ("v1": shared-memory logits per 256-token chunk;
# "v2": register online softmax, K and V loads together, no barriers in the token loop;
# "v4": v2 with its loads pipelined through shared memory by cp.async, the same bits;
# "auto": v4 where the context is not split (a large batch: each block walks a whole context),
# else v2, whose blocks then walk a tile or a few and which needs no large shared-memory carve-out
# next to the small-batch kernels; with an FP8 cache and fp16 / bf16 queries, v5 (tensor cores)
# below ops.DECODE_V6_MIN_DECODES decodes and v6 (pages by TMA, Hopper) from them where it fits,
# docs/FP8-KV-CACHE.md). INFLIGHTLLM_DECODE_IMPL overrides it (benchmarks, debugging).
DECODE_DEFAULT = "auto"
DECODE_IMPLS = (*ops.DECODE_KERNELS, "v5", "v6", "auto")
KV_CACHE_DTYPES = ("auto", "fp8")  # inflightllm.config.KV_CACHE_DTYPES
# Prefill attention on Hopper: consecutive whole prompts of one length from this many tokens
# go to cuDNN's fused attention as one dense batch [prompts, heads, length, d] (torch SDPA),
# ~1.7x FlashAttention 2's varlen forward at 8 x 2048 tokens of Llama-3-8B on an H100; the
# rest of a step's prefills stay on flash varlen (plan_prefill_segments, docs/CUDA-KERNELS.md).
# INFLIGHTLLM_PREFILL_CUDNN_MIN_LEN overrides it (0: off). Only lengths that are multiples of
# PREFILL_CUDNN_ALIGN: cuDNN builds an execution plan per new shape (~35 ms on an H100) and, for a
# length off its tiles, compiles a kernel too (~500 ms), stalls that arbitrary lengths would bring.
PREFILL_CUDNN_MIN_LEN = 512
PREFILL_CUDNN_ALIGN = 128
# PREFILL_CUDNN_PAD: a whole prompt of an unaligned length (from PREFILL_CUDNN_MIN_LEN tokens) goes
# to cuDNN alone, copied into zero rows up to the next multiple of this (a multiple of the
# alignment, so its shapes stay on cuDNN's tiles and few); 0: such prompts stay on flash varlen.
# Off until measured against flash varlen (INFLIGHTLLM_PREFILL_CUDNN_PAD for the measurements).
PREFILL_CUDNN_PAD = 0
# Host KV tier: blocks per gather / scatter through the device staging buffer (bounds its
# size: 64 blocks of Llama-3.1-8B in bf16 = 128 MiB).
HOST_TIER_CHUNK = 64


def default_decode_impl() -> str:
    impl = os.environ.get("INFLIGHTLLM_DECODE_IMPL", "").strip() or DECODE_DEFAULT
    if impl not in DECODE_IMPLS:
        raise ValueError(
            f"INFLIGHTLLM_DECODE_IMPL={impl!r} is not a decode kernel; allowed: {', '.join(DECODE_IMPLS)}"
        )
    return impl


def default_v5_kv_heads() -> int | None:
    """paged_decode_v5's kv heads a block: None (CudaPagedAttention.v5_blocking chooses), or
    INFLIGHTLLM_DECODE_V5_KV_HEADS (benchmarks): 1, 2 or 4."""
    text = os.environ.get("INFLIGHTLLM_DECODE_V5_KV_HEADS", "").strip()
    if not text:
        return None
    if text not in {str(h) for h in ops.DECODE_V5_KV_HEAD_CHOICES}:
        raise ValueError(f"INFLIGHTLLM_DECODE_V5_KV_HEADS={text!r}: 1, 2 or 4 (kv heads a block of paged_decode_v5)")
    return int(text)


def default_v5_splits() -> int | None:
    """paged_decode_v5's splits of each context: None (decode_splits chooses), or
    INFLIGHTLLM_DECODE_V5_SPLITS (benchmarks): a positive count, capped as decode_splits caps."""
    text = os.environ.get("INFLIGHTLLM_DECODE_V5_SPLITS", "").strip()
    if not text:
        return None
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"INFLIGHTLLM_DECODE_V5_SPLITS={text!r}: a positive count (splits of a decode's context)")
    return int(text)


def default_v5_split_cost() -> float:
    """paged_decode_v5's cost of a split (ops.wave_splits): ops.DECODE_V5_SPLIT_COST, or
    INFLIGHTLLM_DECODE_V5_SPLIT_COST (benchmarks): a number from 0 to 1."""
    text = os.environ.get("INFLIGHTLLM_DECODE_V5_SPLIT_COST", "").strip()
    if not text:
        return ops.DECODE_V5_SPLIT_COST
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"INFLIGHTLLM_DECODE_V5_SPLIT_COST={text!r}: a number from 0 to 1 (a split's cost in blocks)")
    return value


def default_decode_min_split(default: int = ops.DECODE_MIN_SPLIT_TOKENS) -> int:
    """The fewest tokens a split of a decode kernel's context takes (`default`: v2/v4's
    ops.DECODE_MIN_SPLIT_TOKENS, v5's ops.DECODE_V5_MIN_SPLIT_TOKENS); INFLIGHTLLM_DECODE_MIN_SPLIT
    overrides it: a positive multiple of 32."""
    text = os.environ.get("INFLIGHTLLM_DECODE_MIN_SPLIT", "").strip()
    if not text:
        return default
    if not text.isdigit() or int(text) < 32 or int(text) % 32:
        raise ValueError(f"INFLIGHTLLM_DECODE_MIN_SPLIT={text!r}: a positive multiple of 32 (tokens per split)")
    return int(text)


def default_prefill_cudnn_pad() -> int:
    """The padding of unaligned whole prompts for cuDNN (PREFILL_CUDNN_PAD), or
    INFLIGHTLLM_PREFILL_CUDNN_PAD: 0 (off) or a multiple of PREFILL_CUDNN_ALIGN tokens."""
    value = int(env_number("INFLIGHTLLM_PREFILL_CUDNN_PAD", PREFILL_CUDNN_PAD, 0, 1 << 16,
                           f"0 or a multiple of {PREFILL_CUDNN_ALIGN} tokens to pad unaligned prompts to for cuDNN"))
    if value % PREFILL_CUDNN_ALIGN:
        raise ValueError(f"INFLIGHTLLM_PREFILL_CUDNN_PAD={value}: give 0 (off) or a multiple of "
                         f"{PREFILL_CUDNN_ALIGN} tokens (cuDNN's tiles)")
    return value


def default_prefill_cudnn_min_len() -> int:
    """The shortest whole prompt the prefill attention gives cuDNN (PREFILL_CUDNN_MIN_LEN), or
    INFLIGHTLLM_PREFILL_CUDNN_MIN_LEN: a token count, 0 for never."""
    return int(env_number("INFLIGHTLLM_PREFILL_CUDNN_MIN_LEN", PREFILL_CUDNN_MIN_LEN, 0, 1 << 24,
                          "the shortest whole prompt for cuDNN attention in tokens (0: never)"))


def plan_prefill_segments(query_lens, context_lens, min_len: int, align: int = PREFILL_CUDNN_ALIGN,
                          pad: int = 0) -> list[tuple[int, int, int]]:
    """A step's prefills (host lengths, in packed order) cut into consecutive segments, each
    one attention call: (first prefill, count, length) where length > 0 marks a run of whole
    prompts (query length == context length: no cached prefix, not a later chunk) all of that
    length, at least `min_len` tokens and a multiple of `align` (a dense batch for cuDNN), and
    0 a run of anything else (flash varlen). With `pad` (a multiple of `align`), a whole prompt
    of at least `min_len` tokens off the alignment is a segment of its own whose length is its
    own rounded up to a multiple of `pad` (cuDNN on zero-padded copies: a segment whose length
    is more than its prompt's is padded). min_len 0: one varlen segment of everything."""
    q = np.asarray(query_lens, dtype=np.int64)
    c = np.asarray(context_lens, dtype=np.int64)
    n = len(q)
    if n == 0:
        return []
    if min_len <= 0:
        return [(0, n, 0)]
    whole = (q == c) & (q >= min_len)
    aligned = q % max(1, align) == 0
    dense_len = np.where(whole & aligned, q, 0)
    padded = whole & ~aligned if pad > 0 else np.zeros(n, dtype=bool)
    segments: list[tuple[int, int, int]] = []
    first = 0
    for i in range(1, n + 1):
        if i == n or padded[i] or padded[first] or dense_len[i] != dense_len[first]:
            length = -(-int(q[first]) // pad) * pad if padded[first] else int(dense_len[first])
            segments.append((first, i - first, length))
            first = i
    return segments


def _checked_scales(kv_scales) -> list[tuple[float, float]]:
    """Per-layer (k_scale, v_scale) as floats; each must be finite and positive."""
    checked = []
    for layer, pair in enumerate(kv_scales):
        k_scale, v_scale = (float(x) for x in pair)
        for name, value in (("k_scale", k_scale), ("v_scale", v_scale)):
            if not (value > 0 and value != float("inf")):
                raise ValueError(f"kv_scales: layer {layer} {name} {value!r} (a finite positive number is allowed)")
        checked.append((k_scale, v_scale))
    return checked


class PinnedHostTensor:
    """A page-locked host tensor of exactly its size: pageable memory registered with
    cudaHostRegister (torch's pinned allocator rounds each allocation up to a power of two:
    a 40 GiB host tier would pin 64 GiB), unregistered when this object goes. Where
    registering is not available or fails, torch's pinned allocator instead."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype):
        self.registered = False
        tensor = torch.empty(shape, dtype=dtype, device="cpu")
        try:
            error = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), tensor.nbytes, 0)
            self.registered = int(error) == 0
        except (AttributeError, RuntimeError, TypeError) as exc:
            log.info("cudaHostRegister unavailable (%s); torch's pinned allocator instead", exc)
        if not self.registered:
            tensor = torch.empty(shape, dtype=dtype, device="cpu", pin_memory=True)
        self.tensor = tensor

    def __del__(self):
        if self.registered:
            try:
                torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            except Exception:  # noqa: BLE001 - interpreter shutdown: nothing left to free
                pass
            self.registered = False


# Cascade decode (plan_cascade): INFLIGHTLLM_CASCADE_DECODE = auto (the default: when it
# pays, below), always (whenever decodes share a block: tests), off. A cascade step runs
# eagerly (no CUDA graph of its shape): measured on an H100 host (2026-12-05), n = 8 over 64
# prompts of 2,048 tokens, its launch took 70-83 ms of host time a step against the GPU's
# 60 ms for the same step without cascade (graph replay, 33 ms of host): 5,168 output tok/s
# with it, 5,856 without (docs/SEQUENCE-GROUPS.md).
CASCADE_MODES = ("auto", "always", "off")
CASCADE_DEFAULT = "auto"
# auto: a step's shared prefixes must save at least this many bytes of K/V reads (all layers,
# summed over the decodes) and this fraction of all its decode reads;
CASCADE_MIN_SAVED_BYTES = 8 << 30
CASCADE_MIN_SAVED_FRACTION = 0.25
# and the step's decodes must read at least this much without it: attention reads that take
# longer than an eager step's launches (256 GiB is ~70 ms at 4 TB/s), so that the step is
# bound by the GPU, whose time cascade cuts, and not by the host, whose time it adds to.
CASCADE_MIN_DECODE_READ_BYTES = 256 << 30
# auto: a group's prefix counts from this many tokens (a short prompt's beams gain less than
# the eager step costs: 256 x beam_width 4 over 128-token prompts ran 2.2x slower with it).
CASCADE_MIN_PREFIX_TOKENS = 512
# Sequences of one cascade group at most: a larger set sharing a prefix is cut into groups of
# this many (each reads the prefix once); the launch pads every group to the widest.
CASCADE_MAX_WIDTH = 16


def cascade_mode() -> str:
    mode = os.environ.get("INFLIGHTLLM_CASCADE_DECODE", "").strip() or CASCADE_DEFAULT
    if mode not in CASCADE_MODES:
        raise ValueError(f"INFLIGHTLLM_CASCADE_DECODE={mode!r}; allowed: {', '.join(CASCADE_MODES)}")
    return mode


@dataclass
class CascadePlan:
    """Host arrays of a cascade decode step (plan_cascade); `upload` makes a CascadeDecode."""

    width: int  # sequences per group, padded
    member_rows: np.ndarray  # [groups * width] int64 decode rows; padding repeats a real member
    prefix_slot: np.ndarray  # [num_decodes] int64: each decode's place in member_rows; groups * width: none
    prefix_tables: np.ndarray  # [groups, prefix blocks] int32
    prefix_lens: np.ndarray  # [groups] int32 tokens of the shared prefix
    suffix_tables: np.ndarray  # [num_decodes, blocks] int32 each decode's blocks after its prefix
    suffix_lens: np.ndarray  # [num_decodes] int32
    saved_tokens: int  # K/V token reads saved (summed over the decodes)

    @property
    def num_groups(self) -> int:
        return len(self.prefix_lens)

    def padded(self, groups: int, width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(member_rows, prefix_slot, prefix_tables, prefix_lens) laid out for `groups` groups
        of `width` sequences (a CUDA graph's shape, at least the plan's): a padded member
        repeats its group's first, a padded group has an empty prefix and the first group's
        first member, and the slot of a decode in no group is groups * width."""
        G, W = self.num_groups, self.width
        assert groups >= G and width >= W
        members = self.member_rows.reshape(G, W)
        rows = np.full((groups, width), members[0, 0], np.int64)
        rows[:G, :W] = members
        rows[:G, W:] = members[:, :1]
        slot = self.prefix_slot
        slot = np.where(slot < G * W, slot // W * width + slot % W, groups * width)
        tables = np.zeros((groups, self.prefix_tables.shape[1]), np.int32)
        tables[:G] = self.prefix_tables
        lens = np.zeros(groups, np.int32)
        lens[:G] = self.prefix_lens
        return rows.ravel(), slot, tables, lens

    def upload(self, upload) -> CascadeDecode:
        """Device tensors through `upload` (host array -> device tensor)."""
        return CascadeDecode(
            num_groups=self.num_groups, width=self.width,
            member_rows=upload(self.member_rows), prefix_slot=upload(self.prefix_slot),
            prefix_tables=upload(self.prefix_tables), prefix_lens=upload(self.prefix_lens),
            suffix_tables=upload(self.suffix_tables), suffix_lens=upload(self.suffix_lens),
        )


@dataclass
class CascadeDecode:
    """Device side of a CascadePlan (CudaAttentionMetadata.cascade). The shapes depend on
    host ints only (groups, width, decodes), so a step of the same shape can replay a CUDA
    graph captured over static buffers (gpu/runner.py)."""

    num_groups: int
    width: int
    member_rows: torch.Tensor  # [groups * width] int64
    prefix_slot: torch.Tensor  # [num_decodes] int64, groups * width: in no group
    prefix_tables: torch.Tensor  # [groups, >= prefix blocks] int32
    prefix_lens: torch.Tensor  # [groups] int32; 0 for a padded group
    suffix_tables: torch.Tensor  # [num_decodes, >= blocks] int32
    suffix_lens: torch.Tensor  # [num_decodes] int32


def plan_cascade(tables: np.ndarray, context_lens: np.ndarray, block_size: int, mode: str = "auto",
                 bytes_per_token: int = 0, max_width: int = CASCADE_MAX_WIDTH,
                 graphs: bool = False) -> CascadePlan | None:
    """Which decodes share a prefix of whole blocks, and whether attending it once per group
    is worth an eager step. tables [num_decodes, >= blocks] int32 (each decode's block ids),
    context_lens [num_decodes] (tokens after this step). Decodes are grouped by their first
    block; a group's prefix is the blocks all its members hold, before the block each writes
    (the n sequences of a request share the prompt's full blocks; requests share cached
    prefix blocks). bytes_per_token: K/V bytes of a token over all layers (auto's threshold).
    graphs: the runner replays cascade steps as CUDA graphs, so auto does not weigh an eager
    step's launches (CASCADE_MIN_DECODE_READ_BYTES). None: nothing shared, or (auto) too
    little saved."""
    if mode == "off" or len(context_lens) < 2:
        return None
    first = tables[:, 0]
    values, counts = np.unique(first, return_counts=True)
    if counts.max() < 2:
        return None
    context_lens = np.asarray(context_lens, np.int64)
    full_blocks = (context_lens - 1) // block_size  # blocks before the one holding the new token
    if mode == "auto" and int(full_blocks.max()) * block_size < CASCADE_MIN_PREFIX_TOKENS:
        return None  # no prefix could be long enough (per step, before any per-group work)
    shared = np.zeros(len(context_lens), np.int64)
    groups: list[tuple[np.ndarray, int]] = []
    for value in values[counts >= 2]:
        members = np.flatnonzero(first == value)
        limit = int(full_blocks[members].min())
        if limit <= 0:
            continue
        same = (tables[members, :limit] == tables[members[0], :limit]).all(axis=0)
        blocks = limit if same.all() else int(np.argmin(same))
        if blocks <= 0 or (mode == "auto" and blocks * block_size < CASCADE_MIN_PREFIX_TOKENS):
            continue
        shared[members] = blocks
        for start in range(0, len(members), max_width):
            chunk = members[start : start + max_width]
            if len(chunk) >= 2:
                groups.append((chunk, blocks))
            else:
                shared[chunk] = 0  # a lone remainder attends its whole context itself
    if not groups:
        return None
    saved = sum((len(chunk) - 1) * blocks * block_size for chunk, blocks in groups)
    if mode == "auto" and (saved * bytes_per_token < CASCADE_MIN_SAVED_BYTES
                           or saved < CASCADE_MIN_SAVED_FRACTION * float(context_lens.sum())
                           or (not graphs
                               and float(context_lens.sum()) * bytes_per_token < CASCADE_MIN_DECODE_READ_BYTES)):
        return None
    width = max(len(chunk) for chunk, _ in groups)
    prefix_width = max(blocks for _, blocks in groups)
    member_rows = np.empty(len(groups) * width, np.int64)
    prefix_slot = np.full(len(context_lens), len(groups) * width, np.int64)
    prefix_tables = np.zeros((len(groups), prefix_width), np.int32)
    prefix_lens = np.empty(len(groups), np.int32)
    for g, (chunk, blocks) in enumerate(groups):
        member_rows[g * width : g * width + len(chunk)] = chunk
        member_rows[g * width + len(chunk) : (g + 1) * width] = chunk[0]  # padding: a real query, dropped
        prefix_slot[chunk] = np.arange(g * width, g * width + len(chunk))
        prefix_tables[g, :blocks] = tables[chunk[0], :blocks]
        prefix_lens[g] = blocks * block_size
    blocks_needed = -(-context_lens // block_size)
    suffix_width = max(1, int((blocks_needed - shared).max()))
    index = np.minimum(shared[:, None] + np.arange(suffix_width)[None, :], tables.shape[1] - 1)
    suffix_tables = np.take_along_axis(tables, index, axis=1).astype(np.int32)
    suffix_lens = (context_lens - shared * block_size).astype(np.int32)
    return CascadePlan(width=width, member_rows=member_rows, prefix_slot=prefix_slot,
                       prefix_tables=prefix_tables, prefix_lens=prefix_lens,
                       suffix_tables=np.ascontiguousarray(suffix_tables), suffix_lens=suffix_lens,
                       saved_tokens=int(saved))


@dataclass
class CudaAttentionMetadata:
    """A packed step, no padding except for CUDA-graph buckets. Sequences are ordered: the
    first `num_decodes` are decodes (query_len == 1, tokens 0..num_decodes-1), the remaining
    `num_prefills` are prefills / chunks (query_len >= 1) packed after them."""

    num_decodes: int  # host int
    num_prefills: int  # host int
    num_decode_tokens: int  # == num_decodes
    max_query_len: int  # host int, over the prefill sequences (0 if none)
    max_context_len: int  # host int, over all sequences (upper bound ok)
    slot_mapping: torch.Tensor  # [num_tokens] int64; -1 = padding, skipped
    positions: torch.Tensor  # [num_tokens] int64 (RoPE, outside attention)
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32
    context_lens: torch.Tensor  # [num_seqs] int32, tokens in cache after this step; 0 = padding row
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32 prefix sums of query lengths
    # Decodes that share a prefix of whole blocks attend it once per group (plan_cascade).
    cascade: CascadeDecode | None = None
    # Host copies of the prefills' query and context lengths (the runner and build_metadata
    # fill them): plan_prefill_segments reads them. None: one flash varlen call for all.
    prefill_query_lens: np.ndarray | None = None
    prefill_context_lens: np.ndarray | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])

    @property
    def num_seqs(self) -> int:
        return self.num_decodes + self.num_prefills


class CudaPagedAttention(AttentionBackend):
    """Paged KV cache on the GPU; flash-decoding for decodes, tensor-core / flash prefill."""

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        sliding_window: int | None = None,
        max_model_len: int = 8192,
        prefill_impl: str | None = None,
        kv_cache_dtype: str = "auto",
        kv_scales: list[tuple[float, float]] | None = None,
    ):
        """kv_cache_dtype: "auto" (the cache in the query's dtype) or "fp8" (e4m3 bytes; with
        `kv_scales`, one (k_scale, v_scale) per layer, else 1.0 for every layer)."""
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r}: allowed {', '.join(KV_CACHE_DTYPES)}")
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}"
            )
        if head_dim not in ops.HEAD_DIMS:
            raise ValueError(f"head_dim {head_dim} unsupported (supported: {ops.HEAD_DIMS})")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.sliding_window = sliding_window or None
        self.max_model_len = max_model_len
        self.prefill_impl = prefill_impl or PREFILL_DEFAULT  # "mma" | "flash" (fp16/bf16 only)
        self.decode_impl = default_decode_impl()  # "v1" | "v2" | "v4" | "auto" (DECODE_IMPLS)
        self.decode_min_split = default_decode_min_split()  # v2/v4: the fewest tokens per split
        self.v5_min_split = default_decode_min_split(ops.DECODE_V5_MIN_SPLIT_TOKENS)  # v5's
        self.v5_split_cost = default_v5_split_cost()
        self.v5_kv_heads = default_v5_kv_heads()  # v5: kv heads a block, None: v5_blocking chooses
        self.v5_splits = default_v5_splits()  # v5: splits of a context, None: decode_splits chooses
        self.kv_cache_dtype = kv_cache_dtype
        self.fp8 = kv_cache_dtype == "fp8"
        if self.decode_impl in ("v5", "v6") and not self.fp8:
            raise ValueError(
                f"INFLIGHTLLM_DECODE_IMPL={self.decode_impl!r} reads only an FP8 KV cache (engine.kv_cache_dtype fp8); "
                f"allowed here: {', '.join(ops.DECODE_KERNELS)}, auto"
            )
        if self.fp8 and self.decode_impl not in (*ops.FP8_DECODE_KERNELS, "auto"):
            raise ValueError(
                f"INFLIGHTLLM_DECODE_IMPL={self.decode_impl!r} does not read an FP8 KV cache "
                f"(engine.kv_cache_dtype fp8); allowed: {', '.join(ops.FP8_DECODE_KERNELS)}, auto"
            )
        self.kv_scales = _checked_scales(kv_scales) if kv_scales is not None else None
        self.key_cache: list[torch.Tensor] = []
        self.value_cache: list[torch.Tensor] = []
        self.kv_cache: torch.Tensor | None = None  # [num_layers, 2, num_blocks, block_size, kvh, d]
        self.kv_cache_bytes = 0
        self.block_size = 0
        self.num_blocks = 0
        # The cache's element type: the model's dtype, or torch.uint8 for an FP8 cache (so the
        # fused small-batch qkv kernel of gpu/model.py, which writes K/V into a cache of the
        # model's dtype itself, leaves the quantizing write to forward).
        self.dtype: torch.dtype | None = None
        self.query_dtype: torch.dtype | None = None  # the model's dtype (queries, outputs)
        self._bs_shift = 0
        self._cupy_array = None  # owns the cache memory
        self._num_sms = 132
        self._v6_ok = False  # allocate_kv_cache: paged_decode_v6 fits this cache and GPU
        self._flash_error: str | None = None
        # Whole prompts of one length from this many tokens: cuDNN dense attention (Hopper, set
        # by allocate_kv_cache; 0: never). _cudnn_error: why it was given up (then flash varlen).
        self.prefill_cudnn_min_len = default_prefill_cudnn_min_len()
        self.prefill_cudnn_pad = default_prefill_cudnn_pad()  # unaligned whole prompts: 0 flash, else padded cuDNN
        self._cudnn_ok = False
        self._cudnn_error: str | None = None
        self._cudnn_packed_q = False  # _dense: cuDNN refused a strided query once, copy it packed
        # Host KV tier (allocate_host_tier): pinned slots [num_host_blocks, layers, 2, block_size,
        # kvh, d] (one block's every layer contiguous), its copy stream and a device staging
        # buffer of HOST_TIER_CHUNK blocks in the same layout.
        self.host_kv: torch.Tensor | None = None
        self._host_memory: PinnedHostTensor | None = None
        self._copy_stream = None
        self._host_staging: torch.Tensor | None = None

    # ------------------------------------------------------------------ cache
    def allocate_kv_cache(
        self, num_blocks, block_size, num_layers, num_kv_heads, head_dim, dtype, device
    ):
        if self.decode_impl in ("v5", "v6") and dtype == torch.float32:  # (before CuPy: a CPU-testable refusal)
            raise ValueError(f"INFLIGHTLLM_DECODE_IMPL={self.decode_impl!r} needs fp16 or bf16 queries (the model's "
                             "dtype is float32); allowed for float32: v2, v4, auto")
        if self.decode_impl == "v6" and not ops.decode_v6_fits(num_kv_heads, block_size, head_dim):
            raise ValueError(f"INFLIGHTLLM_DECODE_IMPL='v6' takes every kv head of a sequence in one block: at most "
                             f"{ops.DECODE_V6_MAX_KV_HEADS} kv heads and a ring of {ops.DECODE_V6_MAX_SMEM} bytes "
                             f"({ops.decode_v6_stages()} x 2 pages of block_size x kv heads x head_dim); this cache: "
                             f"{num_kv_heads} kv heads, head_dim {head_dim}, block_size {block_size}; allowed: v5, auto")
        import cupy

        if block_size <= 0 or block_size & (block_size - 1):
            raise ValueError(f"block_size {block_size} must be a power of two")
        if num_kv_heads != self.num_kv_heads or head_dim != self.head_dim:
            raise ValueError("cache shape differs from the backend's heads")
        if dtype not in ops.CTYPE:
            raise ValueError(f"unsupported dtype {dtype}")
        if self.fp8:
            if self.kv_scales is None:
                self.kv_scales = [(1.0, 1.0)] * num_layers
            elif len(self.kv_scales) != num_layers:
                raise ValueError(f"kv_scales: {len(self.kv_scales)} layers of scales for {num_layers} layers")
        device = torch.device(device)
        index = device.index if device.index is not None else torch.cuda.current_device()
        storage = {
            torch.float32: cupy.float32,
            torch.float16: cupy.float16,
            torch.bfloat16: cupy.uint16,
        }[dtype]
        if self.fp8:
            storage = cupy.uint8  # e4m3 bytes
        shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
        self._cupy_array = None
        self.key_cache, self.value_cache, self.kv_cache = [], [], None
        with cupy.cuda.Device(index):
            array = cupy.zeros(shape, dtype=storage)
        cache = torch.from_dlpack(array)
        if dtype == torch.bfloat16 and not self.fp8:  # (an FP8 cache stays uint8 bytes)
            cache = cache.view(torch.bfloat16)
        self._cupy_array = array
        self.kv_cache = cache
        self.key_cache = [cache[layer, 0] for layer in range(num_layers)]
        self.value_cache = [cache[layer, 1] for layer in range(num_layers)]
        self.kv_cache_bytes = int(array.nbytes)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.dtype = torch.uint8 if self.fp8 else dtype
        self.query_dtype = dtype
        self._bs_shift = block_size.bit_length() - 1
        self._num_sms = torch.cuda.get_device_properties(index).multi_processor_count
        # paged_decode_v6 for "auto": Hopper or later (cp.async.bulk), every kv head in a block
        # and the ring within a block's shared memory
        self._v6_ok = (self.fp8 and torch.cuda.get_device_capability(index) >= (9, 0)
                       and ops.decode_v6_fits(num_kv_heads, block_size, head_dim))
        # cuDNN's fused attention for dense prefill segments: measured on Hopper only
        self._cudnn_ok = (torch.cuda.get_device_capability(index) >= (9, 0) and torch.backends.cudnn.is_available()
                          and dtype in (torch.float16, torch.bfloat16))

    # ------------------------------------------------------------------ host KV tier
    def allocate_host_tier(self, num_host_blocks: int) -> int:
        """Pinned host slots for `num_host_blocks` blocks, slot-major (a block's K and V of
        every layer in one contiguous run, so one block is one host copy), a copy stream of
        its own, and a device staging buffer. Returns the bytes of one block."""
        cache = self.kv_cache
        layers, _, _, block_size, kv_heads, head_dim = cache.shape
        shape = (num_host_blocks, layers, 2, block_size, kv_heads, head_dim)
        self._host_memory = PinnedHostTensor(shape, cache.dtype)
        self.host_kv = self._host_memory.tensor
        self._copy_stream = torch.cuda.Stream(device=cache.device)
        chunk = min(HOST_TIER_CHUNK, num_host_blocks)
        self._host_staging = torch.empty((chunk, *shape[1:]), dtype=cache.dtype, device=cache.device)
        return self.host_kv[0].nbytes

    def _blocks_view(self) -> torch.Tensor:
        """The cache as [layers * 2, num_blocks, block elements] (a view)."""
        cache = self.kv_cache
        return cache.view(cache.shape[0] * 2, cache.shape[2], -1)

    @staticmethod
    def _runs(slots: list[int]) -> list[tuple[int, int, int]]:
        """(index into `slots`, first slot, length) of each run of consecutive slots."""
        runs: list[tuple[int, int, int]] = []
        for index, slot in enumerate(slots):
            if runs and runs[-1][1] + runs[-1][2] == slot:
                first, start, length = runs[-1]
                runs[-1] = (first, start, length + 1)
            else:
                runs.append((index, slot, 1))
        return runs

    def _indexes(self, block_ids: list[int]) -> torch.Tensor:
        return torch.tensor(block_ids, dtype=torch.int64).pin_memory().to(self.kv_cache.device, non_blocking=True)

    def _on_copy_stream(self, transfer, copies: list[tuple[int, int]]) -> None:
        """Run `transfer(chunk)` over the copies, HOST_TIER_CHUNK at a time, on the copy
        stream: it starts after the work queued so far on the compute stream (a step in flight
        may still write a block being offloaded, or read a block being onloaded into), and the
        compute stream waits for it before anything queued after this (the step's forward)."""
        compute = torch.cuda.current_stream(self.kv_cache.device)
        copy = self._copy_stream
        copy.wait_stream(compute)
        with torch.cuda.stream(copy):
            for start in range(0, len(copies), HOST_TIER_CHUNK):
                transfer(copies[start : start + HOST_TIER_CHUNK])
            done = torch.cuda.Event()
            done.record(copy)
        compute.wait_event(done)

    def offload_blocks(self, copies: list[tuple[int, int]]) -> None:
        """(device block, host slot) pairs: one gather of the blocks into the staging buffer,
        then one device-to-host copy per run of consecutive slots."""
        if not copies:
            return

        def transfer(chunk):
            chunk = sorted(chunk, key=lambda pair: pair[1])  # by slot: runs of slots are runs of staging rows
            staging = self._host_staging[: len(chunk)]
            gathered = self._blocks_view().index_select(1, self._indexes([block for block, _ in chunk]))
            staging.view(len(chunk), gathered.shape[0], -1).copy_(gathered.transpose(0, 1))
            for index, slot, length in self._runs([slot for _, slot in chunk]):
                self.host_kv[slot : slot + length].copy_(staging[index : index + length], non_blocking=True)

        self._on_copy_stream(transfer, copies)

    def onload_blocks(self, copies: list[tuple[int, int]]) -> None:
        """(host slot, device block) pairs: one host-to-device copy per run of consecutive
        slots into the staging buffer, then one scatter into the cache."""
        if not copies:
            return

        def transfer(chunk):
            chunk = sorted(chunk, key=lambda pair: pair[0])
            staging = self._host_staging[: len(chunk)]
            for index, slot, length in self._runs([slot for slot, _ in chunk]):
                staging[index : index + length].copy_(self.host_kv[slot : slot + length], non_blocking=True)
            view = self._blocks_view()
            rows = staging.view(len(chunk), view.shape[0], -1).transpose(0, 1)
            view.index_copy_(1, self._indexes([block for _, block in chunk]), rows)

        self._on_copy_stream(transfer, copies)

    # ------------------------------------------------------------------ swap
    def swap_out(self, block_ids: list[int]):
        """Copy the blocks' K/V of every layer to pinned host memory (a preemption's swap):
        one gather over the whole cache into one pinned buffer, queued on the compute stream
        before the step's forward (which may overwrite the blocks). The host never waits:
        only a later `swap_in`, on the same stream, reads the buffer. (It was one pinned
        buffer per layer and K/V, 64 for Llama-3-8B, and a host wait per victim: 128/2048 x
        512 ran at 0.83x recompute's throughput with every victim swapped.)"""
        if not block_ids:
            return []
        gathered = self._blocks_view().index_select(1, self._indexes(block_ids))  # [layers * 2, n, elements]
        host = torch.empty(gathered.shape, dtype=gathered.dtype, pin_memory=True)
        host.copy_(gathered, non_blocking=True)
        return [host]

    def swap_in(self, handle, block_ids: list[int]) -> None:
        if not block_ids:
            return
        (host,) = handle
        if host.shape[1] != len(block_ids):
            raise ValueError(f"swap_in: {host.shape[1]} swapped blocks for {len(block_ids)} blocks")
        view = self._blocks_view()
        view.index_copy_(1, self._indexes(block_ids), host.to(view.device, non_blocking=True))

    def discard_swapped(self, handle) -> None:
        handle.clear()

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: every layer's K and V of each (source, destination) block pair in
        one gather and one scatter over the whole cache ([layers, 2, blocks, ...]), on
        torch's current stream (ordered before the step's forward)."""
        if not copies:
            return
        device = self.kv_cache.device
        sources = torch.tensor([source for source, _ in copies], dtype=torch.int64).to(device, non_blocking=True)
        destinations = torch.tensor([dest for _, dest in copies], dtype=torch.int64).to(device, non_blocking=True)
        self.kv_cache[:, :, destinations] = self.kv_cache[:, :, sources]

    # ------------------------------------------------------------------ metadata
    def build_metadata(self, sequences: list[SequenceSlice], device) -> CudaAttentionMetadata:
        """Host-side packing of a step (decodes first). A convenience for tests and simple
        runners; a graph-captured runner fills the same tensors in static buffers itself."""
        bs = self.block_size
        num_decodes = 0
        for seq in sequences:
            if seq.query_len != 1:
                break
            num_decodes += 1
        slots, positions, starts, ctx_lens = [], [], [0], []
        for seq in sequences:
            if seq.query_start != starts[-1]:
                raise ValueError("sequences must be packed in order")
            first = seq.context_len - seq.query_len
            for pos in range(first, seq.context_len):
                slots.append(seq.block_table[pos // bs] * bs + pos % bs)
                positions.append(pos)
            starts.append(starts[-1] + seq.query_len)
            ctx_lens.append(seq.context_len)
        width = max([len(s.block_table) for s in sequences] + [1])
        table = torch.zeros((len(sequences), width), dtype=torch.int32)
        for row, seq in enumerate(sequences):
            if seq.block_table:
                table[row, : len(seq.block_table)] = torch.tensor(
                    seq.block_table, dtype=torch.int32
                )
        prefills = sequences[num_decodes:]
        return CudaAttentionMetadata(
            num_decodes=num_decodes,
            num_prefills=len(prefills),
            num_decode_tokens=num_decodes,
            max_query_len=max([s.query_len for s in prefills] + [0]),
            max_context_len=max(ctx_lens + [0]),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            positions=torch.tensor(positions, dtype=torch.int64, device=device),
            block_tables=table.to(device),
            context_lens=torch.tensor(ctx_lens, dtype=torch.int32, device=device),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            prefill_query_lens=np.array([s.query_len for s in prefills], dtype=np.int64),
            prefill_context_lens=np.array([s.context_len for s in prefills], dtype=np.int64),
        )

    def decode_splits(self, num_decodes: int, group: int | None = None, variant: str | None = None) -> int:
        """Splits of each decode's context (flash-decoding): as many as fit the GPU's resident
        blocks in one wave (floor, so no partial second wave), at most one per 128 tokens of
        max_model_len. `group`: query heads per kv head (default the model's; cascade decode's
        prefix pass has width x that); `variant` "v5": that kernel's heads and blocks a SM, and
        the count whose waves of blocks come closest to full (ops.wave_splits: its blocks of 4
        kv heads are few). Depends on host ints only (graph-safe)."""
        maxg, per_kv = ops.decode_group_split(group or self.num_heads // self.num_kv_heads, variant)
        cap = min(ops.MAX_SPLITS, -(-self.max_model_len // 128))
        if variant == "v6":  # a block a sequence's kv heads, resident blocks by its ring
            base = per_kv * max(1, num_decodes)
            smem = ops.decode_v6_smem(max(16, self.block_size), self.num_kv_heads, self.head_dim)
            slots = ops.decode_v6_blocks_per_sm(smem) * self._num_sms
        else:
            kv_heads = self.v5_blocking(num_decodes) if variant == "v5" else 1
            base = ops.decode_grid_x(self.num_kv_heads, per_kv, kv_heads) * max(1, num_decodes)
            slots = ops.decode_blocks_per_sm(maxg, variant) * self._num_sms
        if variant in ("v5", "v6"):
            if self.v5_splits is not None:
                return min(self.v5_splits, cap)
            return ops.wave_splits(base, slots, cap, self.v5_split_cost)
        return max(1, min(slots // base, cap))

    def v5_blocking(self, num_decodes: int) -> int:
        """paged_decode_v5's kv heads a block for `num_decodes` decodes (host ints only): one
        where a block a kv head does not fill the GPU's resident blocks once (small batches:
        more blocks in flight), else ops.DECODE_V5_KV_HEADS (or the most the model has);
        v5_kv_heads (INFLIGHTLLM_DECODE_V5_KV_HEADS) when set."""
        if self.v5_kv_heads is not None:
            return ops.v5_kv_heads(self.num_kv_heads, self.v5_kv_heads)
        _, per_kv = ops.decode_group_split(self.num_heads // self.num_kv_heads, "v5")
        if ops.decode_grid_x(self.num_kv_heads, per_kv) * max(1, num_decodes) < ops.DECODE_V5_BLOCKS_PER_SM * self._num_sms:
            return 1
        return ops.v5_kv_heads(self.num_kv_heads)

    def decode_kernel(self, num_decodes: int) -> tuple[str, int]:
        """(the decode kernel of ops.DECODE_KERNELS, v5 or v6, its split count) for `num_decodes`
        decodes: with "auto", for an FP8 cache read by fp16 / bf16 queries v6 from
        ops.DECODE_V6_MIN_DECODES decodes where it fits (allocate_kv_cache), else v5; for other
        caches v4 where the contexts are not split, v2 where they are (DECODE_DEFAULT)."""
        impl = self.decode_impl
        if impl == "auto" and self.fp8 and self.query_dtype != torch.float32:
            impl = "v6" if self._v6_ok and num_decodes >= ops.DECODE_V6_MIN_DECODES else "v5"
        if impl in ("v5", "v6"):
            return impl, self.decode_splits(num_decodes, variant=impl)
        splits = self.decode_splits(num_decodes)
        if impl == "auto":
            impl = "v4" if splits == 1 else "v2"
        return impl, splits

    def prefill_kind(self, dtype: torch.dtype) -> str:
        if dtype == torch.float32:
            return "fma"
        if self.prefill_impl == "flash" and self._flash_error is None:
            return "flash"
        return "mma"

    # ------------------------------------------------------------------ attention
    def forward(self, layer_index, query, key, value, metadata: CudaAttentionMetadata, out=None, kv_written=False):
        """query [T, H, d], key/value [T, kvh, d] (strided views fine, e.g. of a fused qkv
        output; query is copied only if its base or strides are not 16-byte multiples, key and
        value are read in place, with 2/4-byte instead of 16-byte accesses when misaligned).
        Writes K/V to the cache, then attends. Returns out [T, H, d] (contiguous; pass `out`
        to write into a preallocated buffer, e.g. a CUDA-graph static output). kv_written: the
        caller already wrote this step's K/V to the cache (the fused small-batch qkv kernel)."""
        num_tokens = query.shape[0]
        if out is None:
            out = torch.empty(
                (num_tokens, self.num_heads, self.head_dim), dtype=query.dtype, device=query.device
            )
        stream = ops.current_stream()
        key_cache = self.key_cache[layer_index]
        value_cache = self.value_cache[layer_index]
        scales = self.kv_scales[layer_index] if self.fp8 else None
        if self.fp8:
            if kv_written:
                raise ValueError("kv_written: an FP8 cache is written by forward only (reshape_and_cache_fp8)")
            ops.reshape_and_cache_fp8(key, value, key_cache, value_cache, metadata.slot_mapping, *scales, stream)
        elif not kv_written:
            ops.reshape_and_cache(key, value, key_cache, value_cache, metadata.slot_mapping, stream)
        if not ops.aligned16(query):  # e.g. an odd offset: copy into fresh (aligned) memory
            query = query.clone(memory_format=torch.contiguous_format)
        window = self.sliding_window or 0
        nd = metadata.num_decodes
        if nd > 0 and metadata.cascade is not None and not window:
            self._cascade_decode(query, key_cache, value_cache, metadata.cascade, nd, out, stream, scales)
        elif nd > 0:
            impl, splits = self.decode_kernel(nd)
            ops.paged_decode(
                query,
                key_cache,
                value_cache,
                metadata.block_tables,
                metadata.context_lens,
                out,
                nd,
                splits,
                self.num_heads,
                self.num_kv_heads,
                self.head_dim,
                self._bs_shift,
                window,
                self.scale,
                stream,
                impl,
                self.v5_min_split if impl in ("v5", "v6") else self.decode_min_split,
                scales,
                self.v5_blocking(nd) if impl == "v5" else 1,
                self.block_size,
            )
        if metadata.num_prefills > 0 and metadata.max_query_len > 0:
            kind = self.prefill_kind(query.dtype)
            if kind == "flash":
                try:
                    self._prefill_flash(query, key_cache, value_cache, metadata, out, stream, scales)
                    return out
                except (RuntimeError, TypeError) as error:  # op missing / rejected: fall back
                    self._flash_error = f"{type(error).__name__}: {error}"
                    log.warning(
                        "flash prefill unavailable, using prefill_mma: %s", self._flash_error
                    )
                    kind = "mma"
            block_tables = metadata.block_tables
            if scales is not None:  # the kernels read T: the contexts dequantized into a scratch cache
                key_cache, value_cache, block_tables = self._dequantized_contexts(
                    query.dtype, key_cache, value_cache, metadata, stream, scales
                )
            ops.prefill(
                kind,
                query,
                key_cache,
                value_cache,
                block_tables,
                metadata.context_lens,
                metadata.query_start_loc,
                out,
                nd,
                metadata.num_prefills,
                metadata.max_query_len,
                self.num_heads,
                self.num_kv_heads,
                self.head_dim,
                self._bs_shift,
                window,
                self.scale,
                stream,
            )
        return out

    def _cascade_prefix_mma(self, members, key_cache, value_cache, cascade: CascadeDecode, stream):
        """The groups' shared prefixes on tensor cores (ops.cascade_prefix_mma, a 16-bit cache):
        each kv head's query heads of all a group's sequences are one tile of query rows over
        the prefix read through the block table, cut into splits (ops.cascade_prefix_splits).
        Returns the splits' partials in the kernel's layout: (output [G, kvh, S, R, D] float32,
        normalised; log-sum-exp [G, kvh, S, R] in log2 units; None: no sums, normalised)."""
        G, n = cascade.num_groups, cascade.width
        kvh, D, H = self.num_kv_heads, self.head_dim, self.num_heads
        grp = H // kvh
        # contiguous: with one query head per kv head the reshape is a view, which the kernel
        # would read as the wrong rows (seen on an H200: 8 heads / 8 kv heads)
        packed = members.view(G, n, kvh, grp, D).permute(0, 2, 1, 3, 4).reshape(G, kvh, n * grp, D).contiguous()
        rows = n * grp
        threads = ops.cascade_prefix_threads(rows)
        splits = ops.cascade_prefix_splits(-(-rows // (threads // 32 * 16)) * kvh * G, self._num_sms, threads)
        output, lse = ops.cascade_prefix_mma(packed, key_cache, value_cache, cascade.prefix_tables,
                                             cascade.prefix_lens, self._bs_shift, self.scale, stream, splits)
        return output, lse, None

    def _cascade_decode(self, query, key_cache, value_cache, cascade: CascadeDecode, nd: int, out, stream, scales):
        """Decode attention of decodes that share prefixes (plan_cascade): each group's width
        sequences attend their shared prefix in one pass, as one sequence of width x
        num_heads query heads (its K/V read once, not once per sequence), every decode
        attends its own blocks after the prefix, and the two passes' partials merge as
        flash-decoding's splits do (ops.cascade_merge, one kernel)."""
        G, n = cascade.num_groups, cascade.width
        H, kvh, D = self.num_heads, self.num_kv_heads, self.head_dim
        grp = H // kvh
        q = query[:nd]
        members = q.index_select(0, cascade.member_rows)  # [G * n, H, D]
        if q.dtype != torch.float32 and not self.fp8:
            # tensor cores: the decode kernel's CUDA-core dot products bound this pass
            prefix = self._cascade_prefix_mma(members, key_cache, value_cache, cascade, stream)
            layout = "mma"
        else:
            # [G * n, H, D] -> [G, kvh * n * grp, D]: a kv head's query heads of all n members together
            grouped = members.view(G, n, kvh, grp, D).transpose(1, 2).reshape(G, kvh * n * grp, D)
            z = self.decode_splits(G, n * grp)
            prefix = ops.paged_decode_partials(
                grouped, key_cache, value_cache, cascade.prefix_tables, cascade.prefix_lens, G, z, n * H, kvh, D,
                self._bs_shift, self.scale, stream, "v4" if z == 1 else "v2", self.decode_min_split, scales)
            layout = "decode"
        z2 = self.decode_splits(nd)
        variant = "v4" if z2 == 1 else "v2"
        suffix = ops.paged_decode_partials(
            q, key_cache, value_cache, cascade.suffix_tables, cascade.suffix_lens, nd, z2, H, kvh, D,
            self._bs_shift, self.scale, stream, variant, self.decode_min_split, scales)
        # A decode in no group (or a graph's padding row) has slot G * n: its own blocks alone.
        target = out[:nd] if out[:nd].is_contiguous() else torch.empty_like(out[:nd])
        ops.cascade_merge(prefix, layout, cascade.prefix_slot, G * n, n, grp, kvh, suffix, target, stream)
        if target.data_ptr() != out[:nd].data_ptr():
            out[:nd] = target

    def _dequantized_contexts(self, dtype, key_cache, value_cache, md: CudaAttentionMetadata, stream, scales):
        """An FP8 cache's prefill contexts for prefill_mma / prefill_fma, which read K/V of the
        query's dtype through a block table: each prefill's K/V dequantized (gather_kv_fp8)
        into blocks of its own in a scratch cache of ceil(max_context_len / block_size) blocks
        a sequence, and the block table of that cache (row num_decodes + p: p's blocks; decode
        rows unused). Host ints only, like the flash path's gather."""
        nd, npf = md.num_decodes, md.num_prefills
        device = key_cache.device
        width = max(1, -(-md.max_context_len // self.block_size))
        rows = width * self.block_size  # scratch slots a sequence
        shape = (npf * width, self.block_size, self.num_kv_heads, self.head_dim)
        k = torch.empty(shape, dtype=dtype, device=device)
        v = torch.empty_like(k)
        cu = torch.arange(0, (npf + 1) * rows, rows, dtype=torch.int32, device=device)
        ops.gather_kv(key_cache, value_cache, k, v, md.block_tables, md.context_lens, cu, nd, npf,
                      md.max_context_len, self._bs_shift, stream, scales)
        table = (torch.arange((nd + npf) * width, dtype=torch.int32, device=device) - nd * width).clamp_(min=0)
        return k, v, table.view(nd + npf, width)

    def _prefill_flash(self, query, key_cache, value_cache, md: CudaAttentionMetadata, out, stream, scales=None):
        """Gather each prefill's K/V into packed rows (dequantized from an FP8 cache with its
        `scales`), then attend: runs of whole prompts of one length (plan_prefill_segments) as a
        dense batch on cuDNN's fused attention, everything else by torch's flash varlen forward
        (causal aligned bottom-right, so chunks and prefix hits attend their whole context)."""
        nd, npf, ndt = md.num_decodes, md.num_prefills, md.num_decode_tokens
        device = query.device
        q = query[ndt:]
        cu_q = md.query_start_loc[nd : nd + npf + 1] - ndt
        cu_k = torch.zeros(npf + 1, dtype=torch.int32, device=device)
        cu_k[1:] = torch.cumsum(md.context_lens[nd : nd + npf], 0, dtype=torch.int32)
        rows = npf * md.max_context_len  # upper bound of the packed K/V rows (host ints only)
        k = torch.empty((rows, self.num_kv_heads, self.head_dim), dtype=query.dtype, device=device)
        v = torch.empty_like(k)
        ops.gather_kv(
            key_cache,
            value_cache,
            k,
            v,
            md.block_tables,
            md.context_lens,
            cu_k,
            nd,
            npf,
            md.max_context_len,
            self._bs_shift,
            stream,
            scales,
        )
        segments = None
        if (self._cudnn_ok and self._cudnn_error is None and self.prefill_cudnn_min_len > 0 and not self.sliding_window
                and md.prefill_query_lens is not None and md.prefill_context_lens is not None):
            segments = plan_prefill_segments(md.prefill_query_lens, md.prefill_context_lens, self.prefill_cudnn_min_len,
                                             PREFILL_CUDNN_ALIGN, self.prefill_cudnn_pad)
            if all(length == 0 for _, _, length in segments):
                segments = None
        if segments is None:  # one varlen call over every prefill
            self._varlen(q, k, v, cu_q, cu_k, md.max_query_len, md.max_context_len, out[ndt:])
            return
        q_off = np.zeros(npf + 1, dtype=np.int64)
        np.cumsum(md.prefill_query_lens, out=q_off[1:])
        k_off = np.zeros(npf + 1, dtype=np.int64)
        np.cumsum(md.prefill_context_lens, out=k_off[1:])
        for first, count, length in segments:
            qa, qb, ka, kb = int(q_off[first]), int(q_off[first + count]), int(k_off[first]), int(k_off[first + count])
            if length and self._cudnn_error is None:
                try:
                    if qb - qa < length:  # one unaligned whole prompt, padded to `length`
                        self._dense_padded(q[qa:qb], k[ka:kb], v[ka:kb], length, out[ndt + qa : ndt + qb])
                    else:
                        self._dense(q[qa:qb], k[ka:kb], v[ka:kb], count, length, out[ndt + qa : ndt + qb])
                    continue
                except RuntimeError as error:  # rejected by this cuDNN / shape: flash varlen from now on
                    self._cudnn_error = f"{type(error).__name__}: {error}"
                    log.warning("cuDNN prefill attention unavailable, using flash varlen: %s", self._cudnn_error)
            self._varlen(q[qa:qb], k[ka:kb], v[ka:kb], cu_q[first : first + count + 1] - qa,
                         cu_k[first : first + count + 1] - ka, int(md.prefill_query_lens[first : first + count].max()),
                         int(md.prefill_context_lens[first : first + count].max()), out[ndt + qa : ndt + qb])

    def _varlen(self, q, k, v, cu_q, cu_k, max_q: int, max_k: int, out) -> None:
        """torch's flash varlen forward of packed sequences into `out` (their rows)."""
        kwargs = {"scale": self.scale}
        if self.sliding_window:
            kwargs.update(window_size_left=self.sliding_window - 1, window_size_right=0)
        result = torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, True, False, **kwargs)
        out.copy_(result[0])

    def warm_padded_prefill(self, max_tokens: int, dtype: torch.dtype) -> int:
        """With prefill_cudnn_pad on, builds cuDNN's plan for every padded length a prompt of up
        to `max_tokens` can take (each new shape costs a plan, ~35 ms on an H100: paid here at
        the engine's start, not by the steps). Returns the lengths warmed (0: off)."""
        pad, low = self.prefill_cudnn_pad, self.prefill_cudnn_min_len
        if not (pad and low and self._cudnn_ok and self._cudnn_error is None) or self.kv_cache is None:
            return 0
        device = self.kv_cache.device
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        lengths = range(-(-low // pad) * pad, -(-max_tokens // pad) * pad + 1, pad)
        start = time.monotonic()
        try:
            for length in lengths:
                q = torch.zeros((length, h, d), dtype=dtype, device=device)
                k = torch.zeros((length, kvh, d), dtype=dtype, device=device)
                self._dense(q, k, k, 1, length, torch.empty_like(q))
        except RuntimeError as error:  # this cuDNN refuses: unaligned prompts stay on flash varlen
            log.warning("cuDNN padded prefill unavailable (%s): unaligned prompts stay on flash varlen",
                        str(error).splitlines()[0])
            self.prefill_cudnn_pad = 0
            return 0
        torch.cuda.synchronize(device)
        log.info("cuDNN prefill plans for %d padded lengths (%d-%d) in %.1f s", len(lengths), lengths[0],
                 lengths[-1], time.monotonic() - start)
        return len(lengths)

    def _dense_padded(self, q, k, v, length: int, out) -> None:
        """One whole prompt of fewer than `length` tokens by cuDNN at `length`: its query, keys
        and values copied into rows zeroed past its end (under the causal mask no row of the
        prompt reads a padding key; zeros keep masked products finite), its rows of the output
        copied back."""
        rows = q.shape[0]

        def padded(x):
            buffer = torch.empty((length, *x.shape[1:]), dtype=x.dtype, device=x.device)
            buffer[:rows].copy_(x)
            buffer[rows:].zero_()
            return buffer

        result = torch.empty((length, *out.shape[1:]), dtype=out.dtype, device=out.device)
        self._dense(padded(q), padded(k), padded(v), 1, length, result)
        out.copy_(result[:rows])

    def _dense(self, q, k, v, prompts: int, length: int, out) -> None:
        """`prompts` whole prompts of `length` tokens each, packed ([prompts * length, heads, d]),
        by cuDNN's fused attention (the op of torch SDPA's CUDNN_ATTENTION backend, causal, kv
        heads shared by their query heads) into `out` (their rows). A query strided by a fused qkv
        projection that the backend refuses is copied packed, then and in later calls
        (_cudnn_packed_q)."""
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        kd = k.view(prompts, length, kvh, d).transpose(1, 2)
        vd = v.view(prompts, length, kvh, d).transpose(1, 2)

        def attend(query):  # the op SDPA's cuDNN backend calls (no global backend switch)
            qd = query.view(prompts, length, h, d).transpose(1, 2)
            return torch.ops.aten._scaled_dot_product_cudnn_attention(qd, kd, vd, None, False, 0.0, True, False,
                                                                      scale=self.scale)[0]

        if q.is_contiguous() or not self._cudnn_packed_q:
            try:
                result = attend(q)
            except RuntimeError as error:
                if q.is_contiguous():
                    raise
                log.info("cuDNN attention refused a strided query (%s): packing queries", str(error).splitlines()[0])
                self._cudnn_packed_q = True
                result = attend(q.contiguous())
        else:
            result = attend(q.contiguous())
        out.view(prompts, length, h, d).copy_(result.transpose(1, 2))
