"""Where one engine instance runs: its GPU group under data parallelism, and a check from
inside the instance that it really is there.

Triton hands a `KIND_GPU` Python model instance `model_instance_kind` = "GPU" and
`model_instance_device_id` but does not place it (no CUDA_VISIBLE_DEVICES); users of
other Triton LLM backends report every instance landing on GPU 0. So the engine model
picks its group of `gpu_ids` (the instance on `gpu_ids[i*tp]` takes
`gpu_ids[i*tp : (i+1)*tp]`), makes it current, and after loading reports where its
weights actually are (a log line and the `inflightllm_engine_gpu` gauge).
"""

from __future__ import annotations

import dataclasses
import logging

from inflightllm.config import EngineConfig
from inflightllm.metrics import ChangedGauge

logger = logging.getLogger(__name__)


class PlacementError(ValueError):
    pass


def instance_config(config: EngineConfig, args: dict) -> EngineConfig:
    """The engine config of this instance: with a KIND_GPU instance, gpu_ids narrowed to
    its tensor-parallel group (the one starting at `model_instance_device_id`)."""
    if config.device != "gpu" or str(args.get("model_instance_kind", "")).upper() != "GPU":
        return config
    device_id = int(args.get("model_instance_device_id", 0))
    tp = config.tensor_parallel_size
    starts = [config.gpu_ids[i * tp] for i in range(len(config.gpu_ids) // tp)] if config.gpu_ids else []
    if device_id not in starts:
        raise PlacementError(
            f"engine instance on GPU {device_id}: not the first GPU of any tensor-parallel group of "
            f"gpu_ids {list(config.gpu_ids)} (tensor_parallel_size {tp})"
        )
    index = starts.index(device_id)
    group = tuple(config.gpu_ids[index * tp : (index + 1) * tp])
    return dataclasses.replace(config, gpu_ids=group, data_parallel_size=1)


def where_it_runs(engine) -> dict:
    """What this instance really uses: the device of its weights (rank 0's), the current
    CUDA device, and the GPU's name and UUID."""
    config = engine.config
    if config.device != "gpu":
        return {"device": "cpu", "gpu_ids": [], "tensor_parallel_size": config.tensor_parallel_size}
    import torch

    weights = engine.loaded.model.embed.device if engine.loaded.model is not None else engine.loaded.device
    props = torch.cuda.get_device_properties(weights)
    uuid = str(getattr(props, "uuid", ""))
    info = {
        "device": str(weights),
        "current_device": torch.cuda.current_device(),
        "gpu_ids": list(config.gpu_ids),
        "tensor_parallel_size": config.tensor_parallel_size,
        "name": props.name,
        "uuid": uuid,
    }
    expected = config.gpu_ids[0] if config.gpu_ids else None
    if expected is not None and weights.index != expected:
        raise PlacementError(f"engine weights are on {weights}, expected cuda:{expected} (gpu_ids {list(config.gpu_ids)})")
    return info


class PlacementMetrics:
    """`inflightllm_engine_gpu{model, instance, gpu}` = 1 for this instance's GPU (rank 0's),
    and `inflightllm_engine_ready{model, instance}`: 1 while it serves, 0 once a
    tensor-parallel rank failed."""

    def __init__(self, pb_utils, model_name: str, instance_name: str, gpu: str):
        family = pb_utils.MetricFamily
        labels = {"model": model_name, "instance": instance_name}
        self._gpu_family = family(
            name="inflightllm_engine_gpu", description="The GPU an engine instance runs on (value 1)", kind=family.GAUGE
        )
        self._ready_family = family(
            name="inflightllm_engine_ready",
            description="1 while the engine instance serves, 0 after a tensor-parallel rank failed",
            kind=family.GAUGE,
        )
        self.gpu = self._gpu_family.Metric(labels={**labels, "gpu": gpu})
        self.gpu.set(1)
        # Set after every engine step: an IPC only when it changes.
        self.ready = ChangedGauge(self._ready_family.Metric(labels=labels))
        self.ready.set(1)
