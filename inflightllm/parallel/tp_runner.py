"""`TensorParallelRunner`: the runner rank 0's engine drives when tensor_parallel_size > 1.

Rank 0 lives in the engine's process (the Triton Python backend's stub) and keeps the
scheduler. It starts ranks 1..N-1 as worker processes (`python -m
inflightllm.parallel.worker`, a fresh interpreter, never a fork), joins them in a
process group (NCCL on GPU, gloo on CPU) and a gloo control group, and each step
sends the step description (new requests once, then deltas) with the tokens it sampled
last step, through a shared-memory ring (`message_ring`; the gloo group's broadcast where
the host cannot use one). Then every rank runs the same step.

Failure: a watchdog thread polls the workers and times the step. A worker that exits
(crash, kill, exception) or a step longer than `step_timeout_s` marks the runner failed:
the workers are killed and the process groups aborted, so a collective blocked on a
missing peer returns. `execute` then raises `TensorParallelError` (the engine loop fails
every in-flight request with its message) and keeps raising: the engine is not ready.
`shutdown` stops the workers (a stop message, then SIGKILL after a grace period) and
never hangs; the workers also die with their parent (PR_SET_PDEATHSIG and a parent watch).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path

from inflightllm.config import EngineConfig
from inflightllm.model_source import ModelSpec
from inflightllm.models.loader import LoadedModel
from inflightllm.parallel import message_ring
from inflightllm.parallel.group import NCCL_SAFE_ENV, Distributed
from inflightllm.parallel.runner import (
    cpu_num_blocks,
    leave_group,
    load_rank_model,
    make_rank_runner,
    rank_device,
)
from inflightllm.step import SampledTokens, StepDescription

logger = logging.getLogger(__name__)

# Rendezvous, loading and (on GPU) KV sizing and graph capture of every rank: the process
# groups' own timeout, long enough for a large model. Steps are timed by the watchdog.
INIT_TIMEOUT_S = 1800.0
STOP_GRACE_S = 5.0
TEARDOWN_TIMEOUT_S = 20.0


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank failed; the engine cannot run steps any more."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def python_executable() -> str:
    """The Python interpreter to start workers with. Inside Triton's Python backend
    `sys.executable` is the stub binary, not Python: use the environment's python3 (the
    stub found its environment through the first python3 on PATH)."""
    candidates = [sys.executable, str(Path(sys.prefix) / "bin" / "python3"), shutil.which("python3") or ""]
    for candidate in candidates:
        if candidate and Path(candidate).name.startswith("python") and os.access(candidate, os.X_OK):
            return candidate
    raise TensorParallelError("no python3 found to start tensor-parallel workers with")


def worker_environment(config: EngineConfig) -> dict:
    env = dict(os.environ)
    env.update(NCCL_SAFE_ENV)  # also on CPU: a worker must never turn multicast on
    env.setdefault("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1") if config.device == "cpu" else "1")
    root = str(Path(__file__).resolve().parent.parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    return env


class TensorParallelRunner:
    """Rank 0 of a tensor-parallel engine: same interface as a single-device runner
    (`execute(step) -> SampledTokens`, `num_blocks`), plus `shutdown`, `healthy` and
    `failure`."""

    def __init__(self, spec: ModelSpec, config: EngineConfig, loaded: LoadedModel, num_blocks: int | None,
                 sampler_seed: int | None):
        self.spec = spec
        self.config = config
        self.world_size = config.tensor_parallel_size
        self.step_timeout_s = float(config.step_timeout_s)
        # Every rank samples with the same seed (the logits are all-gathered, so equal).
        self.sampler_seed = sampler_seed if sampler_seed is not None else random.getrandbits(62)
        self.failure: str | None = None
        self._closing = False
        self._lock = threading.Lock()
        self._step_started: float | None = None
        # (launch index, request ids, token ids) of the last step read here; the workers
        # check their own samples of that step against it.
        self._last_sampled: tuple[int, list[str], list[int]] | None = None
        self._num_launched = 0
        # Host seconds rank 0 spent per part of its steps (read by perf/bench_tp.py's profile).
        self.host_seconds = {"broadcast": 0.0, "launch": 0.0, "result": 0.0, "steps": 0}
        self.workers: list[subprocess.Popen] = []
        port = free_port()
        backend = "gloo" if config.device == "cpu" else "nccl"
        self.ring = self._create_ring()
        atexit.register(self.shutdown)  # from here on: stops the workers, removes the ring's file
        try:
            self._start_workers(port, backend)
        except BaseException:
            self.shutdown()
            raise
        self._watchdog = threading.Thread(target=self._watch, name="inflightllm-tp-watchdog", daemon=True)
        self._watchdog.start()
        try:
            if backend == "nccl":
                import torch

                torch.cuda.set_device(rank_device(config, 0))
            self.dist = Distributed(0, self.world_size, port, backend, INIT_TIMEOUT_S, device=rank_device(config, 0))
            if self.ring is not None:  # every worker has mapped it before joining the group
                self.ring.unlink()
            self.loaded = load_rank_model(spec, config, self.dist, loaded)
            if loaded is not None and loaded.model is None:  # GPU: the engine's model is rank 0's share
                loaded.model = self.loaded.model
            if config.device == "cpu" and num_blocks is None:
                num_blocks = cpu_num_blocks(spec, config, self.loaded.config)
            self.runner = make_rank_runner(self.loaded, config, self.dist, num_blocks, self.sampler_seed)
        except BaseException as error:
            reason = self.failure or f"{type(error).__name__}: {error}"
            self.shutdown()
            raise TensorParallelError(f"tensor-parallel start failed: {reason}") from error
        self.num_blocks = self.runner.num_blocks
        # Rank 0's measured host link: every rank swaps its own share of a block over its own
        # link at the same time, so rank 0's figures are the step's (preemption_mode auto).
        self.host_link = getattr(self.runner, "host_link", None)
        # The host KV tier: every rank sizes it from the same budget and the same shard shape.
        self.num_host_blocks = getattr(self.runner, "num_host_blocks", 0)
        self.host_kv_bytes_per_block = getattr(self.runner, "host_kv_bytes_per_block", 0)
        logger.info(
            "tensor parallel: %d ranks (%s), workers %s, %d KV blocks each",
            self.world_size, backend, [w.pid for w in self.workers], self.num_blocks,
        )

    # ---- workers ---------------------------------------------------------------------
    def _create_ring(self) -> message_ring.MessageRing | None:
        if not message_ring.available():
            logger.info("tensor parallel: step messages over gloo (no shared-memory ring on this host)")
            return None
        try:
            return message_ring.MessageRing.create(readers=self.world_size - 1)
        except OSError as error:
            logger.warning("tensor parallel: no shared-memory ring (%s); step messages over gloo", error)
            return None

    def _send(self, message) -> None:
        """Send `message` to every worker (a step or the stop message)."""
        if self.ring is None:
            self.dist.broadcast_message(message)
        else:
            self.ring.write(message, stop=self._ring_stop)

    def _ring_stop(self) -> bool:
        """While the ring is full: stop waiting once the runner failed or a worker is gone."""
        return self.failure is not None or any(worker.poll() is not None for worker in self.workers)

    def _start_workers(self, port: int, backend: str) -> None:
        env = worker_environment(self.config)
        python = python_executable()
        for rank in range(1, self.world_size):
            command = [
                python, "-m", "inflightllm.parallel.worker",
                "--rank", str(rank),
                "--world-size", str(self.world_size),
                "--port", str(port),
                "--backend", backend,
                "--parent-pid", str(os.getpid()),
                "--sampler-seed", str(self.sampler_seed),
                "--spec", json.dumps(asdict(self.spec)),
                "--config", json.dumps(self.config.to_parameters()),
            ]
            if self.ring is not None:
                command += ["--ring", str(self.ring.path)]
            # Same process group as the server (its launcher's killpg reaches them too).
            self.workers.append(subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL))

    def _watch(self) -> None:
        while not self._closing:
            time.sleep(0.1)
            if self._closing or self.failure is not None:
                continue
            for rank, worker in enumerate(self.workers, start=1):
                status = worker.poll()
                if status is not None:
                    how = f"was killed by signal {-status}" if status < 0 else f"exited with status {status}"
                    self._fail(f"tensor-parallel worker rank {rank} (pid {worker.pid}) {how}")
                    break
            started = self._step_started
            if self.failure is None and started is not None and time.monotonic() - started > self.step_timeout_s:
                self._fail(
                    f"a tensor-parallel step did not finish within step_timeout_s={self.step_timeout_s:g} s "
                    "(a worker hung)"
                )

    def _fail(self, reason: str) -> None:
        with self._lock:
            if self.failure is not None:
                return
            self.failure = reason
        logger.error("%s; the engine stops serving (not ready)", reason)
        self._kill_workers()
        dist_ = getattr(self, "dist", None)
        if dist_ is not None:
            # The abort makes a collective blocked on the dead peer return (NCCL: its kernel
            # sees the abort flag). NCCL may then wait for the peer to free resources: never
            # hold the watchdog (or anyone) on it.
            threading.Thread(target=dist_.abort, name="inflightllm-tp-abort", daemon=True).start()

    def _kill_workers(self) -> None:
        for worker in self.workers:
            if worker.poll() is None:
                try:
                    worker.send_signal(signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for worker in self.workers:
            try:
                worker.wait(timeout=5)
            except subprocess.TimeoutExpired:
                logger.error("worker pid %d did not exit after SIGKILL", worker.pid)

    @property
    def healthy(self) -> bool:
        return self.failure is None and not self._closing

    # ---- the step --------------------------------------------------------------------
    def execute(self, step: StepDescription) -> SampledTokens:
        return self.launch(step).result()

    def launch(self, step: StepDescription) -> TensorParallelStep:
        """Send the step to the workers and queue it here; `result()` waits for its tokens
        (the engine's asynchronous scheduling launches step N+1 before reading step N)."""
        if self.failure is not None:
            raise TensorParallelError(f"engine not ready: {self.failure}")
        if self._closing:
            raise TensorParallelError("engine not ready: tensor-parallel runner is shut down")
        index = self._num_launched
        self._num_launched += 1

        def run():
            times = self.host_seconds
            start = time.perf_counter()
            self._send(("step", step, self._last_sampled))
            sent = time.perf_counter()
            launch = getattr(self.runner, "launch", None)
            handle = launch(step) if launch is not None else _Finished(self.runner.execute(step))
            times["broadcast"] += sent - start
            times["launch"] += time.perf_counter() - sent
            times["steps"] += 1
            return handle

        return TensorParallelStep(self, index, self._guarded(run))

    def _guarded(self, function):
        """Run `function` as part of a step: timed by the watchdog; a collective that fails
        (a peer died, or the watchdog aborted the groups) raises TensorParallelError."""
        self._step_started = time.monotonic()
        try:
            value = function()
        except Exception as error:
            # A collective failed: give the watchdog a moment to name the cause.
            deadline = time.monotonic() + 2.0
            while self.failure is None and time.monotonic() < deadline:
                time.sleep(0.05)
            if self.failure is None:
                self._fail(f"tensor-parallel step failed on rank 0: {type(error).__name__}: {error}")
            raise TensorParallelError(f"engine not ready: {self.failure}") from error
        finally:
            self._step_started = None
        if self.failure is not None:  # aborted mid-step: the result is not trustworthy
            raise TensorParallelError(f"engine not ready: {self.failure}")
        return value

    # ---- shutdown --------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop the workers and leave the process groups; bounded in time, idempotent.

        NCCL's teardown is collective (a communicator destroyed or aborted on one rank
        waits for its peers), so rank 0 leaves the groups together with the workers: stop
        message, then its own destroy while they destroy theirs, each wait bounded. After a
        failure (a peer gone) the groups are aborted on a daemon thread that is never
        waited for: an abort that cannot finish must not hold up unload."""
        if self._closing:
            return
        self._closing = True
        dist_ = getattr(self, "dist", None)
        # Graceful only when no step is in flight (the control group is the step thread's then).
        idle = self._step_started is None
        graceful = dist_ is not None and idle and self.failure is None and all(w.poll() is None for w in self.workers)
        if graceful:
            runner = getattr(self, "runner", None)
            if _bounded(self._send_stop, STOP_GRACE_S) and _bounded(
                lambda: leave_group(runner, dist_), TEARDOWN_TIMEOUT_S
            ):
                deadline = time.monotonic() + STOP_GRACE_S
                for worker in self.workers:
                    try:
                        worker.wait(timeout=max(0.1, deadline - time.monotonic()))
                    except subprocess.TimeoutExpired:
                        pass
            else:
                logger.warning("tensor-parallel teardown did not finish in time; killing the workers")
        self._kill_workers()
        if dist_ is not None and not graceful:
            threading.Thread(target=dist_.abort, name="inflightllm-tp-abort", daemon=True).start()
        ring = getattr(self, "ring", None)
        if ring is not None:
            ring.unlink()
        try:
            atexit.unregister(self.shutdown)
        except Exception:  # noqa: BLE001
            pass

    def _send_stop(self) -> None:
        try:
            self._send(("stop", None, None))
        except Exception as error:  # noqa: BLE001 - the workers are killed anyway
            logger.debug("stop message failed: %r", error)


def _bounded(function, timeout_s: float) -> bool:
    """Run `function` on a daemon thread; True if it returned within `timeout_s`."""
    thread = threading.Thread(target=function, daemon=True)
    thread.start()
    thread.join(timeout_s)
    return not thread.is_alive()


class _Finished:
    """A step already run to the end (a runner without `launch`)."""

    def __init__(self, result: SampledTokens):
        self._result = result

    def result(self) -> SampledTokens:
        return self._result


class TensorParallelStep:
    """A step launched on every rank; `result()` waits for rank 0's sampled tokens."""

    def __init__(self, owner: TensorParallelRunner, index: int, local):
        self.owner = owner
        self.index = index
        self.local = local
        self._result: SampledTokens | None = None

    def result(self) -> SampledTokens:
        if self._result is None:
            start = time.perf_counter()
            self._result = self.owner._guarded(self.local.result)
            self.owner.host_seconds["result"] += time.perf_counter() - start
            self.owner._last_sampled = (self.index, list(self._result.request_ids), list(self._result.token_ids))
        return self._result
