"""Smoke test of perf/bench_host_path.py: both modes run and check every token."""

from __future__ import annotations

import subprocess
import sys

import pytest

from inflightllm.profile import REPO_ROOT


@pytest.mark.parametrize("mode", ["engine", "loop"])
@pytest.mark.parametrize("stream", [False, True])
def test_bench_host_path_runs_and_counts_every_token(mode, stream, tmp_path):
    command = [sys.executable, "-m", "perf.bench_host_path", "--mode", mode, "--requests", "8",
               "--input-len", "4", "--output-len", "20", "--runs", "1", "--cprofile", str(tmp_path)]
    if stream:
        command.append("--stream")
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert f"mode={mode} stream={stream} requests=8 in=4 out=20: median" in result.stdout
    expected = {"engine.prof"} if mode == "engine" else {"loop.prof", "sender.prof"}
    assert {path.name for path in tmp_path.iterdir()} == expected
