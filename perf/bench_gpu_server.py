"""One workload four ways: engine-only, tritonserver (stream=false, stream=true) and `transformers`.

`make bench PROFILE=<gpu profile>` runs this (`make bench-gpu-server PROFILE=<any profile>`
too). One run measures ONE workload, by default 1,024 requests of 128 prompt tokens (texts
built to tokenize to exactly that count) and 128 output tokens (`max_tokens = min_tokens`,
so EOS cannot end a request early), all submitted at once, greedy:

(a) `engine`: `LLM.generate` in-process (no server) with exactly the engine configuration
    the profile renders (the `engine` model's config.pbtxt parameters: max_batch_size,
    max_num_tokens, gpu_memory_utilization, async scheduling, CUDA graphs, ...);
(d) `transformers`: `generate` at batch 128 on the same weights (its model is loaded from
    the engine's `hf_state_dict()`) over the first 128 prompts of (a), after the engine
    and its KV cache are freed (`del`, `torch.cuda.empty_cache()`);
    (a) and (d) run in a spawned child process (`--same-process`: in this one), so that
    when it exits the GPU is free for the server whatever a stray reference kept; then
(b) `nostream`: the real tritonserver started with the profile (the whole ensemble, gRPC
    streaming protocol) with `stream=false`: one response per request;
(c) `stream`: the same server with `stream=true` (a response per `stream_interval`
    tokens; 1 in the GPU profiles). Every token must arrive: per request the token ids
    received number exactly the output length, the server's `num_output_tokens` says so
    too, and the streamed text pieces concatenate to the decode of the received ids.
    (b) is checked the same way.

(b) and (c) use fresh prompts of the same shape (other seeds), so that the prefix cache
cannot serve (c) what (b) left behind. The client is several processes (`--client-procs`,
default 8), each streaming its slice of the requests with `tritonclient.grpc.aio`, all
released at once; their CPU time is reported (and the server's, from /proc), so that a
client that cannot keep up shows. Ratios (b)/(a) and (c)/(a) are printed against the
goals (>= 0.9 and >= 0.8).

Writes `--out DIR`/bench_gpu_server-<profile>.json and .md (and -bars.png when matplotlib
is there; else `python -m perf.plots --from-json` renders it later). Exit status 1 when a
request failed or a check did not hold.

    .venv/bin/python -m perf.bench_gpu_server --profile profiles/smollm2-cpu.yaml \\
        --num-requests 16 --input-len 16 --output-len 16 --client-procs 2 --out build/bench-gpu-server
    # on the GPU host, from the bundle (perf/run_gpu_bench.sh does this):
    ~/inflightllm-bundle/venv/bin/python -m perf.bench_gpu_server --profile profiles/llama3-8b-h200.yaml \\
        --bundle ~/inflightllm-bundle --out $OUT
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import multiprocessing
import os
import queue
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

PHASES = ("engine", "transformers", "nostream", "stream")
PHASE_TITLES = {
    "engine": "(a) engine-only `LLM.generate`",
    "transformers": "(d) `transformers` `generate`",
    "nostream": "(b) tritonserver, stream=false",
    "stream": "(c) tritonserver, stream=true",
}
GOALS = {"nostream": 0.9, "stream": 0.8}  # of the engine-only output tokens/s
MAX_CHECK_EXAMPLES = 5


@dataclass
class Workload:
    """The one workload of a run (prompt and output lengths in tokens)."""

    num_requests: int = 1024
    input_len: int = 128
    output_len: int = 128
    seed: int = 0

    def describe(self) -> str:
        return (f"{self.num_requests} requests, prompts of exactly {self.input_len} tokens, exactly "
                f"{self.output_len} output tokens each (max_tokens = min_tokens), all submitted at once, greedy")


# --- prompts --------------------------------------------------------------------------------


class PromptMaker:
    """Prompt texts that the server's preprocessing tokenizes to exactly `input_len` ids
    (`tokenizer.encode(text, add_special_tokens=True)`, as preprocessing does for
    `text_input`), and those ids."""

    def __init__(self, tokenizer, input_len: int):
        from perf.workloads import ExactPrompts

        self.tokenizer = tokenizer
        self.input_len = input_len
        self.num_special = len(tokenizer.encode("", add_special_tokens=True))
        if input_len <= self.num_special:
            raise ValueError(f"--input-len {input_len}: the tokenizer adds {self.num_special} special token(s) itself")
        self.exact = ExactPrompts(tokenizer)

    def texts(self, count: int, seed: int) -> list[str]:
        self.exact.rng = random.Random(seed)
        return [self.exact.make(self.input_len - self.num_special) for _ in range(count)]

    def ids(self, texts: list[str]) -> list[list[int]]:
        ids = [list(self.tokenizer.encode(text, add_special_tokens=True)) for text in texts]
        wrong = sorted({len(i) for i in ids if len(i) != self.input_len})
        if wrong:
            raise RuntimeError(f"prompts tokenized to {wrong} tokens, not {self.input_len}")
        return ids


def request_inputs(text: str, output_len: int, stream: bool) -> dict:
    """The ensemble inputs of one request (docs/INTERFACE.md)."""
    return {"text_input": text, "max_tokens": output_len, "min_tokens": output_len, "stream": stream,
            "exclude_input_in_output": True}


# --- (a) and (d): in this process -------------------------------------------------------------


def rendered_engine_parameters(profile) -> dict[str, str]:
    """The `parameters` of the engine model's rendered config.pbtxt (engine and model keys)."""
    from tools import render_configs

    return dict(render_configs.template_context(profile)["engine_parameters"])


