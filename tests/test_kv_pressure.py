"""The preemption cost model (inflightllm/kv_pressure.py), the host-link measure on the
CPU, and the engine's KV-pressure counters and `reconfigure` over the stub model."""

from __future__ import annotations

import pytest
import torch

from inflightllm.attention.torch_ref import TorchReferenceAttention
from inflightllm.kv_pressure import HostLink, PreemptionCostModel, measure_host_link
from inflightllm.sampling_params import SamplingParams
from tests.stub_model import reference_output, stub_engine


def test_swap_against_recompute_by_the_two_figures():
    # 1 MB blocks over 10 GB/s: 0.2 ms per block out and back. 16 tokens a block.
    costs = PreemptionCostModel(HostLink(bytes_per_second=10e9, bytes_per_block=1_000_000),
                                prefill_seconds_per_token=20e-6)
    assert costs.swap_seconds(4) == pytest.approx(0.8e-3)
    assert costs.recompute_seconds(64) == pytest.approx(1.28e-3)
    assert costs.prefers_swap(4, 64)  # 0.8 ms < 1.28 ms
    assert not costs.prefers_swap(4, 32)  # 0.8 ms > 0.64 ms: 2 of its 4 blocks are held by others
    slow_link = PreemptionCostModel(HostLink(bytes_per_second=1e9, bytes_per_block=1_000_000),
                                    prefill_seconds_per_token=20e-6)
    assert not slow_link.prefers_swap(4, 64)  # 8 ms > 1.28 ms


def test_no_figure_means_recompute():
    assert not PreemptionCostModel(None, prefill_seconds_per_token=1.0).prefers_swap(1, 1000)
    unmeasured = PreemptionCostModel(HostLink(bytes_per_second=1e12, bytes_per_block=1))
    assert unmeasured.prefill_seconds_per_token is None and not unmeasured.prefers_swap(1, 1000)


def test_prefill_rate_is_a_decayed_running_estimate_of_the_steps():
    costs = PreemptionCostModel(HostLink(bytes_per_second=1e9, bytes_per_block=100))
    costs.observe_step(0.010, 100)
    assert costs.prefill_seconds_per_token == pytest.approx(1e-4)
    costs.observe_step(0.030, 100)  # (0.010 * 0.95 + 0.030) / (100 * 0.95 + 100)
    assert costs.prefill_seconds_per_token == pytest.approx(0.0395 / 195)
    costs.observe_step(0.0, 10)  # nothing measured: ignored
    costs.observe_step(1.0, 0)
    assert costs.prefill_seconds_per_token == pytest.approx(0.0395 / 195)
    for _ in range(400):  # the old figures fade: the machine got slower
        costs.observe_step(0.5, 100)
    assert costs.prefill_seconds_per_token == pytest.approx(5e-3, rel=1e-6)


def test_host_link_rejects_figures_that_cannot_be_measured():
    with pytest.raises(ValueError, match="bytes_per_second 0.0 must be positive"):
        HostLink(bytes_per_second=0.0, bytes_per_block=10)
    with pytest.raises(ValueError, match="bytes_per_block 0 must be at least 1"):
        HostLink(bytes_per_second=1.0, bytes_per_block=0)


def test_host_link_of_a_cpu_cache():
    attention = TorchReferenceAttention(num_heads=4, num_kv_heads=2, head_dim=8)
    attention.allocate_kv_cache(10, 4, 3, 2, 8, torch.float32, torch.device("cpu"))
    link = measure_host_link(attention.key_cache, attention.value_cache, 10)
    assert link.bytes_per_block == 3 * 2 * 4 * 2 * 8 * 4  # layers x (K, V) x tokens x heads x dim x float32
    assert link.bytes_per_second > 0


def drive(engine, prompts: list[list[int]], max_tokens: int, after_step=None) -> dict[str, list[int]]:
    """Each prompt's tokens, the engine stepped until done; `after_step(engine)` after every step."""
    received: dict[str, list[int]] = {}
    for index, prompt in enumerate(prompts):
        engine.add_request(f"r{index}", prompt, SamplingParams(max_tokens=max_tokens))
    while engine.has_unfinished():
        for output in engine.step():
            received.setdefault(output.request_id, []).extend(output.new_token_ids)
        if after_step:
            after_step(engine)
    return received


