"""Multi-GPU benchmark and checks of tensor parallelism (one run on a 2-GPU host).

Sections (in this order, each result saved to --out as soon as it exists):
- `exact`: fp32 greedy ids of TP=2 equal TP=1 on the same weights: a Llama-shaped model
  (8 heads, 4 KV heads, head_dim 64) with random weights saved as safetensors, loaded by
  both engines (the TP ranks slice what they read), in-flight with chunked prefill.
- `failure`: a TP=2 engine on GPUs (NCCL) whose worker is killed mid-decode: the seconds
  until the step raises, and its message.
- `decode`: the decode step at batch 1 (and `--batches`) of `--shape` in bf16, TP=1 on
  GPU 0 vs TP=2 on GPUs 0,1, CUDA graphs on: the time between tokens over consecutive
  steps, and the median of single steps drained before and after (bench_gpu.decode_step_ms).
  Where the shape `<shape>-tp2-rank` exists (one TP=2 rank's weights and KV heads), also that
  shape on GPU 0 alone (`tp2_rank_alone`): a rank's work without communication, so that
  TP=2 minus it is what the all-reduces and the ranks' lockstep cost.
- `profile`: with `decode`, a torch profiler trace of rank 0 over 20 decode steps at
  batch 1 (NCCL kernels on rank 0 include the time spent waiting for the peer), and rank
  0's host time per step (broadcast, launch, waiting for the result). Workers log theirs
  when INFLIGHTLLM_TP_TIMING is set.
- `throughput`: 1,024 requests of 128/128 tokens, engine-only: TP=2 vs 2 data-parallel
  engines (one process per GPU, half the requests each; output tokens/s summed).

    python perf/bench_tp.py --out $OUT/bench_tp.json
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from inflightllm.config import EngineConfig  # noqa: E402
from inflightllm.engine import Engine  # noqa: E402
from inflightllm.llm import LLM  # noqa: E402
from inflightllm.model_source import ModelSpec  # noqa: E402
from inflightllm.sampling_params import SamplingParams  # noqa: E402
from perf.bench_gpu import decode_step_ms, host_ms_per_step, profile_decode, reset_host_times  # noqa: E402

REPORT: dict = {}
ASYNC_SCHEDULING = True  # --sync-scheduling turns it off (TP figures before 2026-11-30 late night were taken so: git log -p docs/PERFORMANCE.md)


def save(out: Path | None) -> None:
    if out is not None:
        out.write_text(json.dumps(REPORT, indent=2))


def close(engine: Engine) -> None:
    """Stop an engine's workers; the caller drops its reference, then `release()`."""
    shutdown = getattr(engine.runner, "shutdown", None)
    if shutdown:
        shutdown()


