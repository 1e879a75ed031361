"""The benchmark harness (perf/): workloads, summaries, variant servers, and a tiny run of the
load generator against the real server. Figures are never asserted, only counts and shapes."""

from __future__ import annotations

import asyncio
import json

import pytest

from perf import loadgen, servers
from perf.loadgen import SLO, Load, RequestRecord, parse_metrics, summarize
from perf.workloads import ExactPrompts, WorkloadSpec, build_requests


def test_exact_prompts_have_the_requested_token_count(smollm2_tokenizer):
    prompts = ExactPrompts(smollm2_tokenizer, seed=3)
    for num_tokens in (1, 8, 100):
        text = prompts.make(num_tokens)
        assert len(smollm2_tokenizer.encode(text, add_special_tokens=False)) == num_tokens
    prefix = prompts.make(40)
    text = prompts.make(56, lead=prefix)
    assert text.startswith(prefix)
    ids = smollm2_tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) == 56
    assert ids[:40] == smollm2_tokenizer.encode(prefix, add_special_tokens=False)  # the prefix tokenizes alike


def test_workloads(smollm2_tokenizer):
    mixed = build_requests(WorkloadSpec("mixed", num_requests=20, input_len=8, short_len=5, long_len=50,
                                        long_every=10), smollm2_tokenizer)
    assert [r.label for r in mixed].count("long") == 2
    assert [i for i, r in enumerate(mixed) if r.label == "long"] == [5, 15]
    assert {(r.inputs["max_tokens"], r.inputs["min_tokens"]) for r in mixed} == {(5, 5), (50, 50)}

    shared = build_requests(WorkloadSpec("shared-prefix", num_requests=4, input_len=4, prefix_len=32,
                                         num_prefixes=2, output_len=2), smollm2_tokenizer)
    assert [r.label for r in shared] == ["prefix 0", "prefix 1", "prefix 0", "prefix 1"]
    first, third = (smollm2_tokenizer.encode(shared[i].inputs["text_input"], add_special_tokens=False)
                    for i in (0, 2))
    assert len(first) == len(third) == 36 and first[:32] == third[:32] and first != third

    priorities = build_requests(WorkloadSpec("priorities", num_requests=30, input_len=4, output_len=2,
                                             priority_levels=3), smollm2_tokenizer)
    assert {r.inputs["priority"] for r in priorities} == {0, 1, 2}
    assert all(r.label == f"priority {r.inputs['priority']}" for r in priorities)

    chat = build_requests(WorkloadSpec("chat", num_requests=3, output_len=7), smollm2_tokenizer)
    assert all(r.inputs["messages"][0]["role"] == "user" and r.inputs["max_tokens"] == 7 for r in chat)
    # Same seed, same requests.
    again = build_requests(WorkloadSpec("mixed", num_requests=20, input_len=8, short_len=5, long_len=50,
                                        long_every=10), smollm2_tokenizer)
    assert [r.inputs for r in again] == [r.inputs for r in mixed]
    with pytest.raises(ValueError, match="unknown workload"):
        build_requests(WorkloadSpec("bursty"), smollm2_tokenizer)


def _record(index, ttft, gaps, label="fixed", tokens=None):
    times = [ttft]
    for gap in gaps:
        times.append(times[-1] + gap)
    return RequestRecord(index, label, token_times=times, token_counts=[1] * len(times), end_time=times[-1],
                         num_input_tokens=10, num_cached_tokens=0, num_output_tokens=tokens or len(times),
                         finish_reason="length", completed=True)


def test_summary_figures_follow_the_definitions():
    records = [_record(0, 0.1, [0.05, 0.05, 0.05]), _record(1, 0.3, [0.1, 0.1, 0.1]),
               RequestRecord(2, "fixed", error="incomplete: the point's time limit passed")]
    summary = summarize(records, duration_s=2.0, slo=SLO(ttft_ms=200, tpot_ms=60))
    assert (summary["sent"], summary["completed"], summary["incomplete"], summary["failed"]) == (3, 2, 1, 0)
    assert summary["requests_per_s"] == 1.0
    assert summary["output_tokens"] == 8 and summary["output_tokens_per_s"] == 4.0
    assert summary["ttft_ms"]["mean"] == 200.0
    assert summary["tpot_ms"]["p50"] == 75.0  # (e2e - ttft) / (tokens - 1): 50 and 100 ms
    assert summary["itl_ms"]["p50"] == 75.0  # six gaps: three of 50 ms, three of 100 ms
    assert summary["e2e_ms"]["p50"] == pytest.approx(425.0)
    assert summary["good_requests"] == 1 and summary["goodput_requests_per_s"] == 0.5
    assert summary["slo"] == "TTFT <= 200 ms and TPOT <= 60 ms"


