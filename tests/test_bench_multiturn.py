"""perf/bench_multiturn.py end to end on CPU at toy size: a tiny random model, a few
conversations through a GPU-sized-down cache, with and without the host KV tier; the JSON
it saves (no figure is checked against a time)."""

from __future__ import annotations

import json

import pytest

from perf import bench_multiturn


def test_multiturn_with_and_without_the_host_tier(tmp_path, capsys):
    out = tmp_path / "multiturn.json"
    assert bench_multiturn.main([
        "--shape", "tiny-llama3", "--dtype", "float32", "--device", "cpu", "--conversations", "4", "--turns", "3",
        "--system-tokens", "16", "--user-tokens", "24", "--output-tokens", "4", "--concurrency", "2",
        "--max-num-tokens", "256", "--out", str(out),
    ]) == 0
    report = json.loads(out.read_text())
    # 4 conversations of 16 + 3 x (24 + 4) = 100 tokens: 7 blocks of 16 each.
    assert report["working_set_blocks"] == 28 and report["gpu_kv_blocks"] == 10 and report["host_kv_blocks"] == 28
    without, with_tier = report["without_host_tier"], report["with_host_tier"]
    assert without["requests"] == with_tier["requests"] == 12
    assert without["prefix_hit_tokens_host"] == 0 and without["host_onloaded_blocks"] == 0
    assert with_tier["prefix_hit_tokens_host"] > 0 and with_tier["host_onloaded_blocks"] > 0
    assert with_tier["host_onloaded_bytes"] == with_tier["host_onloaded_blocks"] * report["bytes_per_block"]
    assert with_tier["prefix_hit_tokens"] > without["prefix_hit_tokens"]
    assert report["greedy_outputs_equal"] is True
    assert report["ttft_p50_ratio"] == pytest.approx(with_tier["ttft_p50_ms"] / without["ttft_p50_ms"], abs=1e-3)
    assert "TTFT p50 with / without" in capsys.readouterr().out


def test_bad_sizes_are_refused():
    with pytest.raises(SystemExit, match="--gpu-cache-fraction 1.5: allowed greater than 0 and at most 1"):
        bench_multiturn.main(["--shape", "tiny-llama3", "--device", "cpu", "--gpu-cache-fraction", "1.5"])
