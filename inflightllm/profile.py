"""Deployment profiles: one YAML file describes one deployment.

A profile names the model (`model:`), the devices (`device:`), the instance counts of
the tokenizer models (`instances:`), the engine's scheduling and KV-cache settings
(`engine:`) and the dynamic batching of the tokenizer models (`dynamic_batching:`).
`load_profile` parses and validates it; every problem is a `ProfileError` whose message
reads `"{file}: {key}: {problem}"`, with `key` the dotted path of the setting.

The schema, the defaults and the allowed values are described in docs/PROFILES.md.
`tools/render_configs.py` turns a validated profile into the `config.pbtxt` files.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import yaml

from inflightllm.config import (
    BATCHING_STRATEGIES,
    CAPACITY_POLICIES_ALLOWED,
    DEVICE_KINDS,
    KV_CACHE_DTYPES,
    PREEMPTION_MODES,
    RUNNERS,
    EngineConfig,
    capacity_policy_name,
)
from inflightllm.model_source import (
    DTYPES,
    QUANTIZATIONS,
    SOURCES,
    ModelDims,
    ModelSourceError,
    ModelSpec,
    kv_element_bytes,
    model_dims,
)
from inflightllm.piece_ledger import DONE_SLOTS

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_PROFILE = REPO_ROOT / "profiles" / "smollm2-cpu.yaml"

NAME_PATTERN = re.compile(r"[a-z0-9-]+")
BLOCK_SIZES = (8, 16, 32, 64, 128)
TENSOR_PARALLEL_SIZES = (1, 2, 4, 8)
# Triton max_batch_size of preprocessing/postprocessing: the upper bound of a
# preferred batch size.
TOKENIZER_MAX_BATCH_SIZE = 64

TOP_LEVEL_KEYS = ("name", "description", "model", "device", "instances", "engine", "dynamic_batching")
MODEL_KEYS = (
    "source", "package", "file", "path", "shape", "seed", "tokenizer", "dtype", "max_model_len", "quantization",
    "fp8_smoothing", "fp8_lm_head", "int8_lm_head",
)
# Keys of `model:` that belong to one source only (source, dtype, max_model_len are common).
SOURCE_KEYS = {
    "gguf_package": ("package", "file"),
    "hf_folder": ("path",),
    "random": ("shape", "seed", "tokenizer"),
}
SOURCE_REQUIRED_KEYS = {"gguf_package": ("package", "file"), "hf_folder": ("path",), "random": ("shape",)}
DEVICE_KEYS = ("kind", "gpu_ids", "tensor_parallel_size", "data_parallel_size")
DATA_PARALLEL_MAX = 64
INSTANCE_KEYS = ("preprocessing", "postprocessing")
# postprocessing runs on Triton's default scheduler (templates/postprocessing.pbtxt.j2); with
# more than one instance it is decoupled, and the engine keeps one piece of a stream in flight
# so that the instances deliver a stream's pieces in order (docs/INTERFACE.md).
POSTPROCESSING_MAX_INSTANCES = DONE_SLOTS
QUEUE_POLICY_KEYS = ("max_queue_size", "default_timeout_microseconds")
DYNAMIC_BATCHING_KEYS = ("preferred_batch_size", "max_queue_delay_microseconds")
# EngineConfig fields that do not come from `engine:` (device ones come from `device:`,
# num_kv_blocks is for tests only, the queue policy is nested under `queue_policy:`).
ENGINE_FIELDS_NOT_IN_SECTION = (
    "device", "gpu_ids", "tensor_parallel_size", "data_parallel_size", "num_kv_blocks", "fault_injection"
) + QUEUE_POLICY_KEYS

_ENGINE_DEFAULTS = EngineConfig()
DEFAULT_INSTANCES = 1
DEFAULT_PREFERRED_BATCH_SIZE = (4, 8)
DEFAULT_MAX_QUEUE_DELAY_MICROSECONDS = 500


class ProfileError(ValueError):
    """A profile is invalid; `str(error)` is the full message `"{file}: {key}: {problem}"`."""

    def __init__(self, file: str, key: str | None, problem: str):
        self.file = file
        self.key = key
        self.problem = problem
        super().__init__(f"{file}: {key}: {problem}" if key else f"{file}: {problem}")


@dataclass(frozen=True)
class Profile:
    """A validated deployment profile."""

    name: str
    description: str
    model: ModelSpec
    engine: EngineConfig  # device, gpu_ids, tensor_parallel_size, data_parallel_size come from `device:`
    instances_preprocessing: int
    instances_postprocessing: int
    preferred_batch_size: tuple[int, ...]
    max_queue_delay_microseconds: int
    source_path: Path

    def context_length(self) -> int:
        """The effective context: `model.max_model_len`, else the model's max_position_embeddings."""
        return self.model.max_model_len or model_dims(self.model).max_position_embeddings


