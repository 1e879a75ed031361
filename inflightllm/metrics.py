"""Engine metrics on Triton's metrics port (Prometheus text at :8002/metrics).

The names are documented in docs/METRICS.md. `EngineMetrics` is created by the
`engine` model with `triton_python_backend_utils` (passed in, so this module imports
nothing from Triton) and updated by the engine loop after every step.

Beside our `inflightllm_*` series, the same figures are exported under the vLLM names
that existing Grafana dashboards read (`vllm:num_requests_running`, ...; `VllmAliases`).

Every pb_utils metric call is an IPC round trip to the server (~18 us on an idle core,
~50 us beside a busy Python thread); a finished request costs ten of them (its finish
reason and eight latency and length histograms, ours and vLLM's). When 1,024 requests of a
batch finish within a few steps, that is ~0.2-0.5 s on the engine loop's thread. With
`background=True` (the engine model) those observations go to a thread of their own
(`FinishedObserver`), which makes the calls while the loop runs on (the calls release the
GIL while they wait); the stats-derived gauges and counters stay in step with the loop.
"""

from __future__ import annotations

import collections
import logging
import threading
from typing import NamedTuple

from inflightllm.engine import EngineStats, RequestOutput

logger = logging.getLogger(__name__)

# Latency histogram buckets in seconds.
TTFT_BUCKETS = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]
TPOT_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5]
E2E_BUCKETS = [0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0]


class ChangedGauge:
    """A pb_utils gauge that is set only when its value changes.

    Every `set` is an IPC round trip from the stub to the server; the engine loop updates
    its gauges after every step, when most of them have not moved (total blocks, the
    waiting queue of an idle server, ...). The scraped value is the same."""

    def __init__(self, metric):
        self.metric = metric
        self.value = None

    def set(self, value) -> None:
        if value != self.value:
            self.metric.set(value)
            self.value = value