def free_gpu_memory() -> dict:
    """Collect garbage and hand cached GPU memory back (torch's and CuPy's pools); returns
    what the device has free afterwards (empty on a CPU-only machine)."""
    import torch

    gc.collect()
    try:
        import cupy

        cupy.get_default_memory_pool().free_all_blocks()
        cupy.get_default_pinned_memory_pool().free_all_blocks()
    except ImportError:
        pass
    if not torch.cuda.is_available():
        return {}
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    return {"gpu_free_gib": round(free / 2**30, 2), "gpu_total_gib": round(total / 2**30, 2),
            "torch_allocated_gib": round(torch.cuda.memory_allocated() / 2**30, 3)}


def in_process_phases(profile, workload: Workload, prompt_ids: list[list[int]], warm_ids: list[list[int]],
                      run_engine: bool, run_transformers: bool, transformers_batch: int) -> dict:
    """(a) the engine-only run and (d) `transformers` on the same weights; frees the GPU."""
    import torch

    from inflightllm.config import EngineConfig
    from inflightllm.engine import Engine
    from inflightllm.llm import LLM
    from inflightllm.model_source import ModelSpec
    from inflightllm.sampling_params import SamplingParams
    from perf import bench_gpu

    parameters = rendered_engine_parameters(profile)
    config = EngineConfig.from_parameters(parameters)
    spec = ModelSpec.from_parameters(parameters)
    out: dict = {"engine_parameters": parameters}
    started = time.perf_counter()
    engine = Engine(spec, config)  # as the engine model builds it (model_repo/engine/1/model.py)
    start_s = time.perf_counter() - started
    print(f"[engine] started in {start_s:.1f} s: {engine.stats().num_blocks_total} KV blocks of "
          f"{config.block_size} tokens", flush=True)
    if run_engine:
        params = SamplingParams(max_tokens=workload.output_len, min_tokens=workload.output_len)
        llm = LLM(spec, engine=engine, load_tokenizer_too=False)
        if warm_ids:
            llm.generate(warm_ids, params)
        before = engine.stats()
        bench_gpu.sync()
        started = time.perf_counter()
        results = llm.generate(prompt_ids, params)
        bench_gpu.sync()
        seconds = time.perf_counter() - started
        after = engine.stats()
        tokens = sum(len(r.token_ids) for r in results)
        wrong = [i for i, r in enumerate(results) if len(r.token_ids) != workload.output_len]
        out["engine"] = {
            "system": PHASE_TITLES["engine"], "requests": len(results), "completed": len(results),
            "seconds": round(seconds, 3), "output_tokens": tokens, "output_tokens_per_s": round(tokens / seconds, 1),
            "engine_start_s": round(start_s, 1), "kv_blocks": after.num_blocks_total,
            "engine_steps": after.num_steps_total - before.num_steps_total,
            "preemptions": after.num_preemptions_total - before.num_preemptions_total,
            "warmup_requests": len(warm_ids), "device": config.device,
            "checks": {"requests_with_exact_output_len": len(results) - len(wrong), "all_ok": not wrong,
                       "failures": [f"request {i}: {len(results[i].token_ids)} tokens" for i in wrong[:MAX_CHECK_EXAMPLES]]},
        }
        print(f"[engine] {len(results)} requests: {tokens:,} output tokens in {seconds:.2f} s = "
              f"{tokens / seconds:,.1f} tokens/s", flush=True)
        del llm, results
    loaded = engine.loaded
    del engine  # its KV cache and CUDA graphs go; the weights stay for transformers
    out["memory_after_engine"] = free_gpu_memory()
    if run_transformers:
        try:
            out["transformers"] = transformers_phase(loaded, prompt_ids, workload, transformers_batch)
        except Exception as error:  # noqa: BLE001 - e.g. out of memory: reported, the server phases still run
            out["errors"] = {"transformers": f"{type(error).__name__}: {error}"}
            print(f"[transformers] FAILED: {out['errors']['transformers']}", flush=True)
    del loaded
    out["memory_before_server"] = free_gpu_memory()
    if torch.cuda.is_available():
        print(f"[gpu] after freeing: {out['memory_before_server']}", flush=True)
    return out


