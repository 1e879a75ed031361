"""Start, watch and stop a real `tritonserver` (no Docker).

Used by `make serve`, `make demo`, the benchmarks and the tests (as a fixture).

Two traps of the Python backend stub are handled here (docs/RUNTIME-NOTES.md):
- the stub ignores PYTHONPATH and finds its environment through the first `python3`
  on PATH, so this Python's `bin/` goes first on PATH;
- the stub links `libpython3.X.so.1.0`, which must be the build of this Python's
  standard library, so this Python's LIBDIR goes first on LD_LIBRARY_PATH, then the
  server folder's `lib/` (a copied binary loses the wheel's relative RPATH).

Usage:
  python tools/server_launcher.py --model-repository model_repo [--http-port 8000 ...]
"""

from __future__ import annotations

import argparse
import atexit
import os
import re
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_SERVER_DIR = REPO_ROOT / "build" / "tritonserver"
NVLS_OFF_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def _copy_output(pipe, log_path: Path, echo: bool) -> None:
    with open(log_path, "ab", buffering=0) as log_file:
        for line in iter(pipe.readline, b""):
            log_file.write(line)
            if echo:
                sys.stdout.buffer.write(line)
                sys.stdout.buffer.flush()


class ServerStartError(RuntimeError):
    """The server exited or did not become ready; the message names the failed models."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def server_environment(server_dir: Path = DEFAULT_SERVER_DIR, base: dict | None = None) -> dict:
    """Environment for tritonserver (and perf_analyzer) that puts this Python first."""
    env = dict(os.environ if base is None else base)
    python_bin = str(Path(sys.executable).parent)  # not resolved: a venv's bin/ holds pyvenv.cfg's python3
    env["PATH"] = os.pathsep.join([python_bin, env.get("PATH", "")])
    libdirs = [sysconfig.get_config_var("LIBDIR") or "", str(server_dir / "lib")]
    if env.get("LD_LIBRARY_PATH"):
        libdirs.append(env["LD_LIBRARY_PATH"])
    env["LD_LIBRARY_PATH"] = os.pathsep.join(d for d in libdirs if d)
    # Tokenizers' thread pool does not survive the stub's fork model well; the models
    # run one tokenizer call at a time anyway.
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    # NVLink multicast (NVLS) stays off for every NCCL user under the server (the
    # tensor-parallel engine and its workers): it can put shared GPUs out of service.
    env.update(NVLS_OFF_ENV)
    return env


_FAILED_MODEL = re.compile(r"failed to load '([^']+)'[^:]*: (.*?)\"?$")
_POLL_FAILED = re.compile(r"Poll failed for model directory '([^']+)': (.*?)\"?$")
_UNAVAILABLE = re.compile(r"\|\s*(\S+)\s*\|\s*\d+\s*\|\s*UNAVAILABLE: (.*)\|")


def failed_models(log_text: str) -> dict[str, str]:
    """Map model name -> reason for every model the log says failed to load."""
    failures: dict[str, str] = {}
    for line in log_text.splitlines():
        match = _FAILED_MODEL.search(line) or _POLL_FAILED.search(line) or _UNAVAILABLE.search(line)
        if match:
            failures.setdefault(match.group(1), match.group(2).strip())
    return failures


@dataclass
class TritonServer:
    """One tritonserver process on loopback ports (free ones unless given)."""

    model_repository: Path
    server_dir: Path = DEFAULT_SERVER_DIR
    http_port: int = 0
    grpc_port: int = 0
    metrics_port: int = 0
    log_path: Path | None = None
    log_verbose: int = 0
    host: str = "127.0.0.1"  # the address HTTP, gRPC and metrics listen on
    # A log file made here (log_path not given) is removed by stop(), unless this is set or
    # the server failed to start (then the failure report names it).
    keep_log: bool = False
    extra_args: list[str] = field(default_factory=list)
    env: dict | None = None
    process: subprocess.Popen | None = None

    def __post_init__(self) -> None:
        self.model_repository = Path(self.model_repository).resolve()
        self.http_port = self.http_port or free_port()
        self.grpc_port = self.grpc_port or free_port()
        self.metrics_port = self.metrics_port or free_port()
        self._temporary_log = self.log_path is None
        if self.log_path is None:
            handle, name = tempfile.mkstemp(prefix="tritonserver-", suffix=".log")
            os.close(handle)
            self.log_path = Path(name)

    @property
    def client_host(self) -> str:
        """Where a client on this machine reaches the server."""
        return "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host

    @property
    def http_url(self) -> str:
        return f"{self.client_host}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.client_host}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.client_host}:{self.metrics_port}/metrics"

    def command(self) -> list[str]:
        return [
            str(self.server_dir / "bin" / "tritonserver"),
            f"--model-repository={self.model_repository}",
            f"--backend-directory={self.server_dir / 'backends'}",
            f"--cache-directory={self.server_dir / 'caches'}",
            f"--http-address={self.host}",
            f"--http-port={self.http_port}",
            f"--grpc-address={self.host}",
            f"--grpc-port={self.grpc_port}",
            f"--metrics-address={self.host}",
            f"--metrics-port={self.metrics_port}",
            "--allow-metrics=true",
            "--allow-gpu-metrics=false",
            f"--log-verbose={self.log_verbose}",
            "--exit-timeout-secs=30",
            *self.extra_args,
        ]

    def start(self, timeout: float = 300.0, stream_log: bool = False) -> TritonServer:
        """Start the server and wait until it and all its models are ready."""
        binary = self.server_dir / "bin" / "tritonserver"
        if not binary.exists():
            raise ServerStartError(f"{binary} is missing: run `make install` first")
        env = server_environment(self.server_dir, self.env)
        Path(self.log_path).write_bytes(b"")
        # A SIGTERM/SIGINT that arrives while the process is being created waits (deferred)
        # until the process is recorded and its cleanup registered, then goes to the
        # previous handler: a signal at this moment cannot leave an unrecorded server behind.
        # (Blocking the signals instead would leave them blocked in the child.)
        deferred: list[int] = []
        in_main_thread = threading.current_thread() is threading.main_thread()
        previous = {}
        if in_main_thread:
            previous = {sig: signal.signal(sig, lambda signum, frame: deferred.append(signum))
                        for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            self.process = subprocess.Popen(
                self.command(),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
            # The server has its own session (a terminal's Ctrl-C must not reach it directly);
            # make sure it does not outlive this Python process.
            atexit.register(self.stop)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            if deferred:
                signal.raise_signal(deferred[0])
        # One reader thread copies the server's output to the log file (and to our
        # stdout for `make serve`), so the pipe never fills and the log is always there.
        self._log_thread = threading.Thread(
            target=_copy_output, args=(self.process.stdout, Path(self.log_path), stream_log), daemon=True
        )
        self._log_thread.start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.keep_log = True
                raise ServerStartError(self._failure_report(f"tritonserver exited with status {self.process.returncode}"))
            if self.is_ready():
                return self
            time.sleep(0.5)
        self.keep_log = True
        self.stop()
        raise ServerStartError(self._failure_report(f"tritonserver was not ready after {timeout:.0f} s"))

    def is_ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.http_url}/v2/health/ready", timeout=2) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def log_text(self) -> str:
        """The server's log; after `stop()` removed a temporary log file, what it held."""
        try:
            return Path(self.log_path).read_text(errors="replace")
        except OSError:
            return getattr(self, "_removed_log_text", "")

    def _failure_report(self, headline: str, tail_lines: int = 40) -> str:
        text = self.log_text()
        failures = failed_models(text)
        lines = [headline]
        for model, reason in failures.items():
            lines.append(f"model '{model}' failed to load: {reason}")
        # Parser and loader errors (e.g. a config.pbtxt that does not parse) come before
        # the tail; keep them in the report.
        lines.extend(line for line in text.splitlines() if "ERROR" in line or line.startswith("E1") or line.startswith("E0"))
        lines.append(f"--- last {tail_lines} lines of {self.log_path} ---")
        lines.extend(text.splitlines()[-tail_lines:])
        return "\n".join(lines)

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM, then SIGKILL after `timeout` seconds. Returns the exit status.
        A temporary log is removed (see `keep_log`)."""
        if self.process is None or self.process.poll() is not None:
            self._remove_temporary_log()
            return None if self.process is None else self.process.returncode
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            status = self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            status = self.process.wait(timeout=10)
        try:  # a Python backend stub left in the server's process group goes too
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        log_thread = getattr(self, "_log_thread", None)
        if log_thread is not None:
            log_thread.join(timeout=5)
        self._remove_temporary_log()
        return status

    def _remove_temporary_log(self) -> None:
        if self._temporary_log and not self.keep_log and self.log_path is not None:
            self._removed_log_text = self.log_text()  # still readable through log_text()
            Path(self.log_path).unlink(missing_ok=True)

    def __enter__(self) -> TritonServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run tritonserver in the foreground on a model repository.")
    parser.add_argument("--model-repository", type=Path, default=REPO_ROOT / "model_repo")
    parser.add_argument("--server-dir", type=Path, default=DEFAULT_SERVER_DIR)
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--grpc-port", type=int, default=8001)
    parser.add_argument("--metrics-port", type=int, default=8002)
    parser.add_argument("--log-verbose", type=int, default=0)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    parser.add_argument("extra", nargs="*", help="more tritonserver arguments (after --)")
    args = parser.parse_args(argv)
    server = TritonServer(
        args.model_repository,
        server_dir=args.server_dir,
        http_port=args.http_port,
        grpc_port=args.grpc_port,
        metrics_port=args.metrics_port,
        log_verbose=args.log_verbose,
        host=args.host,
        extra_args=args.extra,
    )
    print(f"starting tritonserver on {args.model_repository} (HTTP {server.http_url}, gRPC {server.grpc_url}, "
          f"metrics {server.metrics_url})", flush=True)
    return run_in_foreground(server)


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def run_in_foreground(server: TritonServer) -> int:
    """Start the server, wait for it, stop it on SIGTERM or SIGINT at any moment.

    The handlers are installed before the server starts: the server runs in its own
    session (so a terminal's Ctrl-C reaches only us), and a signal that arrived during
    start-up used to kill this launcher with the default action and orphan the server."""
    previous = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        try:
            server.start(stream_log=True, timeout=600)
        except ServerStartError as error:
            print(error, file=sys.stderr)
            return 1
        print("tritonserver is ready; Ctrl-C stops it", flush=True)
        return server.process.wait()
    except KeyboardInterrupt:
        print("stopping tritonserver", flush=True)
        return 0
    finally:
        # Stopping must not be interrupted by a second signal.
        for sig in previous:
            signal.signal(sig, signal.SIG_IGN)
        server.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


if __name__ == "__main__":
    raise SystemExit(main())
