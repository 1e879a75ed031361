"""A tensor-parallel worker process (ranks 1..N-1), started and owned by rank 0.

`python -m inflightllm.parallel.worker --rank R --world-size N --port P --backend B
 --parent-pid PID --sampler-seed S --spec JSON --config JSON [--ring PATH]`

It maps rank 0's message ring (`--ring`; without it the messages come over the gloo
control group), joins the process groups, loads its share of the model, builds its runner
(its own KV cache), then runs each step rank 0 sends until a stop message. It dies with its
parent (PR_SET_PDEATHSIG, and a thread that watches the parent's pid). Any exception
ends the process with status 1 after printing the traceback; rank 0's watchdog sees
the exit and fails the engine with a clear message.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections import deque

PR_SET_PDEATHSIG = 1
TIMING_WINDOW = 100  # with INFLIGHTLLM_TP_TIMING set: host time per step, logged per window


def die_with_parent(parent_pid: int) -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(3)

    def watch():
        while True:
            time.sleep(0.5)
            if os.getppid() != parent_pid:
                os._exit(3)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


class RankMismatch(RuntimeError):
    """This rank sampled another token than rank 0: the ranks are out of step."""


def check_same_samples(rank: int, last_sampled, mine: dict[int, dict[str, int]]) -> None:
    """Compare rank 0's samples of launch `index` with this rank's; forget older ones."""
    index, request_ids, token_ids = last_sampled
    own = mine.get(index)
    for stale in [i for i in mine if i <= index]:
        del mine[stale]
    if own is None:
        return
    for request_id, token in zip(request_ids, token_ids):
        if own.get(request_id, token) != token:
            raise RankMismatch(f"rank {rank} sampled {own[request_id]} for {request_id}, rank 0 sampled {token}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--backend", choices=("gloo", "nccl"), required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--sampler-seed", type=int, required=True)
    parser.add_argument("--spec", required=True)
    parser.add_argument("--config", required=True)
    parser.add_argument("--ring", default=None, help="rank 0's shared-memory message ring")
    args = parser.parse_args(argv)
    die_with_parent(args.parent_pid)
    # Rank 0 owns this process: it ends it with a stop message (NCCL's teardown is collective)
    # or SIGKILL. A SIGTERM or Ctrl-C sent to the whole process group (a server's shutdown)
    # must not end it first; it still dies with its parent.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format=f"[tp rank {args.rank}] %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("inflightllm.parallel.worker")

    import torch

    from inflightllm.config import EngineConfig
    from inflightllm.model_source import ModelSpec
    from inflightllm.parallel.group import Distributed
    from inflightllm.parallel.runner import (
        cpu_num_blocks,
        leave_group,
        load_rank_model,
        make_rank_runner,
        rank_device,
    )
    from inflightllm.parallel.tp_runner import INIT_TIMEOUT_S

    spec = ModelSpec(**json.loads(args.spec))
    config = EngineConfig.from_parameters(json.loads(args.config))
    ring = None
    if args.ring:  # mapped before joining the group: rank 0 removes the file once all have joined
        from inflightllm.parallel.message_ring import MessageRing

        # Spin (yielding) between the steps of a busy GPU engine; a CPU engine's steps are long.
        ring = MessageRing.open(args.ring, reader=args.rank - 1, spin_s=0.05 if config.device != "cpu" else 0.0)
    device = rank_device(config, args.rank)
    if args.backend == "nccl":
        torch.cuda.set_device(device)
    dist_ = Distributed(args.rank, args.world_size, args.port, args.backend, INIT_TIMEOUT_S, device=device)
    loaded = load_rank_model(spec, config, dist_)
    num_blocks = cpu_num_blocks(spec, config, loaded.config) if config.device == "cpu" else (
        config.num_kv_blocks or None
    )
    runner = make_rank_runner(loaded, config, dist_, num_blocks, args.sampler_seed)
    log.info("ready on %s: %d KV blocks", device, runner.num_blocks)
    # Launch each step as rank 0 does; with asynchronous scheduling read a step's tokens
    # after launching the next (the CUDA runner takes them from the device meanwhile).
    launch = getattr(runner, "launch", None) if config.async_scheduling else None
    pending: deque = deque()  # (launch index, handle)
    mine: dict[int, dict[str, int]] = {}  # launch index -> this rank's samples
    index = 0
    # Host seconds per part of the steps: waiting for rank 0's message, launching, reading.
    seconds = {"wait": 0.0, "launch": 0.0, "result": 0.0}
    while True:
        start = time.perf_counter()
        kind, step, last_sampled = ring.read() if ring is not None else dist_.broadcast_message()
        received = time.perf_counter()
        seconds["wait"] += received - start
        if kind == "stop":
            break
        if last_sampled is not None:
            check_same_samples(args.rank, last_sampled, mine)
        if launch is None:
            result = runner.execute(step)
            mine[index] = dict(zip(result.request_ids, result.token_ids))
            seconds["launch"] += time.perf_counter() - received
        else:
            pending.append((index, launch(step)))
            launched = time.perf_counter()
            seconds["launch"] += launched - received
            while len(pending) > 1:
                done_index, handle = pending.popleft()
                result = handle.result()
                mine[done_index] = dict(zip(result.request_ids, result.token_ids))
            seconds["result"] += time.perf_counter() - launched
        index += 1
        if index % TIMING_WINDOW == 0 and os.environ.get("INFLIGHTLLM_TP_TIMING"):
            log.info("steps %d-%d, host ms per step: %s", index - TIMING_WINDOW, index - 1,
                     {name: round(value * 1e3 / TIMING_WINDOW, 3) for name, value in seconds.items()})
            seconds = dict.fromkeys(seconds, 0.0)
    for _, handle in pending:
        handle.result()
    log.info("stopped after %d steps", index)
    leave_group(runner, dist_)
    return 0


if __name__ == "__main__":
    try:
        code = main()
    except BaseException:  # noqa: BLE001 - any failure ends the worker; rank 0 sees the exit
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    os._exit(code)