# --- YAML loading ------------------------------------------------------------------------


class _DuplicateKey(Exception):
    def __init__(self, key: str, line: int):
        self.key = key
        self.line = line


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 booleans (only true/false, so `yes`/`on` stay strings and
    are rejected where a boolean is expected) and duplicate keys reported."""

    def construct_mapping(self, node, deep=False):
        seen: set = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, str) and key in seen:
                raise _DuplicateKey(key, key_node.start_mark.line + 1)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


_StrictLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_StrictLoader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)


def existing_profiles() -> list[str]:
    """The repository's profiles, as paths relative to its root."""
    return sorted(path.relative_to(REPO_ROOT).as_posix() for path in (REPO_ROOT / "profiles").glob("*.yaml"))


def load_profile(path) -> Profile:
    """Read, parse and validate a profile YAML file; raises ProfileError."""
    file = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as error:
        problem = f"cannot read the profile: {error.strerror or error}"
        if isinstance(error, FileNotFoundError):
            problem += f"; profiles that exist: {', '.join(existing_profiles()) or 'none'}"
        raise ProfileError(file, None, problem) from None
    try:
        data = yaml.load(text, Loader=_StrictLoader)
    except _DuplicateKey as error:
        raise ProfileError(file, None, f"duplicate key {error.key!r} on line {error.line}") from None
    except yaml.YAMLError as error:
        raise ProfileError(file, None, f"invalid YAML: {' '.join(str(error).split())}") from None
    if not isinstance(data, dict):
        raise ProfileError(file, None, f"expected a mapping of settings at the top level, got {_describe(data)}")
    return validate_profile_dict(data, path)


# --- typed readers ---------------------------------------------------------------------------


def _describe(value: Any) -> str:
    if value is None:
        return "null"
    return f"{value!r} ({type(value).__name__})"


class _Reader:
    """Reads typed values out of a profile dictionary, naming the file and key on errors."""

    def __init__(self, file: str):
        self.file = file

    def fail(self, key: str | None, problem: str):
        raise ProfileError(self.file, key, problem)

    def section(self, data: dict, key: str, allowed: tuple[str, ...]) -> dict:
        value = data.get(key.rsplit(".", 1)[-1], {})
        if value is None:
            value = {}
        if not isinstance(value, dict):
            self.fail(key, f"expected a mapping of settings, got {_describe(value)}")
        self.check_keys(value, key, allowed)
        return value

    def check_keys(self, data: dict, prefix: str | None, allowed: tuple[str, ...]) -> None:
        for name in data:
            if name not in allowed:
                dotted = f"{prefix}.{name}" if prefix else str(name)
                self.fail(dotted, f"unknown key; allowed keys: {', '.join(sorted(allowed))}")

    def integer(self, value: Any, key: str, low: int | None = None, high: int | None = None) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            self.fail(key, f"expected an integer, got {_describe(value)}")
        self._check_range(value, key, low, high)
        return value

    def number(self, value: Any, key: str) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            self.fail(key, f"expected a number, got {_describe(value)}")
        return float(value)

    def boolean(self, value: Any, key: str) -> bool:
        if not isinstance(value, bool):
            self.fail(key, f"expected a boolean (true or false), got {_describe(value)}")
        return value

    def string(self, value: Any, key: str) -> str:
        if not isinstance(value, str):
            self.fail(key, f"expected a string, got {_describe(value)}")
        return value

    def choice(self, value: Any, key: str, allowed: tuple) -> Any:
        if value not in allowed or isinstance(value, bool):
            shown = repr(value) if isinstance(value, str) else value
            self.fail(key, f"{shown} is not allowed; allowed values: {', '.join(str(a) for a in allowed)}")
        return value

    def int_list(self, value: Any, key: str, low: int | None = None, high: int | None = None) -> tuple[int, ...]:
        if not isinstance(value, list):
            self.fail(key, f"expected a list of integers, got {_describe(value)}")
        return tuple(self.integer(item, f"{key}[{index}]", low, high) for index, item in enumerate(value))

    def _check_range(self, value, key: str, low, high) -> None:
        if (low is not None and value < low) or (high is not None and value > high):
            if high is None:
                allowed = f">= {low}"
            elif low is None:
                allowed = f"<= {high}"
            else:
                allowed = f"{low} .. {high}"
            self.fail(key, f"{value} is out of range; allowed: {allowed}")


