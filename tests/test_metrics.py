"""EngineMetrics (inflightllm/metrics.py) with a recording stand-in for pb_utils (unit),
and the vLLM alias names on a real server's metrics port (server)."""

from __future__ import annotations

import re
import urllib.request

import pytest

from inflightllm.engine import EngineStats, RequestOutput
from inflightllm.metrics import EngineMetrics
from inflightllm.request import FinishReason
from tests.ensemble_client import wait_for


class _Metric:
    def __init__(self, labels, buckets=None):
        self.labels = labels
        self.buckets = buckets
        self.value = 0.0
        self.observations: list[float] = []
        self.calls = 0  # set and increment calls: each an IPC round trip in the stub

    def set(self, value):
        self.value = value
        self.calls += 1

    def increment(self, value):
        self.value += value
        self.calls += 1

    def observe(self, value):
        self.observations.append(value)


class _Family:
    GAUGE, COUNTER, HISTOGRAM = "gauge", "counter", "histogram"
    created: dict[str, _Family] = {}

    def __init__(self, name, description, kind):
        self.name, self.kind = name, kind
        self.metrics: list[_Metric] = []
        _Family.created[name] = self

    def Metric(self, labels, buckets=None):  # noqa: N802 (pb_utils' name)
        metric = _Metric(labels, buckets)
        self.metrics.append(metric)
        return metric


class _PbUtils:
    MetricFamily = _Family


def _stats(**changes) -> EngineStats:
    values = dict(num_running=2, num_waiting=1, num_preemptions_total=0, num_blocks_total=100, num_blocks_used=25,
                  num_blocks_free=75, num_blocks_cached=5, prefix_cache_queries=40, prefix_cache_hits=16,
                  num_tokens_last_step=3, prompt_tokens_total=40, generation_tokens_total=10, num_steps_total=4)
    values.update(changes)
    return EngineStats(**values)


def _finished(reason: FinishReason, prompt: int, output: int) -> RequestOutput:
    return RequestOutput("r", [], [], [], [], [], 0.0, True, reason, prompt, output, 0,
                         time_to_first_token=0.2, time_per_output_token=0.05, e2e_latency=1.0)


def _value(name: str, **labels) -> float:
    for metric in _Family.created[name].metrics:
        if all(metric.labels.get(key) == value for key, value in labels.items()):
            return metric.value
    raise KeyError(name)


def test_vllm_aliases_follow_our_figures():
    _Family.created = {}
    metrics = EngineMetrics(_PbUtils, model_name="engine")
    metrics.update(_stats(), [])
    metrics.update(_stats(prompt_tokens_total=50, generation_tokens_total=17, num_running=1),
                   [_finished(FinishReason.STOP, 10, 7), _finished(FinishReason.CANCELLED, 5, 2)])
    assert _value("vllm:num_requests_running") == 1 and _value("vllm:num_requests_waiting") == 1
    assert _value("vllm:gpu_cache_usage_perc") == _value("vllm:kv_cache_usage_perc") == 0.25
    assert _value("vllm:prompt_tokens_total") == _value("inflightllm_prompt_tokens_total") == 50
    assert _value("vllm:generation_tokens_total") == 17
    assert (_value("vllm:prefix_cache_queries_total"), _value("vllm:prefix_cache_hits_total")) == (40, 16)
    assert _value("vllm:request_success_total", finished_reason="stop") == 1
    assert _value("vllm:request_success_total", finished_reason="abort") == 1  # vLLM's name of cancelled
    assert _value("vllm:request_success_total", finished_reason="length") == 0
    [ttft] = _Family.created["vllm:time_to_first_token_seconds"].metrics
    assert ttft.observations == [0.2, 0.2] and ttft.labels == {"model": "engine", "model_name": "engine"}
    [prompt_tokens] = _Family.created["vllm:request_prompt_tokens"].metrics
    assert prompt_tokens.observations == [10, 5]
    assert {name for name in _Family.created if name.startswith("vllm:")} == {
        "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:gpu_cache_usage_perc",
        "vllm:kv_cache_usage_perc", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
        "vllm:num_preemptions_total", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
        "vllm:request_success_total", "vllm:time_to_first_token_seconds", "vllm:time_per_output_token_seconds",
        "vllm:e2e_request_latency_seconds", "vllm:request_prompt_tokens", "vllm:request_generation_tokens",
    }


