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


def test_a_bad_row_is_named():
    with pytest.raises(SystemExit, match="--rows: '128x128' is not ISL/OSLxREQUESTS"):
        bench_rows.parse_rows("128/128x4,128x128")