class EngineMetrics:
    """Gauges, counters and histograms of one engine, exported through pb_utils."""

    def __init__(self, pb_utils, model_name: str = "engine", background: bool = False):
        family = pb_utils.MetricFamily
        labels = {"model": model_name}
        # A MetricFamily must outlive its Metrics (Triton refuses updates otherwise).
        self._families = []

        def make(name: str, description: str, kind):
            created = family(name=name, description=description, kind=kind)
            self._families.append(created)
            return created

        def gauge(name: str, description: str):
            return _ChangedGaugeFamily(make(name, description, family.GAUGE))

        def counter(name: str, description: str):
            return make(name, description, family.COUNTER)

        def histogram(name: str, description: str):
            return make(name, description, family.HISTOGRAM)

        blocks = gauge("inflightllm_kv_cache_blocks", "KV-cache blocks by state (total, used, free, cached)")
        self.blocks = {state: blocks.Metric(labels={**labels, "state": state})
                       for state in ("total", "used", "free", "cached")}
        self.kv_usage = gauge("inflightllm_kv_cache_usage_ratio", "Fraction of KV-cache blocks in use").Metric(
            labels=labels)
        self.hit_rate = gauge("inflightllm_prefix_cache_hit_rate",
                              "Prompt tokens served from the prefix cache / prompt tokens admitted").Metric(
            labels=labels)
        self.prefix_queries = counter("inflightllm_prefix_cache_queries_total",
                                      "Prompt tokens looked up in the prefix cache").Metric(labels=labels)
        self.prefix_hits = counter("inflightllm_prefix_cache_hits_total",
                                   "Prompt tokens found in the prefix cache").Metric(labels=labels)
        requests = gauge("inflightllm_requests", "Requests in the engine by state (running, waiting)")
        self.requests = {state: requests.Metric(labels={**labels, "state": state}) for state in ("running", "waiting")}
        self.preemptions = counter("inflightllm_preemptions_total",
                                   "Requests preempted (KV blocks freed, recomputed later)").Metric(labels=labels)
        self.step_tokens = gauge("inflightllm_step_tokens", "Tokens processed in the last engine step").Metric(
            labels=labels)
        self.prompt_tokens = counter("inflightllm_prompt_tokens_total", "Prompt tokens received").Metric(
            labels=labels)
        self.generation_tokens = counter("inflightllm_generation_tokens_total", "Tokens generated").Metric(
            labels=labels)
        self.steps = counter("inflightllm_engine_steps_total", "Engine steps run").Metric(labels=labels)
        finished = counter("inflightllm_request_finished_total", "Finished requests by finish reason")
        self.finished = {reason: finished.Metric(labels={**labels, "finish_reason": reason})
                         for reason in ("stop", "length", "cancelled")}
        failed = counter("inflightllm_request_failed_total",
                         "Requests that got an error of their own, by cause (error: sampling, stop handling or "
                         "their model step; timeout: waited too long; rejected: the queue was full)")
        self.failed = {cause: failed.Metric(labels={**labels, "cause": cause})
                       for cause in ("error", "timeout", "rejected")}
        self.swapped_out = counter("inflightllm_swapped_out_total",
                                   "Preemptions that moved a request's blocks to host memory").Metric(labels=labels)
        self.recomputed_tokens = counter(
            "inflightllm_recomputed_tokens_total",
            "Tokens computed again after preemptions (computed before, neither swapped back nor found in the "
            "prefix cache)").Metric(labels=labels)
        swap_blocks = counter("inflightllm_kv_swap_blocks_total",
                              "KV blocks copied to host memory (out) and back (in) by swap preemptions")
        swap_bytes = counter("inflightllm_kv_swap_bytes_total",
                             "Bytes of KV blocks copied to host memory (out) and back (in) by swap preemptions")
        self.swap_blocks = {direction: swap_blocks.Metric(labels={**labels, "direction": direction})
                            for direction in ("out", "in")}
        self.swap_bytes = {direction: swap_bytes.Metric(labels={**labels, "direction": direction})
                           for direction in ("out", "in")}
        self.shared_blocks = gauge("inflightllm_kv_cache_shared_blocks",
                                   "KV-cache blocks held by more than one sequence (the outputs of one request, "
                                   "prefix-cache hits)").Metric(labels=labels)
        self.cow_copies = counter("inflightllm_kv_cache_cow_copies_total",
                                  "Shared KV-cache blocks copied on a sequence's first write (copy-on-write)").Metric(
            labels=labels)
        # Host KV tier (engine.host_kv_cache_bytes; docs/HOST-KV-TIER.md): zeros when off.
        host_blocks = gauge("inflightllm_host_kv_cache_blocks", "Host KV tier blocks by state (total, held)")
        self.host_blocks = {state: host_blocks.Metric(labels={**labels, "state": state}) for state in ("total", "held")}
        self.host_offloaded = counter("inflightllm_host_kv_offloaded_blocks_total",
                                      "Evicted prefix-cache blocks copied to the host KV tier").Metric(labels=labels)
        self.host_onloaded = counter("inflightllm_host_kv_onloaded_blocks_total",
                                     "Host KV tier blocks copied back on a prefix hit").Metric(labels=labels)
        self.host_offloaded_bytes = counter("inflightllm_host_kv_offloaded_bytes_total",
                                            "Bytes copied to the host KV tier").Metric(labels=labels)
        self.host_onloaded_bytes = counter("inflightllm_host_kv_onloaded_bytes_total",
                                           "Bytes copied back from the host KV tier").Metric(labels=labels)
        self.prefix_host_hits = counter("inflightllm_prefix_cache_host_hits_total",
                                        "Prompt tokens found in the prefix cache whose blocks came back from the "
                                        "host KV tier").Metric(labels=labels)
        self.ttft = histogram("inflightllm_time_to_first_token_seconds", "Time to first token").Metric(
            labels=labels, buckets=TTFT_BUCKETS)
        self.tpot = histogram("inflightllm_time_per_output_token_seconds",
                              "Time per output token after the first").Metric(labels=labels, buckets=TPOT_BUCKETS)
        self.e2e = histogram("inflightllm_e2e_request_latency_seconds", "End-to-end request latency").Metric(
            labels=labels, buckets=E2E_BUCKETS)
        self._last: EngineStats | None = None
        self.vllm = VllmAliases(make, family, model_name)
        self._observer = FinishedObserver(self._observe_finished) if background else None

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every finished request handed over so far is observed (background)."""
        return self._observer.flush(timeout_s) if self._observer is not None else True

    def close(self, timeout_s: float = 10.0) -> None:
        """Observe what is queued, then stop the background thread."""
        if self._observer is not None:
            self._observer.close(timeout_s)

    def update(self, stats: EngineStats, outputs: list[RequestOutput]) -> None:
        """Set gauges, add counter deltas, observe finished requests' latencies."""
        self.blocks["total"].set(stats.num_blocks_total)
        self.blocks["used"].set(stats.num_blocks_used)
        self.blocks["free"].set(stats.num_blocks_free)
        self.blocks["cached"].set(stats.num_blocks_cached)
        self.kv_usage.set(stats.kv_usage)
        self.hit_rate.set(stats.prefix_cache_hit_rate)
        self.requests["running"].set(stats.num_running)
        self.requests["waiting"].set(stats.num_waiting)
        self.step_tokens.set(stats.num_tokens_last_step)
        self.shared_blocks.set(stats.num_shared_blocks)
        self.host_blocks["total"].set(stats.host_kv_blocks_total)
        self.host_blocks["held"].set(stats.host_kv_blocks_held)
        last = self._last
        for metric, now, before in (
            (self.prefix_queries, stats.prefix_cache_queries, last.prefix_cache_queries if last else 0),
            (self.prefix_hits, stats.prefix_cache_hits, last.prefix_cache_hits if last else 0),
            (self.preemptions, stats.num_preemptions_total, last.num_preemptions_total if last else 0),
            (self.prompt_tokens, stats.prompt_tokens_total, last.prompt_tokens_total if last else 0),
            (self.generation_tokens, stats.generation_tokens_total, last.generation_tokens_total if last else 0),
            (self.steps, stats.num_steps_total, last.num_steps_total if last else 0),
            (self.swapped_out, stats.num_swapped_out_total, last.num_swapped_out_total if last else 0),
            (self.cow_copies, stats.num_cow_copies_total, last.num_cow_copies_total if last else 0),
            (self.recomputed_tokens, stats.num_recomputed_tokens_total, last.num_recomputed_tokens_total if last else 0),
            (self.swap_blocks["out"], stats.num_swapped_out_blocks_total,
             last.num_swapped_out_blocks_total if last else 0),
            (self.swap_blocks["in"], stats.num_swapped_in_blocks_total, last.num_swapped_in_blocks_total if last else 0),
            (self.swap_bytes["out"], stats.swapped_out_bytes_total, last.swapped_out_bytes_total if last else 0),
            (self.swap_bytes["in"], stats.swapped_in_bytes_total, last.swapped_in_bytes_total if last else 0),
            (self.host_offloaded, stats.host_kv_offloaded_blocks_total,
             last.host_kv_offloaded_blocks_total if last else 0),
            (self.host_onloaded, stats.host_kv_onloaded_blocks_total, last.host_kv_onloaded_blocks_total if last else 0),
            (self.host_offloaded_bytes, stats.host_kv_offloaded_bytes_total,
             last.host_kv_offloaded_bytes_total if last else 0),
            (self.host_onloaded_bytes, stats.host_kv_onloaded_bytes_total,
             last.host_kv_onloaded_bytes_total if last else 0),
            (self.prefix_host_hits, stats.prefix_cache_host_hits, last.prefix_cache_host_hits if last else 0),
            (self.failed["timeout"], stats.num_timed_out_total, last.num_timed_out_total if last else 0),
            (self.failed["error"], stats.num_failed_total - stats.num_timed_out_total,
             last.num_failed_total - last.num_timed_out_total if last else 0),
            (self.failed["rejected"], stats.num_rejected_total, last.num_rejected_total if last else 0),
        ):
            if now > before:
                metric.increment(now - before)
        self.vllm.update(stats, last)
        self._last = stats
        # Only finished outputs are observed: with stream=true a step has one output per
        # streaming request, few of them final. Filtered once for both sets of series.
        if not outputs:
            return
        finished = [Finished.of(output) for output in outputs if output.finished]
        if not finished:
            return
        if self._observer is not None:
            self._observer.put(finished)
        else:
            self._observe_finished(finished)

    def _observe_finished(self, finished: list[Finished]) -> None:
        """Finish reasons (one increment a reason) and the latency and length histograms."""
        reasons = collections.Counter(item.reason for item in finished)
        observe_finished(finished, reasons, self.finished, self.ttft, self.tpot, self.e2e)
        self.vllm.observe_finished(finished, reasons)


