"""The custom one-shot all-reduce (inflightllm/parallel/custom_all_reduce.py) against NCCL on
the GPUs of one host: exactness, a dead peer, and the time per call.

Two (or --ranks) processes, one per GPU, join a group as the tensor-parallel ranks do
(`Distributed`, NCCL plus the gloo control group), then:
- `check`: random tensors of every engine dtype and sizes from 16 bytes to the custom path's
  limit, each summed by both; the results must be bitwise equal on every rank and (with two
  ranks, where the order of a sum cannot differ) bitwise equal to NCCL's. Eager and inside a
  CUDA graph.
- `time`: 64 all-reduces of one [1, hidden] row (a batch-1 decode step has 65) in one CUDA
  graph, replayed; microseconds per call for each, with PDL as the engine launches it.
- `abort`: rank 1 never arrives; rank 0's kernel returns once its abort flag is set.

    python perf/bench_allreduce.py [--sections check,time,abort] [--out $OUT/allreduce.json]
Exit status 0 when every check passed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402


def _rank_main(rank: int, world: int, port: int, sections: list[str], hidden: int, queue) -> None:
    try:
        queue.put((rank, _run(rank, world, port, sections, hidden)))
    except BaseException as error:  # noqa: BLE001 - report it to the parent
        queue.put((rank, {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()}))


def _run(rank: int, world: int, port: int, sections: list[str], hidden: int) -> dict:
    import torch.distributed as dist

    from inflightllm.parallel.group import Distributed

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    group = Distributed(rank, world, port, "nccl", 120.0, device=device)
    custom = group.tp.custom
    report: dict = {"custom_all_reduce": custom is not None}
    if custom is None:
        return report
    if "check" in sections:
        report["check"] = _check(rank, world, group, custom, dist)
    if "time" in sections:
        report["time_us_per_call"] = _time(custom, hidden, dist)
    if "abort" in sections:
        report["abort"] = _abort(rank, group, custom)
    return report


def _check(rank, world, group, custom, dist) -> dict:
    failures = []
    cases = 0
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        element = torch.empty(0, dtype=dtype).element_size()
        for nbytes in (16, 48, 4096, 8192, 8192 * 3, 65536, custom.max_bytes):
            count = nbytes // element
            generator = torch.Generator(device="cuda").manual_seed(1000 * rank + nbytes)
            source = torch.randn(count, device="cuda", dtype=torch.float32, generator=generator).to(dtype)
            ours = source.clone()
            custom.all_reduce(ours)
            reference = source.clone()
            dist.all_reduce(reference)
            # Inside a CUDA graph, twice (the slots alternate), against the eager result.
            graphed = source.clone()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                custom.all_reduce(graphed)
            replays = []
            for _ in range(2):
                graphed.copy_(source)
                graph.replay()
                replays.append(graphed.clone())
            torch.cuda.synchronize()
            everyone = group.all_gather_object(ours.cpu().view(torch.uint8).numpy().tobytes())
            cases += 1
            problems = []
            if any(other != everyone[0] for other in everyone):
                problems.append("ranks differ")
            if world == 2 and not torch.equal(ours.view(torch.uint8), reference.view(torch.uint8)):
                problems.append(f"differs from NCCL by up to {(ours.float() - reference.float()).abs().max().item():g}")
            if any(not torch.equal(r, ours) for r in replays):
                problems.append("graph replay differs from eager")
            if problems:
                failures.append(f"{dtype} {nbytes} B: {', '.join(problems)}")
    return {"cases": cases, "failures": failures}


def _time(custom, hidden: int, dist) -> dict:
    from inflightllm.gpu import pdl

    row = torch.randn(1, hidden, device="cuda", dtype=torch.bfloat16)
    results = {}
    for name, reduce in (("custom", custom.all_reduce), ("nccl", lambda t: dist.all_reduce(t))):
        reduce(row)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            for _ in range(64):
                reduce(row)
        for _ in range(5):
            graph.replay()
        torch.cuda.synchronize()
        dist.barrier()
        replays = 200
        start = time.perf_counter()
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
        results[name] = round((time.perf_counter() - start) * 1e6 / (replays * 64), 2)
        del graph
    results["pdl"] = pdl.enabled(torch.cuda.current_device())
    return results


def _abort(rank, group, custom) -> dict:
    group.all_agree(True)
    if rank != 0:
        time.sleep(3.0)  # never arrives at this all-reduce
        group.all_agree(True)
        return {}
    tensor = torch.ones(1024, device="cuda", dtype=torch.bfloat16)
    custom.all_reduce(tensor)
    event = torch.cuda.Event()
    event.record()
    time.sleep(0.5)
    waiting = not event.query()
    start = time.perf_counter()
    custom.abort()
    event.synchronize()
    returned_s = time.perf_counter() - start
    group.all_agree(True)
    return {"waited_for_the_peer": waiting, "returned_after_abort_s": round(returned_s, 4)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", default="check,time,abort")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    from inflightllm.parallel.group import apply_nccl_safe_env
    from inflightllm.parallel.tp_runner import free_port

    apply_nccl_safe_env()
    sections = args.sections.split(",")
    context = mp.get_context("spawn")
    queue = context.Queue()
    port = free_port()
    processes = [context.Process(target=_rank_main, args=(r, args.ranks, port, sections, args.hidden, queue))
                 for r in range(args.ranks)]
    for process in processes:
        process.start()
    reports = {}
    try:
        for _ in processes:
            rank, report = queue.get(timeout=300)
            reports[rank] = report
    finally:
        for process in processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
    result = {"ranks": args.ranks, "gpus": [torch.cuda.get_device_name(i) for i in range(args.ranks)],
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "by_rank": reports}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text)
    ok = all("error" not in r and r.get("custom_all_reduce") for r in reports.values()) and len(reports) == args.ranks
    ok = ok and all(not r.get("check", {}).get("failures") for r in reports.values())
    if "abort" in sections:
        ok = ok and bool(reports.get(0, {}).get("abort", {}).get("waited_for_the_peer"))
    print("custom all-reduce:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("INFLIGHTLLM_CUSTOM_ALL_REDUCE", "1")
    sys.exit(main())