def test_metrics_parsing_and_deltas():
    text = "\n".join([
        "# HELP inflightllm_kv_cache_usage_ratio used / total blocks",
        'inflightllm_kv_cache_usage_ratio{model="engine"} 0.25',
        'inflightllm_requests{model="engine",state="running"} 3',
        'inflightllm_time_to_first_token_seconds_bucket{model="engine",le="0.1"} 4',
        'inflightllm_prefix_cache_queries_total{model="engine"} 100',
        'inflightllm_prefix_cache_hits_total{model="engine"} 40',
        'nv_inference_count{model="engine",version="1"} 7',
    ])
    values = parse_metrics(text)
    assert values == {"inflightllm_kv_cache_usage_ratio": 0.25, "inflightllm_requests{state=running}": 3.0,
                      "inflightllm_prefix_cache_queries_total": 100.0, "inflightllm_prefix_cache_hits_total": 40.0}
    after = dict(values, inflightllm_prefix_cache_queries_total=300.0, inflightllm_prefix_cache_hits_total=190.0)
    assert loadgen.engine_deltas(values, after)["prefix_cache_hit_rate"] == 0.75


def test_variant_profile_and_dynamic_batching_switch(tmp_path):
    from inflightllm.profile import DEFAULT_PROFILE, load_profile
    from tools import render_configs

    path = servers.variant_profile(DEFAULT_PROFILE, servers.parse_overrides(
        ["engine.batching_strategy=static", "engine.enable_kv_cache_reuse=false"]), suffix="test")
    profile = load_profile(path)
    assert profile.name == "smollm2-cpu-test"
    assert profile.engine.batching_strategy == "static" and profile.engine.enable_kv_cache_reuse is False
    assert servers.variant_profile(DEFAULT_PROFILE, {}, suffix="x") == DEFAULT_PROFILE
    with pytest.raises(ValueError, match="KEY=VALUE"):
        servers.parse_overrides(["engine.batching_strategy"])

    render_configs.render(load_profile(DEFAULT_PROFILE), tmp_path)
    config = tmp_path / "preprocessing" / "config.pbtxt"
    before = config.read_text()
    assert "dynamic_batching {" in before
    servers.disable_preprocessing_dynamic_batching(tmp_path)
    after = config.read_text()
    assert "dynamic_batching" not in after and "instance_group [" in after and "max_batch_size: 64" in after
    with pytest.raises(RuntimeError, match="expected one dynamic_batching block"):
        servers.disable_preprocessing_dynamic_batching(tmp_path)


@pytest.mark.server
@pytest.mark.slow
def test_loadgen_smoke_run_against_the_server(model_repo_server, smollm2_tokenizer, tmp_path):
    """Three tiny fixed-length requests at concurrency 2 and all at once, then two chat
    requests: every request completes with its exact token counts, and the outputs exist."""
    server = model_repo_server
    spec = WorkloadSpec("fixed", num_requests=3, input_len=8, output_len=3)
    # The limit only keeps a stuck server from hanging the suite; nothing is timed.
    series = loadgen.run_series("smoke", server.grpc_url, server.metrics_url, spec,
                                [Load("concurrency", 2), Load("rate", float("inf"))], smollm2_tokenizer,
                                max_seconds=300, slo=SLO(ttft_ms=60_000), warmup=1, progress=False)
    for point in series["points"]:
        assert point["summary"]["completed"] == 3, point["summary"]
        for request in point["requests"]:
            assert (request["num_input_tokens"], request["num_output_tokens"]) == (8, 3)
            assert sum(request["token_counts"]) == 3 and request["finish_reason"] == "length"
        assert point["kv_samples"] and "kv_cache_usage" in point["kv_samples"][0]
        assert point["engine"]["generation_tokens"] >= 9
    chat = loadgen.run_series("chat", server.grpc_url, None, WorkloadSpec("chat", num_requests=2, output_len=4),
                              [Load("concurrency", 2)], smollm2_tokenizer, max_seconds=300, warmup=0,
                              progress=False)
    assert chat["points"][0]["summary"]["completed"] == 2
    assert all(1 <= r["num_output_tokens"] <= 4 for r in chat["points"][0]["requests"])

    result = {"title": "smoke", "meta": loadgen.run_metadata("pytest"), "workload": {},
              "workload_text": spec.describe(), "slo": "TTFT <= 60000 ms", "series": [series, chat]}
    written = loadgen.write_result(result, tmp_path / "smoke")
    assert [p.name for p in written] == ["smoke.json", "smoke.md", "smoke-latency.png", "smoke-distributions.png",
                                         "smoke-kv-cache.png"]
    assert json.loads(written[0].read_text())["series"][0]["name"] == "smoke"
    table = written[1].read_text()
    assert "| smoke | concurrency 2 | 3/3 |" in table and "| smoke | rate inf | 3/3 |" in table


@pytest.mark.server
@pytest.mark.slow
def test_preprocessing_unary_point(model_repo_server):
    from perf.experiments import unary_point

    row = asyncio.run(unary_point(model_repo_server.grpc_url, "preprocessing", concurrency=2, num_requests=4,
                                  max_seconds=300))
    assert (row["completed"], row["errors"]) == (4, 0)
    assert row["avg_batch"] >= 1
