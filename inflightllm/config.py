"""Engine settings: the `engine:` and `device:` sections of a profile.

They travel to the `engine` Triton model as string config parameters
(`to_parameters`/`from_parameters`), and to the offline `LLM` directly.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

BATCHING_STRATEGIES = ("inflight", "static")
# auto: per victim, swap or recompute, whichever the measured costs say is cheaper
# (inflightllm.kv_pressure.PreemptionCostModel; docs/KV-PRESSURE.md).
PREEMPTION_MODES = ("auto", "recompute", "swap")
# How admission uses the KV cache (docs/KV-PRESSURE.md). max_utilization: admit what fits now
# (minus a watermark), preempt when decodes run out of blocks; guaranteed_no_evict: admit only
# what fits beside the worst case (prompt + max_tokens) of every running request, never preempt.
# TensorRT-LLM's names (MAX_UTILIZATION, GUARANTEED_NO_EVICT) are accepted, in any case.
CAPACITY_POLICIES = ("max_utilization", "guaranteed_no_evict")
DEVICE_KINDS = ("cpu", "gpu")
# KV-cache element type: "auto" = the model's dtype; "fp8" = e4m3 with per-layer K and V scales.
KV_CACHE_DTYPES = ("auto", "fp8")
# "dummy": no model compute, deterministic tokens (inflightllm.dummy_runner; a measurement tool).
RUNNERS = ("model", "dummy")


@dataclass(frozen=True)
class EngineConfig:
    """Scheduling, KV-cache and device settings of one engine."""

    max_batch_size: int = 64  # most requests running at once
    max_num_tokens: int = 2048  # token budget of one step (prefill chunks + decodes)
    max_input_length: int = 2048  # longest prompt accepted
    max_output_len: int = 1024  # largest max_tokens accepted
    block_size: int = 16  # tokens per KV-cache block
    kv_cache_bytes: int = 256 * 1024 * 1024  # CPU: KV-cache budget in bytes
    gpu_memory_utilization: float = 0.9  # GPU: fraction of device memory for weights + KV cache
    enable_kv_cache_reuse: bool = True  # prefix caching
    batching_strategy: str = "inflight"  # inflight | static
    stream_interval: int = 1  # a streamed response every N new tokens
    priority_levels: int = 3  # request priorities 0 .. priority_levels - 1
    cuda_graphs: bool = True  # GPU: replay captured CUDA graphs for decode steps (false: eager, for debugging)
    async_scheduling: bool = False  # schedule and launch step N+1 before step N's tokens are emitted
    preemption_mode: str = "recompute"  # recompute | swap | auto (docs/KV-PRESSURE.md: recompute measured faster)
    swap_space_blocks: int = 0  # swap: host-memory blocks for preempted requests; 0 = as many as KV blocks
    capacity_policy: str = "max_utilization"  # max_utilization | guaranteed_no_evict
    kv_watermark: float = 0.01  # max_utilization: fraction of the KV blocks kept free when admitting (vLLM's 0.01)
    host_kv_cache_bytes: int = 0  # host KV tier of the prefix cache (evicted blocks kept in host memory); 0 = off
    max_queue_size: int = 0  # waiting requests before new ones are rejected; 0 = unbounded
    default_timeout_microseconds: int = 0  # a waiting request older than this is rejected; 0 = never
    device: str = "cpu"  # cpu | gpu
    gpu_ids: tuple[int, ...] = field(default_factory=tuple)
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1  # engine instances (one per GPU group); gpu_ids holds tp x dp ids
    step_timeout_s: float = 60.0  # tensor parallel: a step longer than this fails the engine (a rank hung)
    num_kv_blocks: int = 0  # 0: derive from the memory budget; > 0: exactly this many (tests)
    fault_injection: bool = False  # tests only: requests with the seeds of inflightllm.faults fail on purpose
    runner: str = "model"  # model | dummy (no model compute: measures the response path alone)
    kv_cache_dtype: str = "auto"  # auto (the model's dtype) | fp8 (e4m3, per-layer K/V scales: twice the tokens)
    max_n: int = 8  # most outputs per request (n, best_of, num_return_sequences)
    max_beam_width: int = 8  # widest beam search (beam_width)

    def __post_init__(self) -> None:
        # Normalised here so that every way in (profile, Triton parameters, the offline LLM,
        # the benches) accepts TensorRT-LLM's spelling and fails with the same message.
        object.__setattr__(self, "capacity_policy", capacity_policy_name(self.capacity_policy))
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode: {self.preemption_mode!r} is not allowed; allowed values: "
                             f"{', '.join(PREEMPTION_MODES)}")
        if not 0.0 <= self.kv_watermark < 1.0:
            raise ValueError(f"kv_watermark: {self.kv_watermark!r} is out of range; allowed: at least 0 and less "
                             "than 1 (a fraction of the KV blocks)")

    def to_parameters(self) -> dict[str, str]:
        params = {}
        for key, value in asdict(self).items():
            if isinstance(value, bool):
                params[key] = "true" if value else "false"
            elif isinstance(value, (tuple, list)):
                params[key] = ",".join(str(v) for v in value)
            else:
                params[key] = str(value)
        return params

    @classmethod
    def from_parameters(cls, params: dict[str, str]) -> EngineConfig:
        """Build from Triton string parameters; unknown keys are ignored (they belong to
        the model source or to Triton), malformed values raise ValueError naming the key."""
        values: dict = {}
        for field_ in fields(cls):
            if field_.name not in params:
                continue
            raw = params[field_.name].strip()
            try:
                if field_.type == "bool":
                    if raw.lower() not in ("true", "false", "1", "0"):
                        raise ValueError("expected true or false")
                    values[field_.name] = raw.lower() in ("true", "1")
                elif field_.type == "int":
                    values[field_.name] = int(raw)
                elif field_.type == "float":
                    values[field_.name] = float(raw)
                elif field_.name == "gpu_ids":
                    values[field_.name] = tuple(int(v) for v in raw.split(",") if v.strip())
                else:
                    values[field_.name] = raw
            except ValueError as error:
                raise ValueError(f"engine parameter {field_.name!r}: bad value {raw!r} ({error})") from None
        return cls(**values)


CAPACITY_POLICIES_ALLOWED = (f"allowed values: {', '.join(CAPACITY_POLICIES)} "
                             "(or TensorRT-LLM's GUARANTEED_NO_EVICT, MAX_UTILIZATION; any case)")


def capacity_policy_name(value: str) -> str:
    """Our name of a capacity policy: ours or TensorRT-LLM's (`GUARANTEED_NO_EVICT`,
    `MAX_UTILIZATION`), in any case. ValueError naming the allowed values otherwise."""
    name = value.strip().lower() if isinstance(value, str) else value
    if name not in CAPACITY_POLICIES:
        raise ValueError(f"capacity_policy: {value!r} is not allowed; {CAPACITY_POLICIES_ALLOWED}")
    return name