class Finished(NamedTuple):
    """What the metrics keep of a finished request's last output."""

    reason: str
    ttft: float | None
    tpot: float | None
    e2e: float | None
    prompt_tokens: int
    output_tokens: int

    @classmethod
    def of(cls, output: RequestOutput) -> Finished:
        return cls(output.finish_reason.text, output.time_to_first_token, output.time_per_output_token,
                   output.e2e_latency, output.num_prompt_tokens, output.num_output_tokens)


def observe_finished(finished: list[Finished], reasons: collections.Counter, by_reason: dict, ttft, tpot,
                     e2e) -> None:
    """One increment a finish reason (its counter in `by_reason`), then each request's
    latencies into the three histograms."""
    for reason, count in reasons.items():
        if reason in by_reason:
            by_reason[reason].increment(count)
    for item in finished:
        if item.ttft is not None:
            ttft.observe(item.ttft)
        if item.tpot is not None:
            tpot.observe(item.tpot)
        if item.e2e is not None:
            e2e.observe(item.e2e)


class FinishedObserver:
    """A daemon thread that hands queued finished requests to `observe` in order."""

    def __init__(self, observe):
        self._observe = observe
        self._queue: collections.deque[list[Finished]] = collections.deque()
        self._cond = threading.Condition()
        self._busy = False
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="inflightllm-metrics", daemon=True)
        self._thread.start()

    def put(self, finished: list[Finished]) -> None:
        with self._cond:
            self._queue.append(finished)
            self._cond.notify_all()

    def flush(self, timeout_s: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._busy, timeout_s)

    def close(self, timeout_s: float) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closing)
                if not self._queue:  # closing, nothing left
                    return
                batch = [item for finished in self._queue for item in finished]
                self._queue.clear()
                self._busy = True
            try:
                self._observe(batch)
            except Exception:  # a metrics failure must not end the thread (nor the serving)
                logger.exception("observing %d finished requests failed", len(batch))
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()