def test_background_observer_observes_the_same_off_the_callers_thread():
    """background=True (the engine model): update() queues the finished requests and returns;
    a thread of its own makes their metric calls, one increment a finish reason and step
    batch, with the same values as the synchronous path. The stats-derived series are set
    in update() itself."""
    import threading

    _Family.created = {}
    release = threading.Event()
    callers: list[str] = []
    metrics = EngineMetrics(_PbUtils, model_name="engine", background=True)
    ttft = _Family.created["inflightllm_time_to_first_token_seconds"].metrics[0]
    observe = ttft.observe

    def slow_observe(value):  # an IPC round trip that has not returned yet
        callers.append(threading.current_thread().name)
        release.wait(10)
        observe(value)

    ttft.observe = slow_observe
    metrics.update(_stats(), [])
    outputs = [_finished(FinishReason.STOP, 10, 7), _finished(FinishReason.STOP, 3, 2),
               _finished(FinishReason.LENGTH, 5, 4)]
    metrics.update(_stats(num_running=0, generation_tokens_total=23), outputs)
    # returned while the observer waits in its first call; the stats series are already set
    assert _value("inflightllm_requests", state="running") == 0 and _value("vllm:generation_tokens_total") == 23
    assert not metrics.flush(timeout_s=0.2)
    release.set()
    assert metrics.flush(timeout_s=10)
    assert set(callers) == {"inflightllm-metrics"}
    assert ttft.observations == [0.2, 0.2, 0.2]
    assert _value("inflightllm_request_finished_total", finish_reason="stop") == 2
    assert _value("inflightllm_request_finished_total", finish_reason="length") == 1
    assert _value("vllm:request_success_total", finished_reason="stop") == 2
    assert _Family.created["vllm:request_generation_tokens"].metrics[0].observations == [7, 2, 4]
    finished = _Family.created["inflightllm_request_finished_total"].metrics
    assert sum(metric.calls for metric in finished) == 2  # one increment a reason
    metrics.close()
    metrics.update(_stats(), [_finished(FinishReason.STOP, 1, 1)])  # after close (finalize): queued, never observed
    assert _value("inflightllm_request_finished_total", finish_reason="stop") == 2


def test_kv_pressure_counters_follow_the_stats():
    _Family.created = {}
    metrics = EngineMetrics(_PbUtils, model_name="engine")
    metrics.update(_stats(), [])
    metrics.update(_stats(num_preemptions_total=3, num_swapped_out_total=1, num_recomputed_tokens_total=40,
                          num_swapped_out_blocks_total=4, num_swapped_in_blocks_total=2,
                          swapped_out_bytes_total=4096, swapped_in_bytes_total=2048), [])
    metrics.update(_stats(num_preemptions_total=3, num_swapped_out_total=1, num_recomputed_tokens_total=50,
                          num_swapped_out_blocks_total=4, num_swapped_in_blocks_total=4,
                          swapped_out_bytes_total=4096, swapped_in_bytes_total=4096), [])
    assert _value("inflightllm_preemptions_total") == 3 and _value("inflightllm_swapped_out_total") == 1
    assert _value("inflightllm_recomputed_tokens_total") == 50
    assert _value("inflightllm_kv_swap_blocks_total", direction="out") == 4
    assert _value("inflightllm_kv_swap_blocks_total", direction="in") == 4
    assert _value("inflightllm_kv_swap_bytes_total", direction="out") == 4096
    assert _value("inflightllm_kv_swap_bytes_total", direction="in") == 4096

