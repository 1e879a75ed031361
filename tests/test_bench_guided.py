"""perf/bench_guided.py end to end on CPU: a tiny random model, a few requests; every run
generates exactly max_tokens per request (the bench fails otherwise), and the JSON it saves
holds the throughput ratios, compile times, queue waits and the burst figures."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("xgrammar")
pytest.importorskip("jsonschema")

from inflightllm.guided import json_schema_spec  # noqa: E402
from perf import bench_guided  # noqa: E402


def test_bench_guided_on_a_tiny_model(tmp_path, capsys):
    out = tmp_path / "guided.json"
    assert bench_guided.main([
        "--profile", "profiles/smollm2-random-cpu.yaml", "--shape", "tiny-llama3", "--requests", "4",
        "--isl", "16", "--osl", "8", "--schemas", "3", "--burst", "3", "--burst-background", "2",
        "--max-batch-size", "8", "--max-num-tokens", "256", "--mask-threads", "0,2", "--out", str(out),
    ]) == 0
    report = json.loads(out.read_text())
    runs = report["throughput"]
    assert [runs[name]["constrained"] for name in ("none", "half", "all", "half@2", "all@2")] == [0, 2, 4, 2, 4]
    assert (runs["all"]["mask_threads"], runs["all@2"]["mask_threads"]) == (0, 2)
    assert "ratio_to_none" in runs["all@2"] and report["mask_threads"] == [0, 2]
    assert all(runs[name]["output_tok_s"] > 0 for name in runs)
    host = runs["all@2"]["host_ms_per_step"]  # the engine's host time per step, by part
    assert host["steps"] > 0 and host["masks"] > 0 and host["advance"] > 0 and runs["none"]["host_ms_per_step"]["masks"] == 0
    assert runs["half"]["ratio_to_none"] == pytest.approx(runs["half"]["output_tok_s"] / runs["none"]["output_tok_s"],
                                                          abs=1e-3)
    compile_report = report["compile"]
    assert compile_report["new_schemas"] == 3
    assert 0 < compile_report["compile_ms"]["p50"] <= compile_report["compile_ms"]["max"]
    assert compile_report["first_token_ms_constrained"]["p50"] > 0
    burst = report["burst"]
    assert burst["no_schema"]["background_tok_s_per_request"] > 0
    assert burst["distinct_schemas"]["background_tok_s_per_request"] > 0
    assert report["vocabulary_load_s"] > 0 and report["schema_compile_ms"] > 0
    assert "the unconstrained throughput" in capsys.readouterr().out


def test_no_output_of_the_schema_completes_within_max_tokens():
    """Why every constrained request runs to max_tokens: the shortest valid output of the
    list schema is longer than osl tokens even if every token carried 16 characters."""
    import jsonschema

    schema = bench_guided.record_schema(128)
    assert schema["minItems"] == 33
    record = {"id": 0, "name": "", "kind": "beta", "score": 0, "tags": [], "active": True}
    shortest = json.dumps([record] * schema["minItems"], separators=(",", ":"))
    jsonschema.validate(json.loads(shortest), schema)
    assert len(shortest) > 16 * 128
    variants = {json_schema_spec(bench_guided.record_schema(16, v)) for v in range(5)}
    assert len(variants) == 5  # each variant is a new schema: a cold compile