# --- validation ----------------------------------------------------------------------------


def validate_profile_dict(data: dict, source_path) -> Profile:
    """Validate an already-parsed profile dictionary; `source_path` names it in errors."""
    reader = _Reader(str(source_path))
    if not isinstance(data, dict):
        reader.fail(None, f"expected a mapping of settings at the top level, got {_describe(data)}")
    reader.check_keys(data, None, TOP_LEVEL_KEYS)

    if "name" not in data:
        reader.fail("name", "required key is missing")
    name = reader.string(data["name"], "name")
    if not NAME_PATTERN.fullmatch(name):
        reader.fail("name", f"{name!r} is not allowed; use lowercase letters, digits and '-'")
    description = reader.string(data.get("description", ""), "description")

    model = _read_model(reader, data)
    kind, gpu_ids, tensor_parallel_size, data_parallel_size = _read_device(reader, data)
    instances = reader.section(data, "instances", INSTANCE_KEYS)
    instances_preprocessing = reader.integer(
        instances.get("preprocessing", DEFAULT_INSTANCES), "instances.preprocessing", 1, 64
    )
    instances_postprocessing = reader.integer(
        instances.get("postprocessing", 1), "instances.postprocessing", 1, POSTPROCESSING_MAX_INSTANCES
    )
    engine = _read_engine(reader, data, kind, gpu_ids, tensor_parallel_size, data_parallel_size)
    preferred_batch_size, max_queue_delay = _read_dynamic_batching(reader, data)

    dims = _model_dims(reader, model)
    _check_against_model(reader, model, engine, dims)

    return Profile(
        name=name,
        description=description,
        model=model,
        engine=engine,
        instances_preprocessing=instances_preprocessing,
        instances_postprocessing=instances_postprocessing,
        preferred_batch_size=preferred_batch_size,
        max_queue_delay_microseconds=max_queue_delay,
        source_path=Path(source_path),
    )


