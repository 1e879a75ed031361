"""perf/bench_rows.py end to end on CPU: a tiny random model, small rows, bf16 and fp8
variants of one profile in one run; the JSON it saves."""

from __future__ import annotations

import json

import pytest
import yaml

from perf import bench_rows

PROFILE = {
    "name": "tiny-rows",
    "model": {"source": "random", "shape": "tiny-llama3", "dtype": "bfloat16"},
    "device": {"kind": "cpu"},
    "engine": {"max_input_length": 64, "max_output_len": 32, "kv_cache_bytes": 8 * 1024 * 1024},
}


def test_rows_for_two_variants(tmp_path, capsys):
    profile = tmp_path / "tiny.yaml"
    profile.write_text(yaml.safe_dump(PROFILE))
    out = tmp_path / "rows.json"
    assert bench_rows.main(["--profile", str(profile), "--rows", "16/8x4,128/4x2", "--variants", "bf16,fp8",
                            "--max-batch-size", "4", "--max-num-tokens", "256", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["variants"]) == {"bf16", "fp8"}
    fp8 = report["variants"]["fp8"]
    assert (fp8["quantization"], fp8["kv_cache_dtype"]) == ("fp8", "fp8")
    assert fp8["kv_blocks"] == 2 * report["variants"]["bf16"]["kv_blocks"]  # FP8 KV: twice the blocks
    rows = fp8["rows"]
    assert [(r["isl"], r["osl"], r["requests"]) for r in rows] == [(16, 8, 4), (128, 4, 2)]
    assert all(r["output_tok_s"] > 0 and r["steps"] >= r["osl"] for r in rows)
    assert "16/8" in capsys.readouterr().out


def test_trtllm_settings_follow_trtllm_bench():
    # The H200's FP8 cache (1,852,544 tokens) on the four rows: 7,236 / 851 / 851 / 452 requests fit.
    kv = 1852544
    assert bench_rows.trtllm_settings(kv, 128, 128) == (4096, 8192)
    assert bench_rows.trtllm_settings(kv, 2048, 128) == (896, 15360)
    assert bench_rows.trtllm_settings(kv, 128, 2048) == (896, 2048)
    assert bench_rows.trtllm_settings(kv, 2048, 2048) == (512, 2048)
    assert bench_rows.trtllm_settings(1000, 16, 8) == (64, 2048)  # the floors
    assert bench_rows.trtllm_settings(10**9, 16, 16) == (4096, 8192)  # 4,096 requests at most
    assert bench_rows.trtllm_settings(10**9, 30000, 10) == (4096, 32768)  # 32,768 tokens at most


def test_rows_at_trtllm_settings_within_the_built_limits(tmp_path, capsys):
    profile = tmp_path / "tiny.yaml"
    profile.write_text(yaml.safe_dump(PROFILE))
    out = tmp_path / "rows.json"
    assert bench_rows.main(["--profile", str(profile), "--rows", "16/8x6,48/16x3", "--variants", "bf16",
                            "--settings", "trtllm", "--max-batch-size", "512", "--max-num-tokens", "4096",
                            "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["settings"] == "trtllm"
    entry = report["variants"]["bf16"]
    kv_tokens = entry["kv_blocks"] * entry["block_size"]
    for row in entry["rows"]:
        batch, budget = bench_rows.trtllm_settings(kv_tokens, row["isl"], row["osl"])
        assert row["max_batch_size"] == min(batch, 512)
        assert row["max_num_tokens"] == max(row["max_batch_size"], min(budget, 4096))
        assert row["output_tok_s"] > 0
    # 16,384 cache tokens: 682 requests of 24 tokens (768, over the built 512), 256 of 64
    assert kv_tokens == 16384
    assert [row["max_batch_size"] for row in entry["rows"]] == [512, 256]
    assert "max batch" in capsys.readouterr().out


def test_a_bad_row_is_named():
    with pytest.raises(SystemExit, match="--rows: '128x128' is not ISL/OSLxREQUESTS .* or one of trtllm"):
        bench_rows.parse_rows("128/128x4,128x128")


def test_trtllm_rows_are_the_published_rows_at_its_own_counts():
    rows = bench_rows.parse_rows("trtllm")
    assert rows == [(128, 128, 30000), (2048, 128, 3000), (128, 2048, 3000), (2048, 2048, 1500)]
    assert {(isl, osl) for isl, osl, _ in rows} == set(bench_rows.PUBLISHED)
    assert [(isl, osl) for isl, osl, _ in rows] == [(isl, osl) for isl, osl, _ in bench_rows.parse_rows(bench_rows.ROWS)]


def test_capacity_policies_and_preemption_modes_in_one_run(tmp_path, capsys):
    # 12 blocks of 16 tokens (512 bytes a token in bf16): 6 requests of 16 + 24 tokens need
    # 18 blocks at their end, so max_utilization preempts and guaranteed_no_evict holds back.
    data = PROFILE | {"engine": {**PROFILE["engine"], "kv_cache_bytes": 12 * 16 * 512}}
    profile = tmp_path / "tiny.yaml"
    profile.write_text(yaml.safe_dump(data))
    out = tmp_path / "pressure.json"
    assert bench_rows.main(["--profile", str(profile), "--rows", "16/24x6", "--max-batch-size", "8",
                            "--max-num-tokens", "256", "--capacity-policy", "max_utilization,GUARANTEED_NO_EVICT",
                            "--preemption-mode", "recompute,swap", "--kv-watermark", "0", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["variants"]) == {f"profile/{policy}/{mode}/0.0" for policy in ("max_utilization",
                                       "guaranteed_no_evict") for mode in ("recompute", "swap")}
    for name, entry in report["variants"].items():
        assert entry["kv_blocks"] == 12 and entry["kv_watermark"] == 0.0
        assert entry["capacity_policy"] in name and entry["preemption_mode"] in name
        assert entry["host_link_gb_s"] > 0
        [row] = entry["rows"]
        assert row["sampling"] == "greedy" and row["swapped_in_blocks"] == row["swapped_out_blocks"]
        if entry["capacity_policy"] == "guaranteed_no_evict":
            assert row["preemptions"] == row["recomputed_tokens"] == row["swapped_out_blocks"] == 0
        elif entry["preemption_mode"] == "recompute":
            assert row["preemptions"] > 0 and row["recomputed_tokens"] > 0 and row["swapped_out_blocks"] == 0
            assert row["recomputed_pct_of_generated"] == round(100 * row["recomputed_tokens"] / (6 * 24), 2)
        else:  # swap: full blocks come back, partial ones are computed again
            assert row["swap_preemptions"] == row["preemptions"] > 0 and row["swapped_out_blocks"] > 0
            # tiny-llama3: 2 layers x (K, V) x 16 tokens x 2 KV heads x 32 x 2 bytes a block
            assert row["swapped_out_bytes"] == row["swapped_out_blocks"] * 2 * 2 * 16 * 2 * 32 * 2
    assert "guaranteed_no_evict" in capsys.readouterr().out


def test_samplings_in_one_run_with_their_ratio_to_greedy(tmp_path, capsys):
    profile = tmp_path / "tiny.yaml"
    profile.write_text(yaml.safe_dump(PROFILE))
    out = tmp_path / "sampling.json"
    assert bench_rows.main(["--profile", str(profile), "--rows", "16/4x2", "--max-batch-size", "4",
                            "--max-num-tokens", "256", "--sampling", "sampled-penalty,greedy,sampled",
                            "--out", str(out)]) == 0
    [entry] = json.loads(out.read_text())["variants"].values()
    rows = entry["rows"]
    assert [row["sampling"] for row in rows] == ["greedy", "sampled", "sampled-penalty"]  # greedy first
    assert "ratio_to_greedy" not in rows[0]
    for row in rows[1:]:
        assert row["ratio_to_greedy"] == round(row["output_tok_s"] / rows[0]["output_tok_s"], 3)
    assert "x greedy" in capsys.readouterr().out


def test_bad_kv_pressure_options_are_named():
    with pytest.raises(SystemExit, match="--capacity-policy: 'static' is not allowed; allowed: max_utilization, "
                                         "guaranteed_no_evict"):
        bench_rows.parse_list("max_utilization,static", "--capacity-policy", ("max_utilization", "guaranteed_no_evict"))
    with pytest.raises(SystemExit, match="--sampling: 'beam' is not allowed; allowed: greedy, sampled, sampled-penalty"):
        bench_rows.parse_list("greedy,beam", "--sampling", tuple(bench_rows.SAMPLINGS))
    with pytest.raises(SystemExit, match="--kv-watermark: 'lots' is not allowed; allowed: numbers"):
        bench_rows.parse_list("0.01,lots", "--kv-watermark", kind=float)


def test_profile_steps_windows(tmp_path, capsys):
    """--profile-steps: each greedy row again (its own prompts), with a profiled window of N
    steps at its start and one from the middle of the steps the timed run took; on CPU the
    profile has no GPU kernels, but the windows, their steps and tokens a step are real."""
    profile = tmp_path / "tiny.yaml"
    profile.write_text(yaml.safe_dump(PROFILE))
    out = tmp_path / "profiled.json"
    assert bench_rows.main(["--profile", str(profile), "--rows", "16/12x4", "--max-batch-size", "4",
                            "--max-num-tokens", "256", "--profile-steps", "3", "--out", str(out)]) == 0
    [row] = json.loads(out.read_text())["variants"]["profile"]["rows"]
    assert row["steps"] >= 12
    windows = row["profile"]
    assert set(windows) == {"first steps", "middle steps"}
    first, middle = windows["first steps"], windows["middle steps"]
    assert first["steps"] == middle["steps"] == 3
    assert first["tokens_per_step"] > middle["tokens_per_step"] == 4.0  # prefill first; 4 decodes a step later
    assert first["wall_s"] > 0 and first["gpu_busy_s"] == 0.0 and first["kinds_s"] == {}
    assert set(first["host_ms_per_step"]) >= {"schedule", "launch", "wait", "emit"}
    assert "middle steps (6..8)" in capsys.readouterr().out
