"""perf_analyzer against the ensemble: the input files, the wrapper, a short smoke run.

perf_analyzer 2.51 needs `-i grpc --streaming` for the (decoupled) ensemble; the wrapper
`build/bin/perf_analyzer` (written by tools/build_server.py) finds its libraries.
Figures are printed, never asserted.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
INPUTS_DIR = REPO_ROOT / "perf" / "inputs"
WRAPPER = REPO_ROOT / "build" / "bin" / "perf_analyzer"
SERVER_DIR = REPO_ROOT / "build" / "tritonserver"
# Generous: the run itself takes ~30 s on 2 CPU cores; the timeout only keeps a stuck
# perf_analyzer from hanging the suite.
SMOKE_TIMEOUT_S = 240


def ensemble_inputs() -> dict[str, tuple[str, bool]]:
    """The ensemble's input names -> (Triton type, optional) from the rendered config."""
    from tools.render_configs import ENSEMBLE_INPUTS

    return {tensor.name: (tensor.data_type, tensor.optional) for tensor in ENSEMBLE_INPUTS}


@pytest.mark.parametrize("path", sorted(INPUTS_DIR.glob("*.json")), ids=lambda path: path.name)
def test_input_files_match_the_ensemble(path):
    inputs = ensemble_inputs()
    required = {name for name, (_type, optional) in inputs.items() if not optional}
    data = json.loads(path.read_text())["data"]
    assert len(data) >= 4, "several prompts, so a run does not repeat one request"
    python_types = {"TYPE_STRING": str, "TYPE_INT32": int, "TYPE_BOOL": bool, "TYPE_FP32": float}
    for entry in data:
        assert required <= set(entry), entry
        assert ("text_input" in entry) != ("messages" in entry), entry
        for name, values in entry.items():
            assert name in inputs, f"{path.name}: {name!r} is not an ensemble input"
            assert isinstance(values, list) and len(values) == 1, (name, values)  # dims [1]
            assert type(values[0]) is python_types[inputs[name][0]], (name, values)
        if "messages" in entry:
            messages = json.loads(entry["messages"][0])
            assert [message["role"] for message in messages] == ["user"]
        if entry.get("stream") == [False]:
            assert entry.get("exclude_input_in_output") == [True], "a one-response answer without the prompt"
    assert all(entry["stream"] == [path.stem.endswith("_stream")] for entry in data)


def test_build_server_writes_the_wrapper_also_when_the_folder_is_current(tmp_path):
    """build() with a stamp that says "current" must still (re)write build/bin/perf_analyzer."""
    from tools import build_server

    server_dir, _libs = build_server.pytriton_paths()
    stub = server_dir / "python_backend_stubs" / build_server.python_version_tag() / "triton_python_backend_stub"
    out_dir = tmp_path / "tritonserver"
    (out_dir / "bin").mkdir(parents=True)
    (out_dir / "bin" / "tritonserver").write_text("")
    info = {"source": str(server_dir), "python": build_server.python_version_tag(), "copy": False,
            "stub_size": stub.stat().st_size}
    (out_dir / "BUILD_INFO.json").write_text(json.dumps(info))
    wrapper = tmp_path / "bin" / "perf_analyzer"
    wrapper.parent.mkdir()
    wrapper.write_text("stale")

    assert build_server.build(out_dir) == out_dir
    assert (out_dir / "bin" / "tritonserver").read_text() == ""  # the folder was left alone
    text = wrapper.read_text()
    assert text.startswith("#!/usr/bin/env bash\n")
    assert 'export LD_LIBRARY_PATH="$here/../tritonserver/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"\n' in text
    assert text.endswith(f'exec "{Path(sys.executable).absolute().parent / "perf_analyzer"}" "$@"\n')
    assert os.access(wrapper, os.X_OK)
    build_server.build(out_dir)  # idempotent
    assert wrapper.read_text() == text


def test_wrapper_runs_perf_analyzer():
    if not WRAPPER.exists():
        pytest.skip(f"{WRAPPER} is missing: run `make install` (tools/build_server.py writes it)")
    result = subprocess.run([str(WRAPPER), "--version"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "Perf Analyzer Version 2.51.0" in result.stderr  # it prints its version to stderr


def perf_analyzer_command(grpc_url: str) -> list[str]:
    return [
        str(WRAPPER),
        "-m", "ensemble",
        "-i", "grpc",
        "--streaming",  # the ensemble is decoupled: the gRPC streaming API is the only way
        "--input-data", str(INPUTS_DIR / "chat_stream.json"),
        "-u", grpc_url,
        "--concurrency-range", "1:2",
        # Windows end after 3 finished requests, not after a time: a slower machine
        # cannot leave a window with no finished request ("No valid requests recorded").
        "--measurement-mode", "count_windows",
        "--measurement-request-count", "3",
        # A smoke run: three windows per concurrency, every window counts as stable.
        "--max-trials", "3",
        "--stability-percentage", "1000",
    ]


@pytest.mark.server
def test_perf_analyzer_smoke_run(model_repo_server):
    if not WRAPPER.exists():
        pytest.skip(f"{WRAPPER} is missing: run `make install` (tools/build_server.py writes it)")
    command = perf_analyzer_command(model_repo_server.grpc_url)
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=SMOKE_TIMEOUT_S)
    except subprocess.TimeoutExpired as error:
        pytest.fail(f"perf_analyzer ran past {SMOKE_TIMEOUT_S} s: {' '.join(command)}\n{error.stdout}")
    output = result.stdout + result.stderr
    print(output)  # the figures, for `pytest -s`
    assert result.returncode == 0, output
    assert "Detected decoupled model" in output
    assert re.search(r"^Concurrency: 1, throughput: [\d.]+ infer/sec, latency \d+ usec$", output, re.MULTILINE), output
    assert re.search(r"^Concurrency: 2, throughput: [\d.]+ infer/sec, latency \d+ usec$", output, re.MULTILINE), output
    assert len(re.findall(r"^\s+Response Throughput: [\d.]+ infer/sec$", output, re.MULTILINE)) == 2, output