def _read_model(reader: _Reader, data: dict) -> ModelSpec:
    if "model" not in data:
        reader.fail("model", "required key is missing")
    section = reader.section(data, "model", MODEL_KEYS)
    if "source" not in section:
        reader.fail("model.source", f"required key is missing; allowed values: {', '.join(SOURCES)}")
    source = reader.choice(reader.string(section["source"], "model.source"), "model.source", SOURCES)
    for key in section:
        owners = [name for name, keys in SOURCE_KEYS.items() if key in keys]
        if owners and source not in owners:
            reader.fail(
                f"model.{key}",
                f"only allowed when model.source is {owners[0]!r} (model.source is {source!r})",
            )
    for key in SOURCE_REQUIRED_KEYS[source]:
        if key not in section:
            reader.fail(f"model.{key}", f"required key is missing when model.source is {source!r}")

    values: dict[str, Any] = {"source": source}
    for key in ("package", "file", "path", "shape", "tokenizer"):
        if key in section:
            value = reader.string(section[key], f"model.{key}")
            if not value:
                reader.fail(f"model.{key}", "must not be empty")
            values[key] = value
    if "seed" in section:
        values["seed"] = reader.integer(section["seed"], "model.seed", 0)
    if "dtype" in section:
        values["dtype"] = reader.choice(reader.string(section["dtype"], "model.dtype"), "model.dtype", DTYPES)
    if "max_model_len" in section:
        values["max_model_len"] = reader.integer(section["max_model_len"], "model.max_model_len", 1)
    if "quantization" in section:
        quantization = reader.choice(
            reader.string(section["quantization"], "model.quantization"), "model.quantization", QUANTIZATIONS
        )
        if quantization != "none":
            values["quantization"] = quantization
    if "fp8_smoothing" in section:
        alpha = reader.number(section["fp8_smoothing"], "model.fp8_smoothing")
        if not 0.0 <= alpha <= 1.0:
            reader.fail("model.fp8_smoothing", f"{alpha:g} is out of range: SmoothQuant's alpha, from 0 (off) to 1")
        if alpha > 0.0:
            if values.get("quantization") != "fp8":
                reader.fail("model.fp8_smoothing", "only with model.quantization: fp8 (the smoothing is folded in "
                                                   "before the weights are quantized at load)")
            values["fp8_smoothing"] = alpha
    if "fp8_lm_head" in section and reader.boolean(section["fp8_lm_head"], "model.fp8_lm_head"):
        if values.get("quantization") != "fp8" and values.get("source") != "hf_folder":
            reader.fail("model.fp8_lm_head", "only with FP8 weights: model.quantization: fp8, or an hf_folder "
                                             "holding an FP8 checkpoint")
        values["fp8_lm_head"] = True
    if "int8_lm_head" in section and reader.boolean(section["int8_lm_head"], "model.int8_lm_head"):
        if values.get("fp8_lm_head"):
            reader.fail("model.int8_lm_head", "not with model.fp8_lm_head: the LM head gets one 8-bit copy, "
                                              "e4m3 or int8; drop one")
        values["int8_lm_head"] = True
    if "tokenizer" in values:
        folder = Path(values["tokenizer"]).expanduser()
        if not ((folder / "tokenizer.json").is_file() or (folder / "tokenizer_config.json").is_file()):
            reader.fail(
                "model.tokenizer",
                f"{values['tokenizer']!r} is not a folder with tokenizer files "
                "(tokenizer.json or tokenizer_config.json)",
            )
    return ModelSpec(**values)


def _read_device(reader: _Reader, data: dict) -> tuple[str, tuple[int, ...], int, int]:
    section = reader.section(data, "device", DEVICE_KEYS)
    kind = reader.choice(reader.string(section.get("kind", "cpu"), "device.kind"), "device.kind", DEVICE_KINDS)
    tensor_parallel_size = reader.integer(section.get("tensor_parallel_size", 1), "device.tensor_parallel_size")
    reader.choice(tensor_parallel_size, "device.tensor_parallel_size", TENSOR_PARALLEL_SIZES)
    data_parallel_size = reader.integer(
        section.get("data_parallel_size", 1), "device.data_parallel_size", 1, DATA_PARALLEL_MAX
    )
    gpu_ids = reader.int_list(section.get("gpu_ids", []), "device.gpu_ids", 0)
    if kind == "cpu":
        # Tensor parallel on CPU runs over gloo (CI's exactness and failure tests).
        if data_parallel_size != 1:
            reader.fail(
                "device.data_parallel_size",
                f"{data_parallel_size} is not allowed with device.kind 'cpu'; data parallelism places one "
                "engine instance per GPU (group); cpu requires 1",
            )
        if gpu_ids:
            reader.fail("device.gpu_ids", f"must be empty with device.kind 'cpu', got {list(gpu_ids)}")
    else:
        repeated = sorted({gpu for gpu in gpu_ids if gpu_ids.count(gpu) > 1})
        if repeated:
            reader.fail(
                "device.gpu_ids",
                f"{list(gpu_ids)} repeats GPU id {repeated[0]}; the ids must be distinct",
            )
        if len(gpu_ids) != tensor_parallel_size * data_parallel_size:
            if data_parallel_size == 1:
                reader.fail(
                    "device.gpu_ids",
                    f"{list(gpu_ids)} has {len(gpu_ids)} GPU ids but device.tensor_parallel_size is "
                    f"{tensor_parallel_size}; give one GPU id per tensor-parallel rank",
                )
            reader.fail(
                "device.gpu_ids",
                f"{list(gpu_ids)} has {len(gpu_ids)} GPU ids but device.tensor_parallel_size x "
                f"device.data_parallel_size is {tensor_parallel_size} x {data_parallel_size} = "
                f"{tensor_parallel_size * data_parallel_size}; give one GPU id per rank of every instance "
                "(instance i uses ids i*tp .. i*tp+tp-1)",
            )
    return kind, gpu_ids, tensor_parallel_size, data_parallel_size