def release() -> None:
    """Give freed GPU memory back (torch's cache and CuPy's pool: the KV cache is CuPy's)."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    try:
        import cupy

        for index in range(torch.cuda.device_count()):
            with cupy.cuda.Device(index):
                cupy.get_default_memory_pool().free_all_blocks()
    except ImportError:
        pass


def prompts_of(count: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 1, (count, length), generator=generator).tolist()


_FOLDER: list[Path] = []


def exact_folder() -> Path:
    """A Llama-shaped fp32 model whose heads TP=2 divides (smollm2-135m's 9 do not),
    saved as safetensors once."""
    if _FOLDER:
        return _FOLDER[0]
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = Path(tempfile.mkdtemp(prefix="tp-exact-"))
    config = LlamaConfig(
        hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
        num_key_value_heads=4, head_dim=64, vocab_size=49152, max_position_embeddings=4096,
        rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(folder, safe_serialization=True)
    _FOLDER.append(folder)
    return folder


def section_exact(args) -> None:
    spec = ModelSpec(source="hf_folder", path=str(exact_folder()), dtype="float32")
    lengths = [5, 300, 17, 64, 9, 700, 33, 120]
    prompts = [prompts_of(1, n, 49152, seed=n)[0] for n in lengths]
    params = [SamplingParams(max_tokens=24 + 4 * i, ignore_eos=True) for i in range(len(prompts))]
    arrivals = [0, 0, 1, 2, 3, 5, 8, 13]
    outputs = {}
    for tp in (1, 2):
        config = EngineConfig(device="gpu", gpu_ids=tuple(range(tp)), tensor_parallel_size=tp, max_batch_size=16,
                              max_num_tokens=256, max_input_length=1024, max_output_len=128, num_kv_blocks=512)
        engine = Engine(spec, config, sampler_seed=0)
        outputs[tp] = [r.token_ids for r in LLM(spec, engine=engine, load_tokenizer_too=False).generate(
            prompts, params, arrival_steps=arrivals)]
        close(engine)
        engine = None
        release()
    equal = sum(a == b for a, b in zip(outputs[1], outputs[2]))
    REPORT["exact_fp32"] = {"requests": len(prompts), "equal": equal,
                            "first_diff": next(([i, a, b] for i, (a, b) in enumerate(zip(outputs[1], outputs[2]))
                                                if a != b), None)}
    print(f"fp32 greedy TP=2 vs TP=1: {equal}/{len(prompts)} requests equal", flush=True)


def section_failure(args) -> None:
    spec = ModelSpec(source="hf_folder", path=str(exact_folder()), dtype="bfloat16")
    config = EngineConfig(device="gpu", gpu_ids=(0, 1), tensor_parallel_size=2, max_batch_size=8,
                          max_num_tokens=256, max_input_length=256, max_output_len=512, num_kv_blocks=256,
                          step_timeout_s=10.0)
    engine = Engine(spec, config, sampler_seed=0)
    for i in range(4):
        engine.add_request(f"f{i}", [5, 6, 7 + i], SamplingParams(max_tokens=500, ignore_eos=True))
    for _ in range(5):
        engine.step()
    (worker,) = engine.runner.workers
    os.kill(worker.pid, signal.SIGKILL)
    start = time.monotonic()
    errors: dict[str, str] = {}
    elapsed = None
    for _ in range(400):  # the in-flight requests fail with the reason; the engine goes on
        for output in engine.step():
            if output.error is not None:
                errors[output.request_id] = output.error
        if len(errors) == 4:
            elapsed = time.monotonic() - start
            break
    engine.add_request("late", [5, 6], SamplingParams(max_tokens=4, ignore_eos=True))
    late = [o.error for o in engine.step() if o.request_id == "late"]
    healthy = engine.runner.healthy
    start = time.monotonic()
    engine.runner.shutdown()
    message = next(iter(errors.values()), "no error")
    REPORT["failure_nccl"] = {"requests_failed": len(errors), "all_failed_after_s": round(elapsed, 2) if elapsed else None,
                              "message": message, "late_request": late[0] if late else None,
                              "ready_after": healthy, "shutdown_s": round(time.monotonic() - start, 2)}
    print(f"worker killed: {len(errors)}/4 in-flight requests failed after {elapsed} s: {message}; "
          f"a later request: {late}", flush=True)


def big_config(tp: int, gpu_ids, **overrides) -> EngineConfig:
    """The engine of the GPU profiles (asynchronous scheduling on, as a rendered GPU profile
    has it: `engine.async_scheduling` defaults to true on GPU)."""
    values = dict(device="gpu", gpu_ids=tuple(gpu_ids), tensor_parallel_size=tp, max_batch_size=256,
                  max_num_tokens=8192, max_input_length=1024, max_output_len=1024, gpu_memory_utilization=0.85,
                  async_scheduling=ASYNC_SCHEDULING)
    values.update(overrides)
    return EngineConfig(**values)


def section_decode_and_throughput(args, sections) -> None:
    from inflightllm.models.shapes import SHAPES

    batches = [int(b) for b in args.batches.split(",")]
    prompts = None
    runs = [(1, "tp1", args.shape), (2, "tp2", args.shape)]
    if "decode" in sections and f"{args.shape}-tp2-rank" in SHAPES:
        runs.append((1, "tp2_rank_alone", f"{args.shape}-tp2-rank"))
    for tp, label, shape in runs:
        if label == "tp1" and "decode" not in sections:
            continue
        spec = ModelSpec(source="random", shape=shape, seed=0, dtype="bfloat16")
        start = time.monotonic()
        try:
            engine = Engine(spec, big_config(tp, range(tp)), sampler_seed=0)
        except Exception as error:  # noqa: BLE001 - record, then try without CUDA graphs
            logging.exception("TP=%d engine with CUDA graphs failed", tp)
            REPORT[f"tp{tp}_graphs_error"] = f"{type(error).__name__}: {error}"
            release()
            engine = Engine(spec, big_config(tp, range(tp), cuda_graphs=False), sampler_seed=0)
        REPORT.setdefault("startup_s", {})[label] = round(time.monotonic() - start, 1)
        REPORT.setdefault("cuda_graphs", {})[label] = engine.config.cuda_graphs
        if "decode" in sections:
            for batch in batches:
                times = decode_step_ms(engine, batch)
                ms = times["pipelined"]
                row = REPORT.setdefault("decode_ms", {}).setdefault(f"batch{batch}", {})
                row[label] = round(ms, 3)
                REPORT.setdefault("decode_synced_ms", {}).setdefault(f"batch{batch}", {})[label] = round(
                    times["synced"], 3)
                print(f"{shape} bf16 decode step batch {batch} TP={tp}: {ms:.3f} ms between tokens, "
                      f"{times['synced']:.3f} ms drained around each step", flush=True)
                if label == "tp2_rank_alone" and "tp1" in row and "tp2" in row:
                    print(f"  TP=2 minus one rank's work alone: {row['tp2'] - ms:.3f} ms a step (communication "
                          f"and lockstep); the rank alone is {ms / row['tp1']:.3f}x TP=1", flush=True)
                save(args.out)
            if "profile" in sections and label != "tp2_rank_alone":
                host = getattr(engine.runner, "host_seconds", None)
                if host is not None:
                    reset_host_times(host)
                REPORT.setdefault("profile", {})[f"tp{tp}"] = {"kernels": profile_decode(engine, 1, steps=20)}
                if host is not None and host["steps"]:
                    per_step = host_ms_per_step(host)
                    REPORT["profile"][f"tp{tp}"]["rank0_host_ms_per_step"] = per_step
                    print(f"TP={tp} rank 0 host ms per step: {per_step}", flush=True)
                save(args.out)
        if tp == 2 and "throughput" in sections:
            prompts = prompts_of(args.requests, 128, engine.vocab_size, seed=7)
            params = SamplingParams(max_tokens=128, min_tokens=128, ignore_eos=True)
            llm = LLM(spec, engine=engine, load_tokenizer_too=False)
            llm.generate(prompts[:64], params)
            torch.cuda.synchronize()
            start = time.perf_counter()
            results = llm.generate(prompts, params)
            elapsed = time.perf_counter() - start
            tokens = sum(len(r.token_ids) for r in results)
            REPORT["throughput_tp2"] = {"requests": args.requests, "output_tokens": tokens,
                                        "seconds": round(elapsed, 2), "output_tokens_per_s": round(tokens / elapsed, 1)}
            print(f"TP=2 engine {args.requests} x 128/128: {tokens / elapsed:,.0f} output tokens/s", flush=True)
            llm = None  # it holds the engine (and its KV cache)
        close(engine)
        engine = None
        release()
        save(args.out)


DP_CHILD = r"""
import json, sys, time, torch
sys.path.insert(0, sys.argv[3])
from perf.bench_tp import big_config, prompts_of
from inflightllm.engine import Engine
from inflightllm.llm import LLM
from inflightllm.model_source import ModelSpec
from inflightllm.sampling_params import SamplingParams
gpu, count = int(sys.argv[1]), int(sys.argv[2])
spec = ModelSpec(source="random", shape=sys.argv[4], seed=0, dtype="bfloat16")
engine = Engine(spec, big_config(1, [gpu]), sampler_seed=0)
prompts = prompts_of(2 * count, 128, engine.vocab_size, seed=7)[gpu * count:(gpu + 1) * count]
params = SamplingParams(max_tokens=128, min_tokens=128, ignore_eos=True)
llm = LLM(spec, engine=engine, load_tokenizer_too=False)
llm.generate(prompts[:32], params)
torch.cuda.synchronize()
start = time.perf_counter()
results = llm.generate(prompts, params)
elapsed = time.perf_counter() - start
print("DP_RESULT " + json.dumps({"gpu": gpu, "device": str(engine.loaded.model.embed.device),
      "tokens": sum(len(r.token_ids) for r in results), "seconds": elapsed}), flush=True)
"""


def section_data_parallel(args) -> None:
    root = str(Path(__file__).resolve().parent.parent)
    half = args.requests // 2
    children = [
        subprocess.Popen([sys.executable, "-c", DP_CHILD, str(gpu), str(half), root, args.shape],
                         stdout=subprocess.PIPE, text=True)
        for gpu in (0, 1)
    ]
    results = []
    for child in children:
        out, _ = child.communicate(timeout=300)
        results += [json.loads(line.split(" ", 1)[1]) for line in out.splitlines() if line.startswith("DP_RESULT ")]
    total = sum(r["tokens"] / r["seconds"] for r in results)
    REPORT["throughput_dp2"] = {"instances": results, "output_tokens_per_s": round(total, 1)}
    print(f"2 DP engines {args.requests} x 128/128: {total:,.0f} output tokens/s (sum); {results}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sections", default="exact,failure,decode,profile,throughput,dp")
    parser.add_argument("--shape", default="llama3-8b")
    parser.add_argument("--batches", default="1")
    parser.add_argument("--requests", type=int, default=1024)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--sync-scheduling", action="store_true",
                        help="engines without asynchronous scheduling (step N's tokens read before step N+1 launches)")
    args = parser.parse_args()
    global ASYNC_SCHEDULING
    ASYNC_SCHEDULING = not args.sync_scheduling
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    sections = set(args.sections.split(","))
    REPORT["machine"] = {"gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
                         "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    REPORT["async_scheduling"] = ASYNC_SCHEDULING
    # Each section's failure is recorded and the next one runs. "failure" goes last: it
    # aborts NCCL communicators in this process.
    steps = [
        ("exact", "exact" in sections, lambda: section_exact(args)),
        ("decode", bool(sections & {"decode", "throughput"}), lambda: section_decode_and_throughput(args, sections)),
        ("dp", "dp" in sections, lambda: section_data_parallel(args)),
        ("failure", "failure" in sections, lambda: section_failure(args)),
    ]
    for name, wanted, run in steps:
        if not wanted:
            continue
        try:
            run()
        except Exception as error:  # noqa: BLE001 - record and go on to the next section
            logging.exception("section %s failed", name)
            REPORT[f"{name}_error"] = f"{type(error).__name__}: {error}"
        save(args.out)
    print(json.dumps(REPORT, indent=1))


if __name__ == "__main__":
    main()
