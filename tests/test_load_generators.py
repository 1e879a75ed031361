"""genai-perf 0.0.16 (four request formats) and AIPerf, the real packages in their own
venvs (`make test` builds them), against the real server: each completes a short profile
and reports the time to first token and the inter-token latency. Figures are not asserted.

The drivers are `perf/genai_perf_profiles.py` and `perf/aiperf_profiles.py` (what
`make genai-perf` and `make aiperf` run), attached to the shared `model_repo_server`.
"""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.server, pytest.mark.slow]

REPO_ROOT = Path(__file__).resolve().parent.parent
SMALL = ["--requests", "2", "--concurrency", "1", "--input-tokens", "16", "--output-tokens", "4"]


def _require(venv_tool: Path, make_target: str) -> None:
    if not venv_tool.exists():
        pytest.fail(f"{venv_tool} is missing: `make test` builds it (or run `make {make_target}`)", pytrace=False)


def _rows(csv_path: Path) -> dict[str, list[str]]:
    with open(csv_path, newline="") as handle:
        return {row[0]: row[1:] for row in csv.reader(handle) if row}


def _average(rows: dict[str, list[str]], metric: str) -> float:
    return float(rows[metric][0].replace(",", ""))


def _run(script: str, out: Path, triton_grpc: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, script, "--triton-grpc", triton_grpc, "--out", str(out), *SMALL],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=1500,
    )


def test_genai_perf_in_its_four_formats(model_repo_server, tmp_path):
    _require(REPO_ROOT / "build" / "genai-perf-venv" / "bin" / "genai-perf", "genai-perf-venv")
    result = _run("perf/genai_perf_profiles.py", tmp_path, model_repo_server.grpc_url)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    for name in ("triton-tensorrtllm", "triton-vllm", "openai-chat", "openai-completions"):
        run = tmp_path / name / f"ensemble-{name}-concurrency1"
        rows = _rows(run / "profile_export_genai_perf.csv")
        assert _average(rows, "Time To First Token (ms)") > 0, name
        assert _average(rows, "Inter Token Latency (ms)") > 0, name
        assert _average(rows, "Request Count (count)") == 2, name
        assert (run / "profile_export_genai_perf.json").is_file()
        assert (tmp_path / name / "plots" / "time_to_first_token.jpeg").is_file(), name
    # The formats are genai-perf's own (recorded in its inputs): TensorRT-LLM's names,
    # vLLM's sampling_parameters with numbers as strings and no max_tokens tensor.
    import json

    trtllm = json.loads((tmp_path / "triton-tensorrtllm" / "ensemble-triton-tensorrtllm-concurrency1"
                         / "inputs.json").read_text())["data"][0]
    assert {"text_input", "max_tokens", "exclude_input_in_output", "stream", "min_length"} <= set(trtllm)
    vllm = json.loads((tmp_path / "triton-vllm" / "ensemble-triton-vllm-concurrency1"
                       / "inputs.json").read_text())["data"][0]
    assert "max_tokens" not in vllm
    assert json.loads(vllm["sampling_parameters"][0]) == {"max_tokens": "4", "min_tokens": "4"}


def test_aiperf_chat_and_completions_streaming(model_repo_server, tmp_path):
    _require(REPO_ROOT / "build" / "aiperf-venv" / "bin" / "aiperf", "aiperf-venv")
    result = _run("perf/aiperf_profiles.py", tmp_path, model_repo_server.grpc_url)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    for endpoint_type in ("chat", "completions"):
        rows = _rows(tmp_path / endpoint_type / "profile_export_aiperf.csv")
        assert _average(rows, "Time to First Token (ms)") > 0, endpoint_type
        assert _average(rows, "Inter Token Latency (ms)") > 0, endpoint_type
        assert _average(rows, "Request Count") == 2, endpoint_type
