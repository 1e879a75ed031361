"""What a preemption costs: the figures the `auto` preemption mode decides by.

A preempted request either gives up its KV blocks and computes its tokens again later
(recompute) or has its computed blocks copied to host memory and back (swap). Which is
cheaper depends on the machine: the host link (PCIe, NVLink-C2C, or a memcpy on a CPU)
against the model's prefill speed. Both are measured, not guessed:

- `HostLink`: bytes per second between the KV cache and host memory, measured once by
  the runner at start (`measure_host_link`: a timed copy of part of the cache to pinned
  host memory and back on a GPU; a memcpy of one block's bytes on the CPU), and the bytes
  one KV block holds over all layers (K and V).
- `PreemptionCostModel.observe_step`: seconds per token of the engine's own steps that
  had prefill tokens in them, a running (exponentially decayed) estimate.

`PreemptionCostModel.prefers_swap(num_blocks, num_recompute_tokens)` is the decision:
swap when copying the blocks out and back (2 x bytes / bandwidth) is cheaper than
computing the tokens again (tokens x seconds per prefill token). Until both figures
exist (no prefill step timed yet, or a runner without a host link: the stub and dummy
runners) it says recompute. docs/KV-PRESSURE.md.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class HostLink:
    """The measured host link of a runner's KV cache."""

    bytes_per_second: float  # device <-> host copy bandwidth (both directions averaged)
    bytes_per_block: int  # one KV block, every layer, K and V

    def __post_init__(self) -> None:
        if not self.bytes_per_second > 0:
            raise ValueError(f"HostLink: bytes_per_second {self.bytes_per_second!r} must be positive")
        if self.bytes_per_block < 1:
            raise ValueError(f"HostLink: bytes_per_block {self.bytes_per_block!r} must be at least 1")


class PreemptionCostModel:
    """Swap or recompute, by the measured host link and prefill speed.

    `host_link` None: nothing can be swapped by measure (auto recomputes). The prefill
    figure is given (tests, a fixed figure) or estimated from `observe_step` calls."""

    # Weight of the newest step in the running estimate: about the last 20 prefill steps count.
    DECAY = 0.95

    def __init__(self, host_link: HostLink | None, prefill_seconds_per_token: float | None = None):
        self.host_link = host_link
        self._seconds = 0.0  # decayed sums over observed prefill steps
        self._tokens = 0.0
        self._fixed = prefill_seconds_per_token

    @property
    def prefill_seconds_per_token(self) -> float | None:
        if self._fixed is not None:
            return self._fixed
        return self._seconds / self._tokens if self._tokens > 0 else None

    def observe_step(self, seconds: float, num_tokens: int) -> None:
        """A step that computed `num_tokens` tokens, prefill chunks among them, took `seconds`."""
        if num_tokens <= 0 or seconds <= 0:
            return
        self._seconds = self._seconds * self.DECAY + seconds
        self._tokens = self._tokens * self.DECAY + num_tokens

    def swap_seconds(self, num_blocks: int) -> float | None:
        """Copying `num_blocks` blocks to host memory and back."""
        link = self.host_link
        if link is None:
            return None
        return 2.0 * num_blocks * link.bytes_per_block / link.bytes_per_second

    def recompute_seconds(self, num_tokens: int) -> float | None:
        """Computing `num_tokens` tokens again (as prefill)."""
        rate = self.prefill_seconds_per_token
        return None if rate is None else num_tokens * rate

    def prefers_swap(self, num_blocks: int, num_recompute_tokens: int) -> bool:
        """True when swapping `num_blocks` blocks out and back costs less than recomputing
        `num_recompute_tokens` tokens; False while a figure is missing."""
        swap = self.swap_seconds(num_blocks)
        recompute = self.recompute_seconds(num_recompute_tokens)
        if swap is None or recompute is None:
            return False
        return swap < recompute


def measure_host_link(key_cache: list[torch.Tensor], value_cache: list[torch.Tensor], num_blocks: int,
                      sample_bytes: int = 64 << 20) -> HostLink:
    """Measure the host link of a KV cache (per-layer K and V tensors holding `num_blocks`
    blocks each), at start, before any request uses the cache.

    GPU: up to `sample_bytes` of the first layer's K cache are copied to pinned host memory
    and back, timed after a warm-up (the cache itself is the device side: no device memory
    is allocated beyond it; its contents, unused yet, are written back unchanged). CPU: a
    memcpy of one block's bytes, repeated. The figure is bytes moved / seconds."""
    bytes_per_block = sum(t.numel() * t.element_size() for t in (*key_cache, *value_cache)) // num_blocks
    source = key_cache[0].reshape(-1).view(torch.uint8)  # a view of the contiguous cache
    if source.device.type == "cuda":
        count = min(sample_bytes, source.numel())
        device_side = source[:count]
        host = torch.empty(count, dtype=torch.uint8, pin_memory=True)
        stream = torch.cuda.current_stream(source.device)
        host.copy_(device_side, non_blocking=True)  # warm-up
        device_side.copy_(host, non_blocking=True)
        stream.synchronize()
        rounds = 3
        start = time.perf_counter()
        for _ in range(rounds):
            host.copy_(device_side, non_blocking=True)
            device_side.copy_(host, non_blocking=True)
        stream.synchronize()
        seconds = time.perf_counter() - start
        moved = 2 * rounds * count
    else:
        count = max(1, bytes_per_block)
        block = torch.empty(count, dtype=torch.uint8)
        target = torch.empty_like(block)
        target.copy_(block)  # warm-up
        rounds = 32
        start = time.perf_counter()
        for _ in range(rounds):
            target.copy_(block)
        seconds = time.perf_counter() - start
        moved = rounds * count
    return HostLink(bytes_per_second=moved / max(seconds, 1e-9), bytes_per_block=max(1, bytes_per_block))
