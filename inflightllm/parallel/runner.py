"""The runner of one tensor-parallel rank: the model sharded for the rank, its own KV
cache for its KV heads, the same block tables as every other rank.

Every rank runs the same step (the same packed batch, the same collectives in the same
order) and samples from the same all-gathered logits with the same sampler seed, so the
ranks stay in step as vLLM's do; rank 0's sampled tokens travel with the next step
description and the workers check theirs against them.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging

import torch

from inflightllm.config import EngineConfig
from inflightllm.model_source import ModelDims, ModelSpec
from inflightllm.models.loader import LoadedModel, load_model
from inflightllm.parallel.group import Distributed
from inflightllm.parallel.shard import local_arch, shard_llama

logger = logging.getLogger(__name__)


def rank_gpu_ids(config: EngineConfig) -> tuple[int, ...]:
    """The GPUs of the tensor-parallel ranks, rank order (the profile's gpu_ids, else 0..N-1)."""
    size = config.tensor_parallel_size
    return tuple(config.gpu_ids[:size]) if len(config.gpu_ids) >= size else tuple(range(size))


def rank_device(config: EngineConfig, rank: int) -> torch.device:
    if config.device == "cpu":
        return torch.device("cpu")
    return torch.device("cuda", rank_gpu_ids(config)[rank])


def load_rank_model(spec: ModelSpec, config: EngineConfig, dist_: Distributed, loaded: LoadedModel | None = None):
    """This rank's share of the model. CPU: the whole model (or `loaded`), sharded in
    place. GPU: only this rank's share is ever created on its GPU."""
    if config.device == "cpu":
        if loaded is None or loaded.model is None:
            loaded = load_model(spec, device="cpu")
        else:  # the engine's whole model stays whole (tests use it as a reference)
            loaded = dataclasses.replace(loaded, model=copy.deepcopy(loaded.model))
        shard_llama(loaded.model, dist_.tp)
        return loaded
    from inflightllm.gpu.model import load_gpu_model

    return load_gpu_model(spec, config, tp=dist_.tp, device=rank_device(config, dist_.rank))


def make_rank_runner(
    loaded: LoadedModel, config: EngineConfig, dist_: Distributed, num_blocks: int | None, sampler_seed: int
):
    """The CPU reference runner or the CUDA runner over this rank's share; the KV-cache
    size is the smallest any rank can hold."""
    runner_loaded = dataclasses.replace(loaded, arch=local_arch(loaded.arch, dist_.world_size))
    if config.device == "cpu":
        from inflightllm.model_runner import ModelRunner

        blocks = dist_.min_over_ranks(num_blocks)
        return ModelRunner(runner_loaded, blocks, config.block_size, "cpu", sampler_seed, config.kv_cache_dtype,
                           config.host_kv_cache_bytes)
    from inflightllm.gpu.runner import GpuModelRunner

    class RankGpuRunner(GpuModelRunner):
        """The CUDA runner whose KV cache is sized to the smallest rank's budget."""

        def _size_kv_cache(self, new_attention) -> int:
            own = super()._size_kv_cache(new_attention)
            agreed = dist_.min_over_ranks(own)
            logger.info("rank %d: KV blocks %d here, %d agreed across ranks", dist_.rank, own, agreed)
            return agreed

        def _capture_graphs(self) -> None:
            # NCCL's watchdog thread queries events while a rank captures; "global" capture
            # mode would make those calls invalidate the capture. Thread-local mode confines
            # the capture rules to the capturing thread.
            original = torch.cuda.graph
            torch.cuda.graph = functools.partial(original, capture_error_mode="thread_local")
            try:
                super()._capture_graphs()
            finally:
                torch.cuda.graph = original

    if num_blocks is not None:
        num_blocks = dist_.min_over_ranks(num_blocks)
    return RankGpuRunner(runner_loaded, config, num_blocks, sampler_seed)


def cpu_num_blocks(spec: ModelSpec, config: EngineConfig, hf_config: dict) -> int | None:
    """The KV blocks the engine gives each CPU rank (same rule as Engine)."""
    from inflightllm.engine import num_kv_blocks

    return num_kv_blocks(config, ModelDims.from_config(hf_config), spec.dtype)


def leave_group(runner, dist_: Distributed) -> None:
    """A rank's part of a graceful teardown (rank 0 and the workers alike): its CUDA graphs go
    first, since NCCL communicators whose collectives live in captured graphs do not finish
    destroying while those exist (pytorch/pytorch#115388); then the process groups."""
    release_graphs = getattr(runner, "release_graphs", None)
    if release_graphs is not None:
        release_graphs()
    dist_.destroy()