def _capacity_policy(reader: _Reader, value: Any) -> str:
    text = reader.string(value, "engine.capacity_policy")
    try:
        return capacity_policy_name(text)  # ours, lowercase
    except ValueError:
        reader.fail("engine.capacity_policy", f"{text!r} is not allowed; {CAPACITY_POLICIES_ALLOWED}")


def _read_engine(
    reader: _Reader,
    data: dict,
    kind: str,
    gpu_ids: tuple[int, ...],
    tensor_parallel_size: int,
    data_parallel_size: int = 1,
) -> EngineConfig:
    engine_keys = tuple(
        field_.name for field_ in fields(EngineConfig) if field_.name not in ENGINE_FIELDS_NOT_IN_SECTION
    ) + ("queue_policy",)
    section = reader.section(data, "engine", engine_keys)

    def get(key: str):
        return section.get(key, getattr(_ENGINE_DEFAULTS, key))

    values: dict[str, Any] = {
        "max_batch_size": reader.integer(get("max_batch_size"), "engine.max_batch_size", 1, 4096),
        "max_num_tokens": reader.integer(get("max_num_tokens"), "engine.max_num_tokens", 1, 1048576),
        "max_input_length": reader.integer(get("max_input_length"), "engine.max_input_length", 1),
        "max_output_len": reader.integer(get("max_output_len"), "engine.max_output_len", 1),
        "block_size": reader.choice(
            reader.integer(get("block_size"), "engine.block_size"), "engine.block_size", BLOCK_SIZES
        ),
        "kv_cache_bytes": reader.integer(get("kv_cache_bytes"), "engine.kv_cache_bytes", 1),
        "gpu_memory_utilization": reader.number(get("gpu_memory_utilization"), "engine.gpu_memory_utilization"),
        "enable_kv_cache_reuse": reader.boolean(get("enable_kv_cache_reuse"), "engine.enable_kv_cache_reuse"),
        "batching_strategy": reader.choice(
            reader.string(get("batching_strategy"), "engine.batching_strategy"),
            "engine.batching_strategy",
            BATCHING_STRATEGIES,
        ),
        "stream_interval": reader.integer(get("stream_interval"), "engine.stream_interval", 1, 1024),
        "priority_levels": reader.integer(get("priority_levels"), "engine.priority_levels", 1, 16),
        "cuda_graphs": reader.boolean(get("cuda_graphs"), "engine.cuda_graphs"),
        "preemption_mode": reader.choice(
            reader.string(get("preemption_mode"), "engine.preemption_mode"),
            "engine.preemption_mode",
            PREEMPTION_MODES,
        ),
        "swap_space_blocks": reader.integer(get("swap_space_blocks"), "engine.swap_space_blocks", 0),
        # TensorRT-LLM's names (GUARANTEED_NO_EVICT, MAX_UTILIZATION) in any case: ours, lowercase.
        "capacity_policy": _capacity_policy(reader, get("capacity_policy")),
        "kv_watermark": reader.number(get("kv_watermark"), "engine.kv_watermark"),
        "host_kv_cache_bytes": reader.integer(get("host_kv_cache_bytes"), "engine.host_kv_cache_bytes", 0),
        # On by default on GPUs, where the host work between steps would leave the GPU idle.
        "async_scheduling": reader.boolean(section.get("async_scheduling", kind == "gpu"), "engine.async_scheduling"),
        "step_timeout_s": reader.number(get("step_timeout_s"), "engine.step_timeout_s"),
        "runner": reader.choice(reader.string(get("runner"), "engine.runner"), "engine.runner", RUNNERS),
        "kv_cache_dtype": reader.choice(
            reader.string(get("kv_cache_dtype"), "engine.kv_cache_dtype"), "engine.kv_cache_dtype", KV_CACHE_DTYPES
        ),
        # Several outputs per request (docs/SEQUENCE-GROUPS.md): requests beyond these are refused.
        "max_n": reader.integer(get("max_n"), "engine.max_n", 1, 64),
        "max_beam_width": reader.integer(get("max_beam_width"), "engine.max_beam_width", 1, 8),
    }
    if values["runner"] == "dummy" and (kind != "cpu" or tensor_parallel_size != 1):
        reader.fail(
            "engine.runner",
            f"'dummy' runs no model and holds no KV memory, on the host alone: it needs device.kind 'cpu' "
            f"and device.tensor_parallel_size 1 (got {kind!r}, {tensor_parallel_size}); it measures the "
            "response path of any deployment from there",
        )
    if not 0.0 <= values["kv_watermark"] < 1.0:
        reader.fail(
            "engine.kv_watermark",
            f"{section.get('kv_watermark')} is out of range; allowed: at least 0 and less than 1 "
            "(the fraction of KV blocks an admission leaves free; vLLM uses 0.01)",
        )
    if not 0.0 < values["step_timeout_s"] <= 86400.0:
        reader.fail(
            "engine.step_timeout_s",
            f"{section.get('step_timeout_s')} is out of range; allowed: greater than 0 and at most 86400",
        )
    utilization = values["gpu_memory_utilization"]
    if not 0.0 < utilization < 1.0:
        reader.fail(
            "engine.gpu_memory_utilization",
            f"{section.get('gpu_memory_utilization', utilization)} is out of range; "
            "allowed: greater than 0 and less than 1",
        )
    if values["host_kv_cache_bytes"] > 0 and not values["enable_kv_cache_reuse"]:
        reader.fail(
            "engine.host_kv_cache_bytes",
            f"{values['host_kv_cache_bytes']} needs engine.enable_kv_cache_reuse true: the host tier keeps "
            "evicted prefix-cache blocks (set it to 0, or turn prefix caching on)",
        )
    if values["max_num_tokens"] < values["max_batch_size"]:
        reader.fail(
            "engine.max_num_tokens",
            f"{values['max_num_tokens']} is less than engine.max_batch_size ({values['max_batch_size']}); "
            "a step must fit one token of every running request",
        )

    queue = reader.section(section, "engine.queue_policy", QUEUE_POLICY_KEYS)
    for key in QUEUE_POLICY_KEYS:
        values[key] = reader.integer(
            queue.get(key, getattr(_ENGINE_DEFAULTS, key)), f"engine.queue_policy.{key}", 0
        )
    return EngineConfig(
        **values,
        device=kind,
        gpu_ids=gpu_ids,
        tensor_parallel_size=tensor_parallel_size,
        data_parallel_size=data_parallel_size,
    )


