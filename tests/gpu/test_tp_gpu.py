"""Tensor parallelism on 2 GPUs (NCCL, CUDA graphs on every rank): fp32 greedy ids of
TP=2 equal TP=1 on the same safetensors weights (in-flight, chunked prefill), with the small
all-reduces on the custom one-shot kernel, on NCCL, and fused into the small-batch kernels;
the fused all-reduce gives the all-reduce kernel's bits; the custom all-reduce alone equals
NCCL bit for bit and lets go of a rank that never arrives; a killed worker fails the step
with a clear error within a bounded time. Needs 2 GPUs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

from inflightllm.config import EngineConfig  # noqa: E402
from inflightllm.engine import Engine  # noqa: E402
from inflightllm.llm import LLM  # noqa: E402
from inflightllm.model_source import ModelSpec  # noqa: E402
from inflightllm.sampling_params import SamplingParams  # noqa: E402
from perf.bench_tp import exact_folder, prompts_of, release  # noqa: E402

needs_two = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")


def config(tp: int, **overrides) -> EngineConfig:
    values = dict(device="gpu", gpu_ids=tuple(range(tp)), tensor_parallel_size=tp, max_batch_size=16,
                  max_num_tokens=256, max_input_length=1024, max_output_len=128, num_kv_blocks=512)
    values.update(overrides)
    return EngineConfig(**values)


REPO_ROOT = Path(__file__).resolve().parent.parent.parent


@needs_two
@pytest.mark.parametrize("custom_all_reduce,small_batch", [("1", "auto"), ("0", "auto"), ("1", "on")],
                         ids=["custom-all-reduce", "nccl-only", "fused-all-reduce-in-small-batch-kernels"])
def test_tp2_greedy_equals_tp1_fp32(custom_all_reduce, small_batch, monkeypatch):
    # the workers inherit the environment; "on": batch-1 steps in the small-batch kernels, whose
    # all-reduce under TP is fused into them (gpu/layers.cu)
    monkeypatch.setenv("INFLIGHTLLM_CUSTOM_ALL_REDUCE", custom_all_reduce)
    monkeypatch.setenv("INFLIGHTLLM_SMALL_BATCH_KERNELS", small_batch)
    spec = ModelSpec(source="hf_folder", path=str(exact_folder()), dtype="float32")
    lengths = [5, 300, 17, 64, 9, 700]
    prompts = [prompts_of(1, n, 49152, seed=n)[0] for n in lengths]
    params = [SamplingParams(max_tokens=20 + 4 * i, ignore_eos=True) for i in range(len(prompts))]
    outputs = {}
    for tp in (1, 2):
        engine = Engine(spec, config(tp), sampler_seed=0)
        try:
            llm = LLM(spec, engine=engine, load_tokenizer_too=False)
            outputs[tp] = [r.token_ids for r in llm.generate(prompts, params, arrival_steps=[0, 0, 1, 2, 4, 7])]
        finally:
            getattr(engine.runner, "shutdown", lambda: None)()
        engine = None
        release()
    assert outputs[2] == outputs[1]


@needs_two
def test_fused_all_reduce_gives_the_bits_of_the_all_reduce_kernel(monkeypatch):
    """bf16 TP=2, one request at a time (every decode step at batch 1 in the small-batch
    kernels): with the o/down all-reduce fused into the kernels, the greedy ids equal those
    with the all-reduce kernel between them. The fused sum is the kernel's, in rank order, so
    the logits are the same bits and so are the ids, over every step."""
    spec = ModelSpec(source="hf_folder", path=str(exact_folder()), dtype="bfloat16")
    prompts = [prompts_of(1, n, 49152, seed=n)[0] for n in (7, 120, 33)]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    outputs = {}
    for fused in ("1", "0"):
        monkeypatch.setenv("INFLIGHTLLM_FUSED_ALL_REDUCE", fused)  # read when the ranks set up
        engine = Engine(spec, config(2), sampler_seed=0)
        try:
            # the fused path is taken exactly when asked (rows of 1 KiB: within a slot)
            assert (engine.runner.dist.tp.fused_all_reduce(1024) is not None) == (fused == "1")
            llm = LLM(spec, engine=engine, load_tokenizer_too=False)
            outputs[fused] = [llm.generate([prompt], params)[0].token_ids for prompt in prompts]
        finally:
            getattr(engine.runner, "shutdown", lambda: None)()
        engine = None
        release()
    assert all(len(ids) == 40 for ids in outputs["1"])
    assert outputs["1"] == outputs["0"]


@needs_two
def test_custom_all_reduce_equals_nccl_and_lets_go_of_a_missing_rank():
    # Its own processes (one per GPU), as the ranks are: perf/bench_allreduce.py's checks.
    result = subprocess.run(
        [sys.executable, "perf/bench_allreduce.py", "--sections", "check,abort"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "custom all-reduce: PASS" in result.stdout


@needs_two
def test_killed_worker_fails_the_step_clearly():
    spec = ModelSpec(source="hf_folder", path=str(exact_folder()), dtype="bfloat16")
    engine = Engine(spec, config(2, step_timeout_s=10.0, max_output_len=512), sampler_seed=0)
    runner = engine.runner
    try:
        for i in range(4):
            engine.add_request(f"f{i}", [5, 6, 7 + i], SamplingParams(max_tokens=500, ignore_eos=True))
        for _ in range(5):
            engine.step()
        os.kill(runner.workers[0].pid, signal.SIGKILL)
        # The step's requests fail alone with the reason; the engine goes on, not ready.
        errors = {}
        started = time.monotonic()
        for _ in range(400):
            for output in engine.step():
                if output.error is not None:
                    errors[output.request_id] = output.error
            if not engine.has_unfinished():
                break
        assert time.monotonic() - started < 15
        assert sorted(errors) == ["f0", "f1", "f2", "f3"]
        assert all("tensor-parallel worker rank 1" in message and "killed by signal 9" in message
                   for message in errors.values()), errors
        assert not runner.healthy
        engine.add_request("late", [5, 6], SamplingParams(max_tokens=4, ignore_eos=True))
        late = [output for output in engine.step() if output.request_id == "late"]
        assert late and "engine not ready" in late[0].error
    finally:
        started = time.monotonic()
        runner.shutdown()
        assert time.monotonic() - started < 30


@needs_two
def test_an_engine_on_gpu_1_steps_from_another_thread():
    """A data-parallel instance: the engine is loaded on GPU 1 in one thread and stepped from
    another (the server's engine loop), where the current device is GPU 0 unless the runner
    sets it; its ids equal an engine's on GPU 0, which ran first in the same process (each
    engine captures its graphs on a stream of its own GPU: torch's default capture stream
    belongs to the GPU of the first capture)."""
    import threading

    spec = ModelSpec(source="hf_folder", path=str(exact_folder()), dtype="float32")
    prompts = [prompts_of(1, n, 49152, seed=n)[0] for n in (5, 40, 300)]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    outputs = {}
    for gpu in (0, 1):
        engine = Engine(spec, config(1, gpu_ids=(gpu,)), sampler_seed=0)
        llm = LLM(spec, engine=engine, load_tokenizer_too=False)
        result: dict = {}

        def generate(llm=llm, result=result):
            try:
                result["ids"] = [r.token_ids for r in llm.generate(prompts, [params] * len(prompts))]
            except Exception as error:  # noqa: BLE001 - reported below
                result["error"] = error

        thread = threading.Thread(target=generate)
        thread.start()
        thread.join(120)
        assert "error" not in result, result.get("error")
        outputs[gpu] = result["ids"]
        assert engine.loaded.model.embed.device == torch.device("cuda", gpu)
        llm = engine = None
        release()
    assert outputs[1] == outputs[0]