def transformers_phase(loaded, prompt_ids: list[list[int]], workload: Workload, transformers_batch: int) -> dict:
    """(d) `generate` at batch `transformers_batch` over the first prompts, on `loaded`'s weights."""
    from perf import bench_gpu

    model = None
    try:
        model = bench_gpu.hf_model_from_loaded(loaded)
        batch = min(transformers_batch, len(prompt_ids))
        prompts = prompt_ids[:batch]
        bench_gpu.hf_generate_s(model, prompts[: min(8, batch)], 4)  # warm-up
        seconds = bench_gpu.hf_generate_s(model, prompts, workload.output_len)
        tokens = batch * workload.output_len
    finally:
        del model
        free_gpu_memory()
    import transformers

    print(f"[transformers] generate batch {batch}: {tokens:,} tokens in {seconds:.2f} s = "
          f"{tokens / seconds:,.1f} tokens/s", flush=True)
    return {"system": f"{PHASE_TITLES['transformers']} at batch {batch}", "requests": batch, "completed": batch,
            "batch": batch, "seconds": round(seconds, 3), "output_tokens": tokens,
            "output_tokens_per_s": round(tokens / seconds, 1), "transformers_version": transformers.__version__,
            "dtype": str(loaded.dtype).removeprefix("torch.")}


def _in_process_child(result_queue, *args) -> None:
    """(a) and (d) in a process of their own: when it exits the GPU is certainly free for the
    server, whatever a reference kept alive."""
    try:
        result_queue.put(in_process_phases(*args))
    except BaseException as error:  # noqa: BLE001 - reported by the parent
        import traceback

        traceback.print_exc()
        result_queue.put({"errors": {"engine": f"{type(error).__name__}: {error}"}})


def run_in_process_phases(*args, separate_process: bool = True) -> dict:
    """`in_process_phases(*args)`, by default in a spawned child process (the engine still
    runs in-process there: `LLM.generate`, no server)."""
    if not separate_process:
        return in_process_phases(*args)
    context = multiprocessing.get_context("spawn")
    result_queue = context.Queue()
    child = context.Process(target=_in_process_child, args=(result_queue, *args))
    child.start()
    try:
        while True:
            try:
                return result_queue.get(timeout=5)
            except queue.Empty:
                if not child.is_alive():
                    return {"errors": {"engine": f"the engine's process died (exit status {child.exitcode})"}}
    finally:
        child.join(timeout=120)
        if child.is_alive():
            child.kill()


# --- (b) and (c): client processes ---------------------------------------------------------------


@dataclass
class ClientRecord:
    """What one client saw of one request (times: monotonic seconds)."""

    index: int
    send: float = 0.0
    first_token: float | None = None
    end: float | None = None
    responses: int = 0  # responses that carried tokens
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    num_output_tokens: int | None = None
    num_input_tokens: int | None = None
    finish_reason: str = ""
    error: str | None = None


async def _stream_one(client, inputs, record: ClientRecord, deadline: float, model: str = "ensemble") -> None:
    """One request as its own gRPC stream, to its final response (or the deadline: cancelled)."""
    finished = asyncio.Event()
    pieces: list[str] = []

    async def request_iterator():
        yield {"model_name": model, "inputs": inputs, "request_id": str(record.index),
               "parameters": {"triton_enable_empty_final_response": True}}
        await finished.wait()  # the stream stays open until the final response

    record.send = time.monotonic()
    responses = client.stream_infer(request_iterator())

    async def consume():
        async for result, error in responses:
            if error is not None:
                record.error = str(error)
                return
            response = result.get_response()
            if response.outputs:
                ids = result.as_numpy("output_ids").reshape(-1)
                if ids.size:
                    if record.first_token is None:
                        record.first_token = time.monotonic()
                    record.responses += 1
                    record.token_ids.extend(ids.tolist())
                text = result.as_numpy("text_output").reshape(-1)[0]
                pieces.append(text.decode("utf-8") if isinstance(text, bytes) else str(text))
                record.num_output_tokens = int(result.as_numpy("num_output_tokens").reshape(-1)[0])
                record.num_input_tokens = int(result.as_numpy("num_input_tokens").reshape(-1)[0])
                reason = result.as_numpy("finish_reason").reshape(-1)[0]
                record.finish_reason = reason.decode() if isinstance(reason, bytes) else str(reason)
            if response.parameters["triton_final_response"].bool_param:
                record.end = time.monotonic()
                return

    try:
        await asyncio.wait_for(consume(), timeout=max(deadline - time.monotonic(), 0.001))
    except asyncio.TimeoutError:
        record.error = "incomplete: the time limit passed"
        responses.cancel()
    except Exception as error:  # noqa: BLE001 - a transport error fails this request only
        record.error = f"{type(error).__name__}: {error}"
        responses.cancel()
    finally:
        finished.set()
        record.text = "".join(pieces)