def _read_dynamic_batching(reader: _Reader, data: dict) -> tuple[tuple[int, ...], int]:
    section = reader.section(data, "dynamic_batching", DYNAMIC_BATCHING_KEYS)
    preferred = reader.int_list(
        section.get("preferred_batch_size", list(DEFAULT_PREFERRED_BATCH_SIZE)),
        "dynamic_batching.preferred_batch_size",
        1,
        TOKENIZER_MAX_BATCH_SIZE,
    )
    if any(later <= earlier for earlier, later in zip(preferred, preferred[1:], strict=False)):
        reader.fail(
            "dynamic_batching.preferred_batch_size",
            f"{list(preferred)} is not in strictly ascending order",
        )
    max_queue_delay = reader.integer(
        section.get("max_queue_delay_microseconds", DEFAULT_MAX_QUEUE_DELAY_MICROSECONDS),
        "dynamic_batching.max_queue_delay_microseconds",
        0,
    )
    return preferred, max_queue_delay


def _model_dims(reader: _Reader, model: ModelSpec) -> ModelDims:
    try:
        return model_dims(model)
    except ModelSourceError as error:
        # Its message already starts with the key (`model.file: ...`).
        reader.fail(None, str(error))
    except (OSError, ValueError, KeyError, TypeError) as error:
        reader.fail("model", f"cannot read the dimensions of {model.describe()}: {error!r}")
    raise AssertionError("unreachable")


