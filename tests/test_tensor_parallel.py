"""Tensor parallelism on CPU (gloo), in process: rank 0 in this process, rank 1 a worker
process it starts. Greedy token ids of TP=2 equal TP=1 on the same fp32 weights (in-flight,
chunked prefill); a worker that dies or hangs fails the step with a clear error, the
runner stays failed (not ready) and shuts down at once; profile and render checks of the
`device:` keys; data-parallel placement."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch
import yaml

from inflightllm.config import EngineConfig
from inflightllm.engine import Engine
from inflightllm.llm import LLM
from inflightllm.model_source import ModelSpec
from inflightllm.parallel.placement import PlacementError, instance_config
from inflightllm.profile import ProfileError, load_profile
from inflightllm.sampling_params import SamplingParams

REPO_ROOT = Path(__file__).resolve().parent.parent
TINY = ModelSpec(source="random", shape="tiny-llama3", seed=0, dtype="float32")
TINY_QWEN = ModelSpec(source="random", shape="tiny-qwen2", seed=1, dtype="float32")  # biases, tied embeddings


def config(**overrides) -> EngineConfig:
    values = dict(max_batch_size=8, max_num_tokens=48, max_input_length=256, max_output_len=64, num_kv_blocks=96)
    values.update(overrides)
    return EngineConfig(**values)


def prompts(count: int) -> list[list[int]]:
    lengths = [5, 70, 17, 33, 9, 40]
    return [
        torch.randint(10, 49152, (lengths[i % len(lengths)],), generator=torch.Generator().manual_seed(i)).tolist()
        for i in range(count)
    ]


def generate(spec, cfg, arrivals=None):
    engine = Engine(spec, cfg, sampler_seed=0)
    try:
        llm = LLM(spec, engine=engine, load_tokenizer_too=False)
        batch = prompts(6)
        params = [SamplingParams(max_tokens=10 + 3 * i, ignore_eos=True) for i in range(len(batch))]
        return [r.token_ids for r in llm.generate(batch, params, arrival_steps=arrivals)]
    finally:
        shutdown = getattr(engine.runner, "shutdown", None)
        if shutdown:
            shutdown()


@pytest.mark.parametrize("spec", [TINY, TINY_QWEN], ids=["llama3", "qwen2"])
def test_tp2_greedy_equals_tp1(spec):
    # max_num_tokens 48 < the 70-token prompt: chunked prefill; staggered arrivals: in-flight.
    arrivals = [0, 0, 2, 3, 5, 8]
    single = generate(spec, config(), arrivals)
    sharded = generate(spec, config(tensor_parallel_size=2), arrivals)
    assert sharded == single


def test_tp2_with_the_host_kv_tier_equals_tp1():
    """Each rank keeps its shard of the evicted blocks in a host tier of its own (the same
    slots on every rank: the step carries them). Second turns whose histories come back from
    host give TP=1's ids (TP=1 without the tier)."""
    from inflightllm.model_source import model_dims

    def chat(cfg):
        engine = Engine(TINY, cfg, sampler_seed=0)
        try:
            llm = LLM(TINY, engine=engine, load_tokenizer_too=False)
            params = [SamplingParams(max_tokens=8, ignore_eos=True)] * 6
            first = prompts(6)
            replies = [r.token_ids for r in llm.generate(first, params)]
            second = [p + r + [11, 12, 13] for p, r in zip(first, replies)]
            return replies + [r.token_ids for r in llm.generate(second, params)], engine.stats()
        finally:
            shutdown = getattr(engine.runner, "shutdown", None)
            if shutdown:
                shutdown()

    per_rank_block = 16 * model_dims(TINY).kv_bytes_per_token(4, 2)
    small = dict(num_kv_blocks=12, max_batch_size=2)
    single, _ = chat(config(**small))
    sharded, stats = chat(config(tensor_parallel_size=2, host_kv_cache_bytes=64 * per_rank_block, **small))
    assert sharded == single
    assert stats.host_kv_blocks_total == 64 and stats.prefix_cache_host_hits > 0


def test_worker_is_a_separate_process_that_ends_with_shutdown():
    engine = Engine(TINY, config(tensor_parallel_size=2), sampler_seed=0)
    runner = engine.runner
    (worker,) = runner.workers
    assert worker.pid != os.getpid() and worker.poll() is None
    assert runner.healthy and runner.num_blocks == 96
    started = time.monotonic()
    runner.shutdown()
    assert worker.poll() is not None
    assert time.monotonic() - started < 15
    runner.shutdown()  # idempotent
    if runner.ring is not None:  # the shared-memory ring (x86-64): removed once all had joined
        assert not runner.ring.path.exists()


def _our_rings() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob(f"inflightllm-tp-{os.getpid()}-*")}