class _ChangedGaugeFamily:
    """A gauge MetricFamily whose Metrics are `ChangedGauge`s."""

    def __init__(self, family):
        self.family = family

    def Metric(self, labels):  # noqa: N802 (pb_utils' name)
        return ChangedGauge(self.family.Metric(labels=labels))


# Token-count histogram buckets (vLLM's 1-2-5 series).
TOKEN_BUCKETS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000]
# vLLM's finished_reason label values for ours ("cancelled" is vLLM's "abort").
VLLM_FINISHED_REASONS = {"stop": "stop", "length": "length", "cancelled": "abort"}


class VllmAliases:
    """The figures of EngineMetrics under vLLM's metric names (docs/METRICS.md).

    Labels: `model` (as Triton's vLLM backend) and `model_name` (as vLLM's own server),
    both the Triton model name, so dashboards written for either find the series.
    """

    def __init__(self, make, kinds, model_name: str):
        """`make(name, description, kind)` creates a MetricFamily; `kinds` has the
        GAUGE, COUNTER and HISTOGRAM kinds (pb_utils.MetricFamily)."""
        labels = {"model": model_name, "model_name": model_name}
        self._make = make
        self._kinds = kinds
        self.running = self._gauge("vllm:num_requests_running", "Requests running (inflightllm_requests running)", labels)
        self.waiting = self._gauge("vllm:num_requests_waiting", "Requests waiting (inflightllm_requests waiting)", labels)
        self.gpu_cache_usage = self._gauge("vllm:gpu_cache_usage_perc",
                                           "KV-cache usage, 0 to 1 (inflightllm_kv_cache_usage_ratio)", labels)
        self.kv_cache_usage = self._gauge("vllm:kv_cache_usage_perc",
                                          "KV-cache usage, 0 to 1 (inflightllm_kv_cache_usage_ratio)", labels)
        self.prompt_tokens = self._counter("vllm:prompt_tokens_total", "Prompt tokens received", labels)
        self.generation_tokens = self._counter("vllm:generation_tokens_total", "Tokens generated", labels)
        self.preemptions = self._counter("vllm:num_preemptions_total", "Requests preempted", labels)
        self.prefix_queries = self._counter("vllm:prefix_cache_queries_total",
                                            "Prompt tokens looked up in the prefix cache", labels)
        self.prefix_hits = self._counter("vllm:prefix_cache_hits_total",
                                         "Prompt tokens found in the prefix cache", labels)
        success = make("vllm:request_success_total", "Finished requests by finished_reason", kinds.COUNTER)
        self.success = {ours: success.Metric(labels={**labels, "finished_reason": theirs})
                        for ours, theirs in VLLM_FINISHED_REASONS.items()}
        self.ttft = self._histogram("vllm:time_to_first_token_seconds", "Time to first token", labels, TTFT_BUCKETS)
        self.tpot = self._histogram("vllm:time_per_output_token_seconds", "Time per output token after the first",
                                    labels, TPOT_BUCKETS)
        self.e2e = self._histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency", labels,
                                   E2E_BUCKETS)
        self.request_prompt_tokens = self._histogram(
            "vllm:request_prompt_tokens", "Prompt tokens per finished request", labels, TOKEN_BUCKETS)
        self.request_generation_tokens = self._histogram(
            "vllm:request_generation_tokens", "Generated tokens per finished request", labels, TOKEN_BUCKETS)

    def _gauge(self, name, description, labels):
        return ChangedGauge(self._make(name, description, self._kinds.GAUGE).Metric(labels=labels))

    def _counter(self, name, description, labels):
        return self._make(name, description, self._kinds.COUNTER).Metric(labels=labels)

    def _histogram(self, name, description, labels, buckets):
        return self._make(name, description, self._kinds.HISTOGRAM).Metric(labels=labels, buckets=buckets)

    def update(self, stats: EngineStats, last: EngineStats | None) -> None:
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.gpu_cache_usage.set(stats.kv_usage)
        self.kv_cache_usage.set(stats.kv_usage)
        for metric, now, before in (
            (self.prompt_tokens, stats.prompt_tokens_total, last.prompt_tokens_total if last else 0),
            (self.generation_tokens, stats.generation_tokens_total, last.generation_tokens_total if last else 0),
            (self.preemptions, stats.num_preemptions_total, last.num_preemptions_total if last else 0),
            (self.prefix_queries, stats.prefix_cache_queries, last.prefix_cache_queries if last else 0),
            (self.prefix_hits, stats.prefix_cache_hits, last.prefix_cache_hits if last else 0),
        ):
            if now > before:
                metric.increment(now - before)

    def observe_finished(self, finished: list[Finished], reasons: collections.Counter) -> None:
        observe_finished(finished, reasons, self.success, self.ttft, self.tpot, self.e2e)
        for item in finished:
            self.request_prompt_tokens.observe(item.prompt_tokens)
            self.request_generation_tokens.observe(item.output_tokens)