def _check_against_model(reader: _Reader, model: ModelSpec, engine: EngineConfig, dims: ModelDims) -> None:
    tp = engine.tensor_parallel_size
    if dims.num_kv_heads % tp:
        reader.fail("device.tensor_parallel_size", f"{tp} does not divide the model's {dims.num_kv_heads} KV heads")
    if dims.num_heads % tp:
        reader.fail(
            "device.tensor_parallel_size", f"{tp} does not divide the model's {dims.num_heads} attention heads"
        )
    if model.quantization == "fp8" and tp > 1 and engine.device == "gpu":
        reader.fail(
            "model.quantization",
            f"fp8 runs on one GPU for now; device.tensor_parallel_size is {tp} (set it to 1, or drop fp8)",
        )
    if (model.fp8_lm_head or model.int8_lm_head) and tp > 1:
        key = "model.fp8_lm_head" if model.fp8_lm_head else "model.int8_lm_head"
        reader.fail(key, f"the 8-bit LM head runs on one rank for now; device.tensor_parallel_size is {tp} "
                         f"(set it to 1, or drop {key})")
    if model.max_model_len is not None and model.max_model_len > dims.max_position_embeddings:
        reader.fail(
            "model.max_model_len",
            f"{model.max_model_len} exceeds the model's max_position_embeddings "
            f"({dims.max_position_embeddings})",
        )
    context = model.max_model_len or dims.max_position_embeddings
    request_tokens = engine.max_input_length + engine.max_output_len
    if request_tokens > context:
        reader.fail(
            "engine.max_output_len",
            f"max_input_length ({engine.max_input_length}) + max_output_len ({engine.max_output_len}) = "
            f"{request_tokens} exceeds the model context of {context} tokens "
            "(model.max_model_len or the model's max_position_embeddings)",
        )
    block_bytes = engine.block_size * dims.kv_bytes_per_token(kv_element_bytes(model.dtype, engine.kv_cache_dtype), tp)
    if 0 < engine.host_kv_cache_bytes < block_bytes:
        reader.fail(
            "engine.host_kv_cache_bytes",
            f"{engine.host_kv_cache_bytes} holds no KV block: one block of {engine.block_size} tokens takes "
            f"{block_bytes} bytes on each rank; allowed: 0 (off) or at least {block_bytes}",
        )
    if engine.device == "cpu":
        bytes_per_token = dims.kv_bytes_per_token(kv_element_bytes(model.dtype, engine.kv_cache_dtype), tp)
        block_tokens = math.ceil(request_tokens / engine.block_size) * engine.block_size
        needed = block_tokens * bytes_per_token
        if engine.kv_cache_bytes < needed:
            reader.fail(
                "engine.kv_cache_bytes",
                f"{engine.kv_cache_bytes} is too small for one request of max_input_length + "
                f"max_output_len = {request_tokens} tokens: {block_tokens} tokens in blocks of "
                f"{engine.block_size} at {bytes_per_token} bytes per token "
                f"({model.dtype}{', KV cache fp8' if engine.kv_cache_dtype == 'fp8' else ''}) need "
                f"{needed} bytes",
            )
