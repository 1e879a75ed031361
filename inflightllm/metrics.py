"""Engine metrics on Triton's metrics port (Prometheus text at :8002/metrics).

The names are documented in docs/METRICS.md. `EngineMetrics` is created by the
`engine` model with `triton_python_backend_utils` (passed in, so this module imports
nothing from Triton) and updated by the engine loop after every step.
"""

from __future__ import annotations

from inflightllm.engine import EngineStats, RequestOutput

# Latency histogram buckets in seconds.
TTFT_BUCKETS = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]
TPOT_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5]
E2E_BUCKETS = [0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0]


class EngineMetrics:
    """Gauges, counters and histograms of one engine, exported through pb_utils."""

    def __init__(self, pb_utils, model_name: str = "engine"):
        family = pb_utils.MetricFamily
        labels = {"model": model_name}
        # A MetricFamily must outlive its Metrics (Triton refuses updates otherwise).
        self._families = []

        def make(name: str, description: str, kind):
            created = family(name=name, description=description, kind=kind)
            self._families.append(created)
            return created

        def gauge(name: str, description: str):
            return make(name, description, family.GAUGE)

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
        self.ttft = histogram("inflightllm_time_to_first_token_seconds", "Time to first token").Metric(
            labels=labels, buckets=TTFT_BUCKETS)
        self.tpot = histogram("inflightllm_time_per_output_token_seconds",
                              "Time per output token after the first").Metric(labels=labels, buckets=TPOT_BUCKETS)
        self.e2e = histogram("inflightllm_e2e_request_latency_seconds", "End-to-end request latency").Metric(
            labels=labels, buckets=E2E_BUCKETS)
        self._last: EngineStats | None = None

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
        last = self._last
        for metric, now, before in (
            (self.prefix_queries, stats.prefix_cache_queries, last.prefix_cache_queries if last else 0),
            (self.prefix_hits, stats.prefix_cache_hits, last.prefix_cache_hits if last else 0),
            (self.preemptions, stats.num_preemptions_total, last.num_preemptions_total if last else 0),
            (self.prompt_tokens, stats.prompt_tokens_total, last.prompt_tokens_total if last else 0),
            (self.generation_tokens, stats.generation_tokens_total, last.generation_tokens_total if last else 0),
            (self.steps, stats.num_steps_total, last.num_steps_total if last else 0),
            (self.swapped_out, stats.num_swapped_out_total, last.num_swapped_out_total if last else 0),
            (self.failed["timeout"], stats.num_timed_out_total, last.num_timed_out_total if last else 0),
            (self.failed["error"], stats.num_failed_total - stats.num_timed_out_total,
             last.num_failed_total - last.num_timed_out_total if last else 0),
            (self.failed["rejected"], stats.num_rejected_total, last.num_rejected_total if last else 0),
        ):
            if now > before:
                metric.increment(now - before)
        self._last = stats
        for output in outputs:
            if not output.finished:
                continue
            reason = output.finish_reason.text
            if reason in self.finished:
                self.finished[reason].increment(1)
            if output.time_to_first_token is not None:
                self.ttft.observe(output.time_to_first_token)
            if output.time_per_output_token is not None:
                self.tpot.observe(output.time_per_output_token)
            if output.e2e_latency is not None:
                self.e2e.observe(output.e2e_latency)
