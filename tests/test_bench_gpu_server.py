"""perf/bench_gpu_server.py on CPU at tiny sizes: correctness only, nothing is timed.

The end-to-end run reuses the session's `model_repo_server` (the default profile) through
`--url`, so it starts no server of its own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from perf import bench_gpu_server, servers
from perf.bench_gpu_server import PromptMaker, Workload, check_records

REPO_ROOT = Path(__file__).resolve().parent.parent


def _record(index: int, ids: list[int], text: str, output_len: int, input_len: int = 8) -> dict:
    return {"index": index, "send": 0.0, "first_token": 0.1, "end": 0.2, "responses": len(ids), "token_ids": ids,
            "text": text, "num_output_tokens": output_len, "num_input_tokens": input_len, "finish_reason": "length",
            "error": None}


def test_checks_catch_a_lost_token_a_wrong_text_and_an_unfinished_request(smollm2_tokenizer):
    from inflightllm.detokenizer import decode_text

    workload = Workload(num_requests=4, input_len=8, output_len=5)
    ids = smollm2_tokenizer.encode(" the quick brown fox jumps", add_special_tokens=False)[:5]
    assert len(ids) == 5
    text = decode_text(smollm2_tokenizer, ids)
    good = _record(0, ids, text, 5)
    lost = _record(1, ids[:4], decode_text(smollm2_tokenizer, ids[:4]), 5)  # the server said 5, 4 arrived
    garbled = _record(2, ids, text[:-1], 5)
    unfinished = dict(_record(3, ids, text, 5), end=None, error="incomplete: the time limit passed")
    result = check_records([good, lost, garbled, unfinished], workload, smollm2_tokenizer)
    assert result["all_ok"] is False
    assert (result["completed"], result["tokens_exact"], result["text_equals_decoded_ids"]) == (3, 3, 3)
    assert result["num_failed_requests"] == 3
    assert [failure.split(":")[0] for failure in result["failures"]] == ["request 1", "request 2", "request 3"]
    assert check_records([good], workload, smollm2_tokenizer)["all_ok"] is True


def test_prompts_tokenize_to_the_exact_count_and_differ_by_seed(smollm2_tokenizer):
    maker = PromptMaker(smollm2_tokenizer, 12)
    first, second = maker.texts(3, seed=0), maker.texts(3, seed=1)
    assert [len(ids) for ids in maker.ids(first + second)] == [12] * 6
    assert maker.texts(3, seed=0) == first and set(first).isdisjoint(second)


def test_bundle_option_names_its_server_tokenizer_env_and_perf_analyzer(tmp_path):
    import argparse

    parser = argparse.ArgumentParser()
    servers.add_server_arguments(parser)
    (tmp_path / "venv-np1" / "bin").mkdir(parents=True)
    (tmp_path / "venv-np1" / "bin" / "activate").write_text("")
    options = servers.server_options(parser.parse_args(["--bundle", str(tmp_path)]))
    assert options.server_dir == tmp_path / "tritonserver"
    assert options.tokenizer_env == tmp_path / "venv-np1"
    assert options.perf_analyzer == tmp_path / "bin" / "perf_analyzer"
    default = servers.server_options(parser.parse_args([]))
    assert default.server_dir == REPO_ROOT / "build" / "tritonserver" and default.tokenizer_env is None
    with pytest.raises(SystemExit, match="not a venv"):
        servers.server_options(parser.parse_args(["--tokenizer-env", str(tmp_path)]))


@pytest.mark.server
@pytest.mark.slow
def test_one_run_measures_every_phase_and_every_token_arrives(model_repo_server, tmp_path, monkeypatch):
    """Engine-only, transformers, stream=false and stream=true (2 client processes) on the
    default profile: exit status 0, every token of every request delivered, the report's
    fields there; the plot is skipped without matplotlib and rendered later from the JSON."""
    from perf import plots

    monkeypatch.setattr(plots, "plt", None)  # as on a GPU host without matplotlib
    out = tmp_path / "run"
    status = bench_gpu_server.main([
        "--profile", str(REPO_ROOT / "profiles" / "smollm2-cpu.yaml"), "--url", model_repo_server.grpc_url,
        "--num-requests", "4", "--input-len", "8", "--output-len", "6", "--client-procs", "2", "--warmup", "1",
        "--transformers-batch", "2", "--max-seconds", "300", "--out", str(out)])
    assert status == 0
    assert sorted(p.name for p in out.iterdir()) == ["bench_gpu_server-smollm2-cpu.json", "bench_gpu_server-smollm2-cpu.md"]
    report = json.loads((out / "bench_gpu_server-smollm2-cpu.json").read_text())
    phases = report["phases"]
    assert set(phases) == {"engine", "transformers", "nostream", "stream"}
    assert phases["engine"]["output_tokens"] == 24 and phases["engine"]["checks"]["all_ok"]
    assert phases["transformers"]["batch"] == 2 and phases["transformers"]["output_tokens"] == 12
    for name, stream in (("nostream", False), ("stream", True)):
        phase = phases[name]
        assert phase["stream"] is stream
        assert (phase["completed"], phase["output_tokens"]) == (4, 24), phase
        checks = phase["checks"]
        assert checks["all_ok"], checks
        assert checks["tokens_exact"] == checks["num_output_tokens_exact"] == checks["text_equals_decoded_ids"] == 4
        assert checks["num_input_tokens_exact"] == 4
        assert phase["client"]["processes"] == 2 and phase["client"]["cpu_s"] >= 0
        assert phase["output_tokens_per_s"] > 0 and phase["ttft_ms"]["p50"] is not None
    assert phases["nostream"]["responses"] == 4  # one response with the whole output per request
    assert phases["stream"]["responses"] >= 4
    assert set(report["ratios"]) == {"nostream_over_engine", "stream_over_engine", "engine_over_transformers"}
    assert report["engine_parameters"]["max_batch_size"] == "64"
    assert report["workload"] == {"num_requests": 4, "input_len": 8, "output_len": 6, "seed": 0}
    table = (out / "bench_gpu_server-smollm2-cpu.md").read_text()
    assert "| (c) tritonserver, stream=true | 4/4 |" in table and "(c)/(a) stream=true" in table

    monkeypatch.undo()
    written = plots.render_from_json(out / "bench_gpu_server-smollm2-cpu.json", tmp_path / "later")
    assert sorted(p.name for p in written) == ["bench_gpu_server-smollm2-cpu-bars.png",
                                               "bench_gpu_server-smollm2-cpu.json", "bench_gpu_server-smollm2-cpu.md"]


@pytest.mark.server
def test_engine_placement_reads_each_instance_s_own_report(model_repo_server):
    """The benchmark records where each engine instance says it runs (the instance's
    `inflightllm_engine_gpu` gauge): on this CPU machine, every instance on the CPU."""
    placement = bench_gpu_server.engine_placement(model_repo_server.metrics_url)
    assert placement, "no engine instance reported its device"
    assert all(item["gpu"] == "cpu" and item["instance"].startswith("engine") for item in placement), placement