def test_host_kv_tier_series_follow_the_engine_stats():
    _Family.created = {}
    metrics = EngineMetrics(_PbUtils, model_name="engine")
    metrics.update(_stats(), [])  # tier off: zeros
    assert _value("inflightllm_host_kv_cache_blocks", state="total") == 0
    tier = dict(host_kv_blocks_total=64, host_kv_blocks_held=10, host_kv_offloaded_blocks_total=12,
                host_kv_onloaded_blocks_total=3, host_kv_bytes_per_block=1024, prefix_cache_host_hits=48)
    metrics.update(_stats(**tier), [])
    metrics.update(_stats(**{**tier, "host_kv_onloaded_blocks_total": 5, "prefix_cache_host_hits": 80}), [])
    assert _value("inflightllm_host_kv_cache_blocks", state="total") == 64
    assert _value("inflightllm_host_kv_cache_blocks", state="held") == 10
    assert _value("inflightllm_host_kv_offloaded_blocks_total") == 12
    assert _value("inflightllm_host_kv_onloaded_blocks_total") == 5
    assert _value("inflightllm_host_kv_offloaded_bytes_total") == 12 * 1024
    assert _value("inflightllm_host_kv_onloaded_bytes_total") == 5 * 1024
    assert _value("inflightllm_prefix_cache_host_hits_total") == 80


def _calls() -> int:
    return sum(metric.calls for family in _Family.created.values() for metric in family.metrics)


def test_a_step_that_changes_nothing_costs_no_metric_call_and_a_change_costs_one():
    _Family.created = {}
    metrics = EngineMetrics(_PbUtils, model_name="engine")
    metrics.update(_stats(), [])
    before = _calls()
    metrics.update(_stats(), [])
    assert _calls() == before
    metrics.update(_stats(num_waiting=0), [])
    # inflightllm_requests{state="waiting"} and vllm:num_requests_waiting
    assert _calls() == before + 2
    assert _value("inflightllm_requests", state="waiting") == 0 and _value("vllm:num_requests_waiting") == 0
    assert _value("inflightllm_requests", state="running") == 2
    metrics.update(_stats(num_waiting=0, num_blocks_used=30, num_blocks_free=70), [])
    assert _value("inflightllm_kv_cache_blocks", state="used") == 30
    assert _value("inflightllm_kv_cache_blocks", state="free") == 70
    assert _value("inflightllm_kv_cache_usage_ratio") == 0.3 and _value("vllm:kv_cache_usage_perc") == 0.3
    assert _value("inflightllm_kv_cache_blocks", state="total") == 100


@pytest.mark.server
def test_vllm_names_on_the_metrics_port(model_repo_server):
    from inflightllm.client import chat_messages, stream_generate

    def vllm_series() -> dict[str, float]:
        with urllib.request.urlopen(model_repo_server.metrics_url, timeout=5) as response:
            text = response.read().decode()
        return {name: float(value) for name, value in re.findall(r"^(vllm:[^ ]+) ([0-9.e+-]+)$", text, re.MULTILINE)}

    ttft_count = 'vllm:time_to_first_token_seconds_count{model="engine",model_name="engine"}'
    before = vllm_series()[ttft_count]
    stream_generate(model_repo_server.grpc_url, messages=chat_messages("Hi"), max_tokens=4)
    # The metrics are updated after the step that sent the last response: wait for it.
    assert wait_for(lambda: vllm_series()[ttft_count] == before + 1, timeout=30)
    series = vllm_series()
    assert series['vllm:num_requests_running{model="engine",model_name="engine"}'] == 0
    assert series['vllm:generation_tokens_total{model="engine",model_name="engine"}'] >= 1
    assert 'vllm:gpu_cache_usage_perc{model="engine",model_name="engine"}' in series