def test_a_worker_that_cannot_start_leaves_no_ring_behind(monkeypatch):
    from inflightllm.parallel import tp_runner

    before = _our_rings()
    monkeypatch.setattr(tp_runner, "python_executable", lambda: "/nonexistent/python3")
    with pytest.raises(FileNotFoundError):
        Engine(TINY, config(tensor_parallel_size=2), sampler_seed=0)
    assert _our_rings() == before


@pytest.mark.parametrize("how", ["kill", "hang"])
def test_a_dead_or_hung_worker_fails_the_step_and_the_runner(how):
    engine = Engine(TINY, config(tensor_parallel_size=2, step_timeout_s=60.0, max_output_len=200), sampler_seed=0)
    runner = engine.runner
    try:
        for index in range(3):
            engine.add_request(f"r{index}", [11, 12, 13 + index], SamplingParams(max_tokens=150, ignore_eos=True))
        for _ in range(3):
            engine.step()
        (worker,) = runner.workers
        runner.step_timeout_s = 3.0  # only now: a busy CI machine may take long over the first steps
        os.kill(worker.pid, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        # The engine fails the step's requests alone (docs/RELIABILITY.md) and goes on;
        # the runner is no longer healthy, so every later step fails its requests too.
        errors = {}
        for _ in range(200):
            for output in engine.step():
                if output.error is not None:
                    errors[output.request_id] = output.error
            if not engine.has_unfinished():
                break
        assert sorted(errors) == ["r0", "r1", "r2"]
        expected = "was killed by signal 9" if how == "kill" else "did not finish within step_timeout_s=3 s"
        assert all(expected in message and "tensor-parallel" in message for message in errors.values()), errors
        assert not runner.healthy
        engine.add_request("late", [11, 12], SamplingParams(max_tokens=4, ignore_eos=True))
        late = [output for output in engine.step() if output.request_id == "late"]
        assert late and "engine not ready" in late[0].error
        # The runner kills it (the stopped one too), on its watchdog thread, right after it
        # publishes the failure that the steps above saw: it may still be on its way out.
        assert worker.wait(timeout=10) is not None
    finally:
        started = time.monotonic()
        runner.shutdown()
        assert time.monotonic() - started < 15


def _profile(tmp_path, device: dict, shape="tiny-llama3", engine: dict | None = None):
    data = {
        "name": "x",
        "model": {"source": "random", "shape": shape, "dtype": "float32"},
        "device": device,
        "engine": {"max_input_length": 256, "max_output_len": 64, **(engine or {})},
    }
    path = tmp_path / "x.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_profile_tensor_parallel_on_cpu_and_step_timeout(tmp_path):
    profile = load_profile(_profile(tmp_path, {"kind": "cpu", "tensor_parallel_size": 2}, engine={"step_timeout_s": 7}))
    assert profile.engine.tensor_parallel_size == 2 and profile.engine.step_timeout_s == 7.0
    with pytest.raises(ProfileError, match=r"engine.step_timeout_s: 0 is out of range"):
        load_profile(_profile(tmp_path, {"kind": "cpu"}, engine={"step_timeout_s": 0}))


def test_profile_refuses_a_size_that_does_not_divide_the_heads(tmp_path):
    # smollm2-135m: 9 heads, 3 KV heads.
    with pytest.raises(ProfileError, match=r"device.tensor_parallel_size: 2 does not divide the model's 3 KV heads"):
        load_profile(_profile(tmp_path, {"kind": "cpu", "tensor_parallel_size": 2}, shape="smollm2-135m"))


def test_profile_data_parallel_needs_tp_times_dp_gpu_ids(tmp_path):
    device = {"kind": "gpu", "gpu_ids": [0, 1, 2], "tensor_parallel_size": 2, "data_parallel_size": 2}
    with pytest.raises(ProfileError, match=r"device.gpu_ids: \[0, 1, 2\] has 3 GPU ids but .* 2 x 2 = 4"):
        load_profile(_profile(tmp_path, device))
    device["gpu_ids"] = [0, 1, 2, 3]
    assert load_profile(_profile(tmp_path, device)).engine.data_parallel_size == 2
    with pytest.raises(ProfileError, match=r"device.data_parallel_size: 2 is not allowed with device.kind 'cpu'"):
        load_profile(_profile(tmp_path, {"kind": "cpu", "data_parallel_size": 2}))


def test_render_refuses_a_gpu_id_the_machine_does_not_have(tmp_path):
    from tools.render_configs import check_devices

    profile = load_profile(_profile(tmp_path, {"kind": "gpu", "gpu_ids": [0, 3], "tensor_parallel_size": 2}))
    with pytest.raises(ProfileError, match=r"device.gpu_ids\[1\]: GPU 3 does not exist on this machine: it has 2 GPU"):
        check_devices(profile, 2)
    assert check_devices(profile, 4) is None
    assert "no GPU is visible" in check_devices(profile, None)


def test_render_data_parallel_instances(tmp_path):
    from tools.render_configs import render_files

    device = {"kind": "gpu", "gpu_ids": [4, 5, 6, 7, 0, 1, 2, 3], "tensor_parallel_size": 2, "data_parallel_size": 4}
    text = render_files(load_profile(_profile(tmp_path, device)))["engine/config.pbtxt"].decode()
    groups = text.split("instance_group [", 1)[1].split("\n]", 1)[0]
    assert groups.count("kind: KIND_GPU") == 4
    assert [line.strip() for line in groups.splitlines() if "gpus" in line] == [
        "gpus: [ 4 ]", "gpus: [ 6 ]", "gpus: [ 0 ]", "gpus: [ 2 ]"
    ]


def test_shipped_multi_gpu_profiles():
    tp2 = load_profile(REPO_ROOT / "profiles" / "llama3-8b-tp2-h200.yaml").engine
    dp2 = load_profile(REPO_ROOT / "profiles" / "llama3-8b-dp2-h200.yaml").engine
    tp8 = load_profile(REPO_ROOT / "profiles" / "llama3-70b-tp8-h200.yaml").engine
    cpu = load_profile(REPO_ROOT / "profiles" / "tiny-llama3-tp2-cpu.yaml").engine
    assert (tp2.tensor_parallel_size, tp2.data_parallel_size, tp2.gpu_ids) == (2, 1, (0, 1))
    assert (dp2.tensor_parallel_size, dp2.data_parallel_size, dp2.gpu_ids) == (1, 2, (0, 1))
    assert (tp8.tensor_parallel_size, tp8.gpu_ids) == (8, tuple(range(8)))
    assert (cpu.device, cpu.tensor_parallel_size) == ("cpu", 2)


def test_each_data_parallel_instance_takes_its_own_gpu_group():
    cfg = EngineConfig(device="gpu", gpu_ids=(4, 5, 6, 7), tensor_parallel_size=2, data_parallel_size=2)
    args = {"model_instance_kind": "GPU", "model_instance_device_id": "6"}
    assert instance_config(cfg, args).gpu_ids == (6, 7)
    assert instance_config(cfg, {**args, "model_instance_device_id": "4"}).gpu_ids == (4, 5)
    with pytest.raises(PlacementError, match="GPU 5: not the first GPU"):
        instance_config(cfg, {**args, "model_instance_device_id": "5"})
    assert instance_config(cfg, {"model_instance_kind": "CPU"}) is cfg


@pytest.mark.parametrize("shape", ["tiny-llama3", "tiny-qwen2"])
def test_gpu_model_rank_shares_are_slices_of_the_single_gpu_weights(shape):
    """GpuLlama's sharding (checked on CPU tensors: no kernel runs): each rank's seeded
    random weights are exactly its slice of the one-GPU model's."""
    from inflightllm.gpu.model import GpuLlama
    from inflightllm.models.llama import LlamaArch
    from inflightllm.models.shapes import shape_config
    from inflightllm.parallel.group import TensorParallelGroup

    arch = LlamaArch.from_config(shape_config(shape))
    whole_model = GpuLlama(arch, torch.float32, torch.device("cpu"), 64)
    whole_model.init_random(3)
    whole = whole_model.hf_state_dict()
    for rank in (0, 1):
        part = GpuLlama(arch, torch.float32, torch.device("cpu"), 64, tp=TensorParallelGroup(rank, 2))
        part.init_random(3)
        names = part.hf_state_dict()
        assert set(names) == set(whole)
        for name, tensor in names.items():
            shard = part.shard_of(name)
            expected = whole[name] if shard is None else whole[name].narrow(*shard)
            assert torch.equal(tensor, expected), name
        assert part.num_heads == arch.num_heads // 2 and part.num_kv_heads == arch.num_kv_heads // 2


def test_server_environment_keeps_nvlink_multicast_off():
    from tools.server_launcher import server_environment

    env = server_environment(base={"NCCL_NVLS_ENABLE": "1", "PATH": "/usr/bin"})
    assert env["NCCL_NVLS_ENABLE"] == "0" and env["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"


def test_a_worker_that_sampled_another_token_stops():
    from inflightllm.parallel.worker import RankMismatch, check_same_samples

    mine = {3: {"a": 5, "b": 7}, 4: {"a": 6}}
    check_same_samples(1, (3, ["a", "b"], [5, 7]), mine)
    assert list(mine) == [4]  # compared launches are forgotten
    with pytest.raises(RankMismatch, match="rank 1 sampled 6 for a, rank 0 sampled 9"):
        check_same_samples(1, (4, ["a"], [9]), mine)