PROMPTS = [[(7 * i + j) % 90 + 1 for j in range(6 + i)] for i in range(6)]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_engine_counts_what_preemptions_cost(mode):
    engine = stub_engine(num_blocks=12, block_size=4, preemption_mode=mode, max_num_tokens=64,
                         enable_kv_cache_reuse=False)
    received = drive(engine, PROMPTS, 10)
    assert received == {f"r{i}": reference_output(prompt, 10) for i, prompt in enumerate(PROMPTS)}
    stats = engine.stats()
    assert stats.num_preemptions_total > 0
    if mode == "swap":
        assert stats.num_swapped_out_total == stats.num_preemptions_total
        assert stats.num_swapped_out_blocks_total == stats.num_swapped_in_blocks_total > 0
        # The stub holds no KV memory (no host link): blocks are counted, bytes are not known.
        assert stats.swapped_out_bytes_total == 0 and stats.host_link_bytes_per_second is None
        # Only partial blocks are computed again.
        assert 0 <= stats.num_recomputed_tokens_total < 4 * stats.num_preemptions_total
    else:
        assert stats.num_swapped_out_blocks_total == stats.num_swapped_in_blocks_total == 0
        assert stats.num_recomputed_tokens_total > 4 * stats.num_preemptions_total  # no prefix cache here
    assert stats.prefill_seconds_per_token is not None and stats.prefill_seconds_per_token > 0


def test_reconfigure_an_idle_engine_between_policies():
    engine = stub_engine(num_blocks=12, block_size=4, max_num_tokens=64)
    first = drive(engine, PROMPTS, 10)
    assert engine.stats().num_preemptions_total > 0
    engine.reconfigure(capacity_policy="GUARANTEED_NO_EVICT", preemption_mode="recompute")
    assert engine.config.capacity_policy == "guaranteed_no_evict" and engine.scheduler.no_evict
    stats = engine.stats()
    assert (stats.num_preemptions_total, stats.prefix_cache_hits, stats.num_blocks_used) == (0, 0, 0)
    assert drive(engine, PROMPTS, 10) == first
    assert engine.stats().num_preemptions_total == 0
    with pytest.raises(ValueError, match="reconfigure: block_size cannot change; allowed: capacity_policy"):
        engine.reconfigure(block_size=8)
    engine.add_request("busy", PROMPTS[0], SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="unfinished requests; allowed only when idle"):
        engine.reconfigure(kv_watermark=0.1)


def test_reconfigure_lowers_the_batch_and_token_limits_up_to_the_built_ones():
    # perf/bench_rows.py --settings trtllm: one engine built for the largest row's limits,
    # each row run under its own.
    engine = stub_engine(num_blocks=64, block_size=4, max_batch_size=8, max_num_tokens=64)
    wide = drive(engine, PROMPTS, 6)
    engine.reconfigure(max_batch_size=2, max_num_tokens=8)
    assert (engine.config.max_batch_size, engine.config.max_num_tokens) == (2, 8)
    batches, tokens = [], []

    def record(engine):
        batches.append(len(engine.scheduler.running))
        tokens.append(engine.stats().num_tokens_last_step)

    assert drive(engine, PROMPTS, 6, after_step=record) == wide
    assert max(batches) == 2 and max(tokens) == 8
    engine.reconfigure(max_batch_size=8, max_num_tokens=64)  # back up to the built limits
    assert drive(engine, PROMPTS, 6) == wide
    with pytest.raises(ValueError, match=r"reconfigure: max_batch_size 9: allowed 1 to 8 \(what the engine was built"):
        engine.reconfigure(max_batch_size=9)
    with pytest.raises(ValueError, match="reconfigure: max_num_tokens 0: allowed 1 to 64"):
        engine.reconfigure(max_num_tokens=0)
    with pytest.raises(ValueError, match="max_num_tokens 4 is less than max_batch_size 8"):
        engine.reconfigure(max_num_tokens=4)