async def run_requests(url: str, indexed_inputs: list[tuple[int, dict]], max_seconds: float,
                       ready=None, wait_for_start=None) -> list[ClientRecord]:
    """Send every request at once on one client; requests still open `max_seconds` after
    the start are cancelled. `ready()` / `wait_for_start()`: a client process's handshake
    with the parent (connected; then blocks until all processes start together)."""
    import tritonclient.grpc.aio as aio

    from perf.loadgen import make_inputs

    client = aio.InferenceServerClient(url)
    try:
        inputs = [(index, make_inputs(values)) for index, values in indexed_inputs]
        await client.is_server_ready()  # the channel is up before the start
        if ready is not None:
            ready()
        if wait_for_start is not None:
            await asyncio.to_thread(wait_for_start)
        deadline = time.monotonic() + max_seconds
        records = [ClientRecord(index) for index, _ in inputs]
        await asyncio.gather(*(_stream_one(client, tensors, record, deadline)
                               for (_, tensors), record in zip(inputs, records)))
        return records
    finally:
        await client.close()


def _client_process(url: str, indexed_inputs: list[tuple[int, dict]], max_seconds: float, ready_queue,
                    start_event, result_queue) -> None:
    """A client process: connects, says it is ready, waits for the start, sends its slice,
    and puts its records and the CPU time it used from the start on `result_queue`."""
    cpu_at_start = [0.0]

    def wait_for_start() -> None:
        start_event.wait()
        cpu_at_start[0] = time.process_time()

    try:
        records = asyncio.run(run_requests(url, indexed_inputs, max_seconds,
                                           ready=lambda: ready_queue.put(os.getpid()), wait_for_start=wait_for_start))
        result_queue.put({"pid": os.getpid(), "cpu_s": time.process_time() - cpu_at_start[0],
                          "records": [asdict(r) for r in records]})
    except BaseException as error:  # noqa: BLE001 - reported to the parent, which fails the phase
        ready_queue.put(os.getpid())  # never leave the parent waiting for this one
        result_queue.put({"pid": os.getpid(), "error": f"{type(error).__name__}: {error}"})


def process_group_cpu_s(pgid: int) -> dict[str, float]:
    """CPU seconds (user + system) used so far by each live process of a process group
    (the server, its Python backend stubs), summed by command name; a stub is named by its
    model too (`triton_python_backend_stub[engine]`: the engine's own process apart from the
    tokenizer models'); {} where /proc is absent."""
    ticks = os.sysconf("SC_CLK_TCK")
    by_name: dict[str, float] = {}
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else []:
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        name = stat[stat.index("(") + 1: stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        # fields[0] is the state (stat field 3): pgrp is field 5, utime 14, stime 15.
        if int(fields[2]) != pgid:
            continue
        if name.startswith("triton_python_b"):  # the kernel keeps 15 characters of the name
            try:  # argv[1] is <repository>/<model>/<version>/model.py
                argv = (entry / "cmdline").read_bytes().split(b"\0")
                if argv[0].endswith(b"triton_python_backend_stub"):
                    name = f"triton_python_backend_stub[{Path(argv[1].decode()).parent.parent.name}]"
            except (OSError, IndexError):
                pass
        by_name[name] = by_name.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / ticks
    return by_name


def _percentiles_ms(values: list[float]) -> dict:
    if not values:
        return {"p50": None, "p99": None}
    array = np.asarray(values) * 1000
    return {"p50": round(float(np.percentile(array, 50)), 1), "p99": round(float(np.percentile(array, 99)), 1)}


def check_records(records: list[dict], workload: Workload, tokenizer) -> dict:
    """Every token delivered: per request the ids received number exactly the output
    length, the server's num_output_tokens and num_input_tokens agree, and the text pieces
    concatenate to the decode of those ids (the streaming text contract)."""
    from inflightllm.detokenizer import decode_text

    counts = {"completed": 0, "tokens_exact": 0, "num_output_tokens_exact": 0, "num_input_tokens_exact": 0,
              "text_equals_decoded_ids": 0}
    failures = []
    for record in records:
        problems = []
        if record["error"] is not None or record["end"] is None:
            problems.append(f"not completed: {record['error']}")
        else:
            counts["completed"] += 1
        if len(record["token_ids"]) == workload.output_len:
            counts["tokens_exact"] += 1
        else:
            problems.append(f"{len(record['token_ids'])} token ids received, not {workload.output_len}")
        if record["num_output_tokens"] == workload.output_len:
            counts["num_output_tokens_exact"] += 1
        else:
            problems.append(f"num_output_tokens {record['num_output_tokens']}")
        if record["num_input_tokens"] == workload.input_len:
            counts["num_input_tokens_exact"] += 1
        else:
            problems.append(f"num_input_tokens {record['num_input_tokens']}, not {workload.input_len}")
        if record["text"] == decode_text(tokenizer, record["token_ids"]):
            counts["text_equals_decoded_ids"] += 1
        else:
            problems.append("the text pieces do not concatenate to the decode of the ids")
        if problems:
            failures.append(f"request {record['index']}: " + "; ".join(problems))
    return {**counts, "requests": len(records), "all_ok": not failures, "failures": failures[:MAX_CHECK_EXAMPLES],
            "num_failed_requests": len(failures)}


def server_phase(name: str, url: str, texts: list[str], workload: Workload, stream: bool, client_procs: int,
                 max_seconds: float, tokenizer, server_pgid: int | None) -> dict:
    """All requests at once from `client_procs` processes; figures and checks."""
    values = [(i, request_inputs(text, workload.output_len, stream)) for i, text in enumerate(texts)]
    procs_count = max(1, min(client_procs, len(values)))
    slices = [values[i::procs_count] for i in range(procs_count)]
    context = multiprocessing.get_context("spawn")  # no fork of a process that holds CUDA or gRPC state
    ready_queue, result_queue, start_event = context.Queue(), context.Queue(), context.Event()
    processes = [context.Process(target=_client_process, args=(url, part, max_seconds, ready_queue, start_event,
                                                               result_queue), daemon=True) for part in slices]
    for process in processes:
        process.start()
    try:
        for _ in processes:
            ready_queue.get(timeout=300)
        server_cpu_before = process_group_cpu_s(server_pgid) if server_pgid else {}
        started = time.monotonic()
        start_event.set()
        outcomes = [result_queue.get(timeout=max_seconds + 120) for _ in processes]
        wall = time.monotonic() - started
        server_cpu_after = process_group_cpu_s(server_pgid) if server_pgid else {}
    finally:
        for process in processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
    errors = [outcome["error"] for outcome in outcomes if "error" in outcome]
    records = sorted((r for outcome in outcomes for r in outcome.get("records", [])), key=lambda r: r["index"])
    done = [r for r in records if r["end"] is not None and r["error"] is None]
    seconds = (max(r["end"] for r in done) - started) if done else wall
    tokens = sum(len(r["token_ids"]) for r in done)
    responses = sum(r["responses"] for r in done)
    client_cpu = [outcome.get("cpu_s", 0.0) for outcome in outcomes]
    server_cpu = {name_: round(server_cpu_after.get(name_, 0.0) - server_cpu_before.get(name_, 0.0), 2)
                  for name_ in server_cpu_after}
    checks = check_records(records, workload, tokenizer)
    if errors:
        checks["all_ok"] = False
        checks["failures"] = (errors + checks["failures"])[:MAX_CHECK_EXAMPLES]
    if len(records) != len(texts):
        checks["all_ok"] = False
        checks["failures"].insert(0, f"{len(texts) - len(records)} request(s) never reported by a client")
    result = {
        "system": PHASE_TITLES[name], "stream": stream, "requests": len(texts), "completed": len(done),
        "seconds": round(seconds, 3), "output_tokens": tokens, "output_tokens_per_s": round(tokens / seconds, 1),
        "responses": responses, "responses_per_s": round(responses / seconds, 1),
        "tokens_per_response": round(tokens / responses, 3) if responses else None,
        "ttft_ms": _percentiles_ms([r["first_token"] - r["send"] for r in done if r["first_token"] is not None]),
        "e2e_ms": _percentiles_ms([r["end"] - r["send"] for r in done]),
        "send_spread_ms": round((max(r["send"] for r in records) - min(r["send"] for r in records)) * 1000, 1)
        if records else None,
        # On the host's monotonic clock, as the engine's step and sender traces (INFLIGHTLLM_STEP_TRACE,
        # clock_s): where the client's time went before the first step and after the last.
        "clock_s": {"start": round(started, 6),
                    "first_send": round(min(r["send"] for r in records), 6) if records else None,
                    "first_end": round(min(r["end"] for r in done), 6) if done else None,
                    "last_end": round(max(r["end"] for r in done), 6) if done else None},
        "client": {"processes": len(processes), "cpu_s": round(sum(client_cpu), 2),
                   "cores_used": round(sum(client_cpu) / wall, 2) if wall else None,
                   "busiest_process_share": round(max(client_cpu) / wall, 2) if wall and client_cpu else None,
                   "machine_cores": os.cpu_count()},
        "server_cpu": {"cores_used": round(sum(server_cpu.values()) / wall, 2) if wall and server_cpu else None,
                       "cpu_s_by_process": dict(sorted(server_cpu.items(), key=lambda kv: -kv[1])[:6])},
        "checks": checks,
    }
    print(f"[{name}] {len(done)}/{len(texts)} requests: {tokens:,} tokens in {seconds:.2f} s = "
          f"{result['output_tokens_per_s']:,.1f} tokens/s, {responses:,} responses; client CPU "
          f"{result['client']['cores_used']} cores ({len(processes)} processes, busiest "
          f"{result['client']['busiest_process_share']}); checks {'OK' if checks['all_ok'] else 'FAILED'}", flush=True)
    for failure in checks["failures"]:
        print(f"[{name}]   {failure}", flush=True)
    return result


def server_phases(profile_path: Path, overrides: dict, workload: Workload, texts: dict[str, list[str]],
                  warm_texts: list[str], args, tokenizer, options) -> dict:
    """(b) and (c) against one server started for the profile."""
    from perf import servers

    def run(url: str, pgid: int | None) -> None:
        if warm_texts:
            warm = [(i, request_inputs(t, workload.output_len, True)) for i, t in enumerate(warm_texts)]
            asyncio.run(run_requests(url, warm, args.max_seconds))
        for name, stream in (("nostream", False), ("stream", True)):
            if name in texts:
                out[name] = server_phase(name, url, texts[name], workload, stream, args.client_procs,
                                         args.max_seconds, tokenizer, pgid)

    out: dict = {}
    if args.url:  # a server already running (for this profile: the caller's word); its CPU is not seen
        out["server"] = {"url": args.url}
        run(args.url, None)
        return out
    started = time.perf_counter()
    with servers.serve_profile(profile_path, overrides, suffix="bench", options=options,
                               timeout=args.server_timeout,
                               postprocessing_dynamic_batching=args.postprocessing_dynamic_batching) as served:
        out["server"] = {**served.describe(), "start_s": round(time.perf_counter() - started, 1)}
        print(f"[server] ready in {out['server']['start_s']} s (gRPC {served.server.grpc_url})", flush=True)
        out["server"]["placement"] = engine_placement(served.server.metrics_url)
        for line in out["server"]["placement"]:
            print(f"[server] engine instance {line['instance']} runs on {line['gpu']}", flush=True)
        run(served.server.grpc_url, served.server.process.pid)
    return out


def engine_placement(metrics_url: str) -> list[dict]:
    """Each engine instance's device as the instance itself reports it (the
    `inflightllm_engine_gpu` gauge, set from where its weights are): [{instance, gpu}]."""
    from perf.loadgen import fetch_metrics

    prefix = "inflightllm_engine_gpu{"
    found = []
    for key in fetch_metrics(metrics_url):
        if key.startswith(prefix):
            labels = dict(item.split("=", 1) for item in key[len(prefix):-1].split(","))
            found.append({"instance": labels.get("instance", "?"), "gpu": labels.get("gpu", "?")})
    return sorted(found, key=lambda item: item["instance"])


# --- the report -----------------------------------------------------------------------------------


def _fmt(value, digits: int = 1) -> str:
    return "—" if value is None else f"{value:,.{digits}f}"


def ratios(phases: dict) -> dict:
    """(b)/(a), (c)/(a) and (a)/(d) of output tokens/s."""
    def rate(name):
        return (phases.get(name) or {}).get("output_tokens_per_s")

    engine = rate("engine")
    out = {}
    for name in ("nostream", "stream"):
        if engine and rate(name):
            value = rate(name) / engine
            out[f"{name}_over_engine"] = {"value": round(value, 3), "goal": GOALS[name], "met": value >= GOALS[name]}
    if engine and rate("transformers"):
        out["engine_over_transformers"] = {"value": round(engine / rate("transformers"), 2)}
    return out


def markdown(report: dict) -> str:
    meta, phases = report["meta"], report["phases"]
    lines = [f"# Engine-only vs tritonserver vs `transformers` ({report['profile_name']})", "",
             f"{meta['date_utc']} UTC, commit `{meta['commit']}`, {meta['machine']}"
             f"{', ' + meta['gpu'] if meta.get('gpu') else ''}, load average {meta.get('load_average_1m_at_start')} "
             "at the start", "", f"Command: `{meta['command']}`", "", f"Workload: {report['workload_text']}.", "",
             "| system | done | seconds | output tokens | output tok/s | vs engine-only | responses | TTFT p50 / p99 ms | "
             "client CPU (cores) | server CPU (cores) | every token delivered |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    engine_rate = (phases.get("engine") or {}).get("output_tokens_per_s")
    for name in ("engine", "nostream", "stream", "transformers"):
        phase = phases.get(name)
        if not phase:
            continue
        vs = f"{phase['output_tokens_per_s'] / engine_rate:.2f}x" if engine_rate else "—"
        ttft = phase.get("ttft_ms") or {}
        checks = phase.get("checks")
        delivered = "—" if not checks else ("yes" if checks["all_ok"] else f"NO ({checks.get('num_failed_requests', '?')} failed)")
        lines.append(
            f"| {phase['system']} | {phase['completed']}/{phase['requests']} | {phase['seconds']:.2f} | "
            f"{phase['output_tokens']:,} | {_fmt(phase['output_tokens_per_s'])} | {vs} | "
            f"{_fmt(phase.get('responses'), 0)} | {_fmt(ttft.get('p50'), 0)} / {_fmt(ttft.get('p99'), 0)} | "
            f"{_fmt((phase.get('client') or {}).get('cores_used'), 2)} | "
            f"{_fmt((phase.get('server_cpu') or {}).get('cores_used'), 2)} | {delivered} |")
    lines.append("")
    for name, error in (report.get("errors") or {}).items():
        lines.append(f"- **{name} failed**: {error.splitlines()[0][:300] if error else ''}")
    for key, label in (("nostream_over_engine", "(b)/(a) stream=false"), ("stream_over_engine", "(c)/(a) stream=true")):
        ratio = report["ratios"].get(key)
        if ratio:
            lines.append(f"- {label}: **{ratio['value']:.2f}** (goal ≥ {ratio['goal']:.2f}: "
                         f"{'met' if ratio['met'] else 'not met'})")
    if "engine_over_transformers" in report["ratios"]:
        lines.append(f"- (a)/(d) engine-only over `transformers`: {report['ratios']['engine_over_transformers']['value']:.2f}x")
    server = report.get("server") or {}
    if "start_s" in server:
        lines.append(f"- server: started in {server['start_s']} s; stream_interval {server.get('stream_interval')}, "
                     f"max_batch_size {server.get('max_batch_size')}, max_num_tokens {server.get('max_num_tokens')}; "
                     f"{report['client_procs']} client processes")
    elif server:
        lines.append(f"- server: the running one at {server.get('url')}; {report['client_procs']} client processes")
    if server.get("placement"):
        lines.append("- engine instances, each as it reports itself (`inflightllm_engine_gpu`): "
                     + ", ".join(f"{item['instance']} on {item['gpu']}" for item in server["placement"]))
    for name in ("nostream", "stream"):
        phase = phases.get(name)
        if phase and phase["server_cpu"]["cpu_s_by_process"]:
            busiest = ", ".join(f"{k} {v:.1f} s" for k, v in phase["server_cpu"]["cpu_s_by_process"].items())
            lines.append(f"- server CPU during {name}: {busiest}")
    return "\n".join(lines) + "\n"


def write_report(report: dict, out_dir: Path, name: str | None = None, plots: bool = True) -> list[Path]:
    """`out_dir`/`name`.json and .md, and -bars.png when matplotlib is there."""
    from perf import plots as plotting

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    name = name or f"bench_gpu_server-{report['profile_name']}"
    json_path, md_path = out_dir / f"{name}.json", out_dir / f"{name}.md"
    json_path.write_text(json.dumps(report, indent=1) + "\n")
    md_path.write_text(markdown(report))
    written = [json_path, md_path]
    if plots and plotting.available():
        phases = report["phases"]
        values = {PHASE_TITLES[key]: [phases[key]["output_tokens_per_s"]] for key in PHASES if phases.get(key)}
        written.append(plotting.bar_chart(["output tokens/s"], [("output tokens/s", values)],
                                          out_dir / f"{name}-bars.png"))
    elif plots:
        print(plotting.MISSING, file=sys.stderr)
    return written


# --- main ---------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    from perf import loadgen, servers

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", type=Path, default=REPO_ROOT / "profiles" / "llama3-8b-h200.yaml")
    parser.add_argument("--set", action="append", metavar="KEY=VALUE", default=[],
                        help="profile override for every phase, e.g. engine.stream_interval=4 (repeatable)")
    parser.add_argument("--num-requests", type=int, default=1024)
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens, exactly")
    parser.add_argument("--output-len", type=int, default=128, help="output tokens, exactly")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--client-procs", type=int, default=8, help="client processes for the server phases")
    parser.add_argument("--transformers-batch", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=64,
                        help="unmeasured requests (other prompts) before the engine-only run and on the server")
    parser.add_argument("--skip", default="", help=f"comma-separated phases to leave out: {', '.join(PHASES)}")
    parser.add_argument("--max-seconds", type=float, default=600.0,
                        help="a server phase's time limit: requests still open then are cancelled and fail")
    parser.add_argument("--server-timeout", type=float, default=900.0, help="seconds the server may take to start")
    parser.add_argument("--url", default=None,
                        help="use this running server (gRPC HOST:PORT) of the same profile instead of starting one")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "build" / "bench-gpu-server",
                        help="folder for the JSON, markdown and plot")
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument("--postprocessing-dynamic-batching", action="store_true",
                        help="a measurement switch: postprocessing behind a dynamic batcher (perf/servers.py; "
                             "client cancellations then do not reach the engine)")
    parser.add_argument("--same-process", action="store_true",
                        help="run (a) and (d) in this process rather than a child process of their own")
    servers.add_server_arguments(parser)
    args = parser.parse_args(argv)
    skip = {item.strip() for item in args.skip.split(",") if item.strip()}
    unknown = skip - set(PHASES)
    if unknown:
        parser.error(f"--skip: unknown phase(s) {sorted(unknown)}; allowed: {', '.join(PHASES)}")
    options = servers.server_options(args)
    meta = loadgen.run_metadata(loadgen.command_line("perf.bench_gpu_server", argv))  # the commit that ran

    from inflightllm.model_source import load_tokenizer, prepare
    from inflightllm.profile import load_profile

    overrides = servers.parse_overrides(args.set)
    profile_path = servers.variant_profile(args.profile, overrides, "bench")
    profile = load_profile(profile_path)
    workload = Workload(args.num_requests, args.input_len, args.output_len, args.seed)
    prepare(profile.model)
    tokenizer = load_tokenizer(profile.model)
    maker = PromptMaker(tokenizer, workload.input_len)
    texts = {name: maker.texts(workload.num_requests, workload.seed + offset)
             for offset, name in enumerate(("engine", "nostream", "stream"))}
    warm_texts = maker.texts(min(args.warmup, workload.num_requests), workload.seed + 100)
    print(f"[bench] {profile.name}: {workload.describe()}", flush=True)

    report: dict = {"meta": meta, "profile": str(args.profile), "profile_name": profile.name,
                    "overrides": {k: str(v) for k, v in overrides.items()}, "workload": asdict(workload),
                    "workload_text": workload.describe(), "client_procs": args.client_procs, "skipped": sorted(skip),
                    "server_options": options.describe(), "phases": {}}
    errors: dict[str, str] = {}
    if not {"engine", "transformers"} <= skip:
        in_process = run_in_process_phases(
            profile, workload, maker.ids(texts["engine"]), maker.ids(warm_texts), "engine" not in skip,
            "transformers" not in skip, args.transformers_batch, separate_process=not args.same_process)
        errors.update(in_process.pop("errors", {}))
        report["engine_parameters"] = in_process.pop("engine_parameters", {})
        report["memory"] = {key: in_process.pop(key, {}) for key in ("memory_after_engine", "memory_before_server")}
        report["phases"].update(in_process)
    server_texts = {name: texts[name] for name in ("nostream", "stream") if name not in skip}
    if server_texts:
        try:
            served = server_phases(args.profile, overrides, workload, server_texts, warm_texts, args, tokenizer,
                                   options)
            report["server"] = served.pop("server")
            report["phases"].update(served)
        except Exception as error:  # noqa: BLE001 - e.g. the server did not start: reported with the rest
            errors["server"] = f"{type(error).__name__}: {error}"[:4000]
            print(f"[server] FAILED: {errors['server']}", flush=True)
    report["errors"] = errors
    report["ratios"] = ratios(report["phases"])
    for path in write_report(report, args.out, plots=not args.no_plots):
        print(f"wrote {path}")
    print(markdown(report))
    failed = [name for name, phase in report["phases"].items() if not phase.get("checks", {"all_ok": True})["all_ok"]]
    failed += [f"{name} ({error})" for name, error in errors.items()]
    if failed:
        print(f"bench_gpu_server: checks FAILED in {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
