"""Render a profile into a Triton model repository (every `config.pbtxt`).

The profile is validated first (inflightllm.profile); a ProfileError is printed as is
and the exit status is 2 with nothing written. The four models' configs come from
`templates/<model>.pbtxt.j2` (Jinja2, StrictUndefined); the tensor tables below follow
docs/INTERFACE.md, which is authoritative. For preprocessing, engine and postprocessing
`templates/models/<model>.py` is copied to `<model>/1/model.py` when it exists.

Usage:
  python tools/render_configs.py --profile profiles/smollm2-cpu.yaml --out model_repo
  python tools/render_configs.py --profile profiles/smollm2-cpu.yaml --out model_repo --check
  python tools/render_configs.py --profile P --out DIR --tokenizer-env /path/to/numpy1-venv

`--tokenizer-env PATH` (GPU hosts whose Python has NumPy 2) adds the Python backend's
`EXECUTION_ENV_PATH` parameter, set to PATH, to `preprocessing` and `postprocessing`:
the models that read BYTES tensors then run in that NumPy < 2 environment
(docs/RUNTIME-NOTES.md). The `engine` model never gets it (it moves tensors by DLPack
and needs the host's NumPy 2 and CuPy). Without the option nothing changes, so
`model_repo/` stays the render of the default profile.

Before writing, the profile's `device.gpu_ids` are checked against the GPUs of this
machine (`nvidia-smi -L`, else torch): an id that does not exist is refused, naming the
key (exit 2). On a machine with no GPU visible the check is skipped with a note, and
`--no-device-check` skips it when rendering for another machine.

`device.data_parallel_size: D` renders D engine instances, each `KIND_GPU` on the first
GPU of its tensor-parallel group (`gpu_ids[i*tp : (i+1)*tp]`); the engine model reads
`model_instance_device_id` and places itself on that group (inflightllm.parallel.placement).

`--check` renders into memory and compares with the folder: exit 0 when identical,
1 with a unified diff per differing file (and the missing/extra files) otherwise.
Files outside the four model folders are never touched; inside them, files the
render does not produce are removed (never `__pycache__`).
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import jinja2

from inflightllm.packed_outputs import PACKED_F32, PACKED_I32
from inflightllm.profile import (
    DEFAULT_PROFILE,
    REPO_ROOT,
    TOKENIZER_MAX_BATCH_SIZE,
    Profile,
    ProfileError,
    load_profile,
)

TEMPLATES_DIR = REPO_ROOT / "templates"
MODEL_SOURCES_DIR = TEMPLATES_DIR / "models"
MODELS = ("ensemble", "preprocessing", "engine", "postprocessing")
PYTHON_MODELS = ("preprocessing", "engine", "postprocessing")
# Triton max_batch_size of every model. The ensemble's must not exceed any composing
# model's; the engine's only bounds one `execute` call (it enqueues, the scheduler's
# own engine.max_batch_size caps the running requests).
TRITON_MAX_BATCH_SIZE = TOKENIZER_MAX_BATCH_SIZE
IGNORED_NAMES = ("__pycache__",)


@dataclass(frozen=True)
class Tensor:
    """One input or output of a model config."""

    name: str
    data_type: str  # Triton TYPE_* name
    dims: tuple[int, ...]
    optional: bool = False

    @property
    def dims_text(self) -> str:
        return "[ " + ", ".join(str(d) for d in self.dims) + " ]"


def _t(name: str, data_type: str, dims: tuple[int, ...] = (1,), optional: bool = False) -> Tensor:
    return Tensor(name, data_type, dims, optional)


# docs/INTERFACE.md "Ensemble inputs". All optional in the config: text_input can be
# replaced by messages, max_tokens by the sampling_parameters key; preprocessing names
# whichever is missing (a request Triton itself refuses for a missing input gets no
# error response through a decoupled ensemble in 2.51).
ENSEMBLE_INPUTS = (
    _t("text_input", "TYPE_STRING", optional=True),
    _t("messages", "TYPE_STRING", optional=True),
    _t("max_tokens", "TYPE_INT32", optional=True),
    _t("stream", "TYPE_BOOL", optional=True),
    _t("temperature", "TYPE_FP32", optional=True),
    _t("top_k", "TYPE_INT32", optional=True),
    _t("top_p", "TYPE_FP32", optional=True),
    _t("min_p", "TYPE_FP32", optional=True),
    _t("repetition_penalty", "TYPE_FP32", optional=True),
    _t("presence_penalty", "TYPE_FP32", optional=True),
    _t("frequency_penalty", "TYPE_FP32", optional=True),
    _t("min_tokens", "TYPE_INT32", optional=True),
    _t("seed", "TYPE_UINT64", optional=True),
    _t("stop_words", "TYPE_STRING", (-1,), optional=True),
    _t("bad_words", "TYPE_STRING", (-1,), optional=True),
    _t("end_id", "TYPE_INT32", optional=True),
    _t("pad_id", "TYPE_INT32", optional=True),
    _t("exclude_input_in_output", "TYPE_BOOL", optional=True),
    _t("return_log_probs", "TYPE_BOOL", optional=True),
    _t("num_top_logprobs", "TYPE_INT32", optional=True),
    _t("priority", "TYPE_INT32", optional=True),
    _t("timeout_ms", "TYPE_INT32", optional=True),
    _t("sampling_parameters", "TYPE_STRING", optional=True),
    _t("return_finish_reason", "TYPE_BOOL", optional=True),
    _t("return_num_input_tokens", "TYPE_BOOL", optional=True),
    _t("return_num_output_tokens", "TYPE_BOOL", optional=True),
    # TensorRT-LLM's names (docs/INTERFACE.md, "Other backends' names").
    _t("random_seed", "TYPE_UINT64", optional=True),
    _t("min_length", "TYPE_INT32", optional=True),
    _t("beam_width", "TYPE_INT32", optional=True),
    _t("length_penalty", "TYPE_FP32", optional=True),
    _t("early_stopping", "TYPE_INT32", optional=True),
    _t("num_return_sequences", "TYPE_INT32", optional=True),
    _t("return_context_logits", "TYPE_BOOL", optional=True),
    _t("return_generation_logits", "TYPE_BOOL", optional=True),
    # vLLM's.
    _t("return_cumulative_logprob", "TYPE_BOOL", optional=True),
    _t("return_logprobs", "TYPE_BOOL", optional=True),
    # TensorRT-LLM's structured output (docs/STRUCTURED-OUTPUT.md).
    _t("guided_decoding_guide_type", "TYPE_STRING", optional=True),
    _t("guided_decoding_guide", "TYPE_STRING", optional=True),
    # OpenAI-style tools for the chat template (the OpenAI front end sends them).
    _t("tools", "TYPE_STRING", optional=True),
)

# docs/INTERFACE.md "Ensemble outputs"; postprocessing produces each of them. The dims
# with a beam dimension are TensorRT-LLM's ensemble's (text_output [beam], output_ids
# [beam, tokens], ...): a beam_width > 1 response has those shapes; a response without
# beam search keeps its one-output shapes (output_ids [tokens]), which Triton accepts as
# it does not check a Python model's output shapes against its config.
ENSEMBLE_OUTPUTS = (
    _t("text_output", "TYPE_STRING", (-1,)),  # [beam]
    _t("finish_reason", "TYPE_STRING"),
    _t("num_input_tokens", "TYPE_INT32"),
    _t("num_output_tokens", "TYPE_INT32"),
    _t("num_cached_tokens", "TYPE_INT32"),
    _t("output_ids", "TYPE_INT32", (-1, -1)),  # [beam, tokens]; [tokens] without beam search
    _t("sequence_length", "TYPE_INT32", (-1,)),  # [beam]: the ids of each row of output_ids
    _t("cum_log_probs", "TYPE_FP32", (-1,)),  # [beam]
    _t("output_log_probs", "TYPE_FP32", (-1, -1)),  # [beam, tokens]; [tokens] without beam search
    _t("top_logprob_ids", "TYPE_INT32", (-1, -1)),
    _t("top_logprobs", "TYPE_FP32", (-1, -1)),
    _t("sequence_index", "TYPE_INT32"),  # which output of the request (n)
    _t("cumulative_logprob", "TYPE_FP32", (-1,)),  # vLLM's name of cum_log_probs
    _t("batch_index", "TYPE_INT32"),  # TensorRT-LLM's; always 0 (one prompt per request)
)

# docs/INTERFACE.md "preprocessing -> engine": preprocessing always emits all of them.
PREPROCESSING_TO_ENGINE = (
    _t("input_ids", "TYPE_INT32", (-1,)),
    _t("input_length", "TYPE_INT32"),
    _t("max_tokens", "TYPE_INT32"),
    _t("min_tokens", "TYPE_INT32"),
    _t("streaming", "TYPE_BOOL"),
    _t("temperature", "TYPE_FP32"),
    _t("top_p", "TYPE_FP32"),
    _t("min_p", "TYPE_FP32"),
    _t("repetition_penalty", "TYPE_FP32"),
    _t("presence_penalty", "TYPE_FP32"),
    _t("frequency_penalty", "TYPE_FP32"),
    _t("top_k", "TYPE_INT32"),
    _t("seed", "TYPE_INT64"),
    _t("end_id", "TYPE_INT32"),
    _t("ignore_eos", "TYPE_BOOL"),
    _t("stop_words", "TYPE_INT32", (-1,)),
    _t("bad_words", "TYPE_INT32", (-1,)),
    _t("return_log_probs", "TYPE_BOOL"),
    _t("num_top_logprobs", "TYPE_INT32"),
    _t("priority", "TYPE_INT32"),
    _t("exclude_input_in_output", "TYPE_BOOL"),
    _t("timeout_ms", "TYPE_INT32"),
    _t("guided_type", "TYPE_INT32"),
    _t("guided_guide", "TYPE_UINT8", (-1,)),
    _t("n", "TYPE_INT32"),
    _t("best_of", "TYPE_INT32"),
    _t("beam_width", "TYPE_INT32"),
    _t("length_penalty", "TYPE_FP32"),
    _t("early_stopping", "TYPE_INT32"),
)

# The engine's inputs: preprocessing's outputs, plus the control input `cancel_request`.
# All optional in the config so that a control request can carry `cancel_request` alone;
# the engine itself names any missing input of a generation request.
ENGINE_INPUTS = tuple(_t(t.name, t.data_type, t.dims, optional=True) for t in PREPROCESSING_TO_ENGINE) + (
    _t("cancel_request", "TYPE_INT64", optional=True),
)

# docs/INTERFACE.md "engine -> postprocessing": the engine's documented outputs.
ENGINE_OUTPUTS = (
    _t("request_handle", "TYPE_INT64"),
    _t("output_ids", "TYPE_INT32", (-1, -1)),  # beam search: [beam, tokens]; [tokens] otherwise
    _t("context_ids", "TYPE_INT32", (-1,)),
    _t("finish_reason", "TYPE_INT32"),
    _t("num_input_tokens", "TYPE_INT32"),
    _t("num_output_tokens", "TYPE_INT32"),
    _t("num_cached_tokens", "TYPE_INT32"),
    _t("cum_log_probs", "TYPE_FP32", (-1,)),  # [beam]
    _t("output_log_probs", "TYPE_FP32", (-1, -1)),  # beam search: [beam, tokens]; [tokens] otherwise
    _t("top_logprob_ids", "TYPE_INT32", (-1, -1)),
    _t("top_logprobs", "TYPE_FP32", (-1, -1)),
    _t("sequence_index", "TYPE_INT32"),
    _t("sequence_length", "TYPE_INT32", (-1,)),  # [beam]: the ids of each row of output_ids
)

# Inside the ensemble the engine sends the same values in three tensors (it does when a
# request asks for engine_out_i32): inflightllm/packed_outputs.py. The engine declares both
# sets; the ensemble maps only these, and postprocessing unpacks them.
ENGINE_TO_POSTPROCESSING = (
    _t("request_handle", "TYPE_INT64"),
    _t(PACKED_I32, "TYPE_INT32", (-1,)),
    _t(PACKED_F32, "TYPE_FP32", (-1,)),
)

# Names of the ensemble's internal tensors between the steps.
PREPROCESSING_PREFIX = "_pre_"
ENGINE_PREFIX = "_engine_"


def profile_display_path(profile: Profile) -> str:
    """The profile's path relative to the repository root (so the output does not depend
    on the machine), or its absolute path when it lives elsewhere."""
    path = Path(profile.source_path).resolve()
    try:
        return path.relative_to(REPO_ROOT).as_posix()
    except ValueError:
        return path.as_posix()


def _sorted_parameters(params: dict[str, str]) -> list[tuple[str, str]]:
    return sorted(params.items())


# The Python backend's parameter naming the environment a model's stub runs in.
EXECUTION_ENV_PARAMETER = "EXECUTION_ENV_PATH"
# The models that get it with --tokenizer-env: the ones that read BYTES tensors.
TOKENIZER_MODELS = ("preprocessing", "postprocessing")


def visible_gpu_count() -> int | None:
    """GPUs on this machine (`nvidia-smi -L`, else torch.cuda.device_count()), or None
    when no GPU tooling answers (a CPU-only machine)."""
    import shutil
    import subprocess

    if shutil.which("nvidia-smi"):
        try:
            listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
            if listing.returncode == 0:
                return sum(1 for line in listing.stdout.splitlines() if line.startswith("GPU "))
        except (OSError, subprocess.TimeoutExpired):
            pass
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.device_count()
    except Exception:  # noqa: BLE001 - no usable torch: no answer
        pass
    return None


def check_devices(profile: Profile, gpu_count: int | None) -> str | None:
    """Refuse a `device.gpu_ids` entry this machine does not have (ProfileError naming the
    key); returns a note when the check cannot run (no GPU visible), else None."""
    engine = profile.engine
    if engine.device != "gpu":
        return None
    if gpu_count is None or gpu_count == 0:
        return (
            f"note: no GPU is visible on this machine; device.gpu_ids {list(engine.gpu_ids)} "
            "not checked against devices"
        )
    for index, gpu in enumerate(engine.gpu_ids):
        if gpu >= gpu_count:
            raise ProfileError(
                str(profile.source_path),
                f"device.gpu_ids[{index}]",
                f"GPU {gpu} does not exist on this machine: it has {gpu_count} GPU(s), ids 0 .. {gpu_count - 1} "
                "(use --no-device-check to render for another machine)",
            )
    return None


def engine_instances(profile: Profile) -> list[dict]:
    """The engine's instance groups: one KIND_CPU instance (it places itself on gpu_ids),
    or with data parallelism one KIND_GPU instance per tensor-parallel group, on the
    group's first GPU."""
    engine = profile.engine
    if engine.data_parallel_size == 1:
        return [{"kind": "KIND_CPU", "gpus": []}]
    tp = engine.tensor_parallel_size
    return [
        {"kind": "KIND_GPU", "gpus": [engine.gpu_ids[i * tp]]} for i in range(engine.data_parallel_size)
    ]


def template_context(profile: Profile, tokenizer_env: str | None = None) -> dict:
    """Everything the templates use. `tokenizer_env`: see --tokenizer-env."""
    model_params = profile.model.to_parameters()
    tokenizer_params = dict(model_params)
    if tokenizer_env:
        tokenizer_params[EXECUTION_ENV_PARAMETER] = str(tokenizer_env)
    engine = profile.engine
    preprocessing_params = dict(tokenizer_params)
    preprocessing_params.update(
        max_input_length=str(engine.max_input_length),
        max_output_len=str(engine.max_output_len),
        priority_levels=str(engine.priority_levels),
        max_model_len=str(profile.context_length()),
    )
    engine_params = dict(engine.to_parameters())
    overlap = set(engine_params) & set(model_params)
    if overlap:  # the two parameter sets must stay disjoint to round-trip
        raise AssertionError(f"engine and model parameters share keys: {sorted(overlap)}")
    engine_params.update(model_params)
    # Not an EngineConfig field: the engine model keeps a stream's pieces in order when >1 (ResponseSender).
    engine_params["postprocessing_instances"] = str(profile.instances_postprocessing)
    return {
        "header": (
            f"# Rendered by tools/render_configs.py from {profile_display_path(profile)}"
            " — do not edit; edit the profile or templates/."
        ),
        "profile": profile,
        "max_batch_size": TRITON_MAX_BATCH_SIZE,
        "ensemble_inputs": ENSEMBLE_INPUTS,
        "ensemble_outputs": ENSEMBLE_OUTPUTS,
        "preprocessing_to_engine": PREPROCESSING_TO_ENGINE,
        "engine_inputs": ENGINE_INPUTS,
        "engine_outputs": ENGINE_OUTPUTS + ENGINE_TO_POSTPROCESSING[1:],
        "engine_to_postprocessing": ENGINE_TO_POSTPROCESSING,
        "preprocessing_prefix": PREPROCESSING_PREFIX,
        "engine_prefix": ENGINE_PREFIX,
        "preferred_batch_size": list(profile.preferred_batch_size),
        "max_queue_delay_microseconds": profile.max_queue_delay_microseconds,
        "instances_preprocessing": profile.instances_preprocessing,
        "instances_postprocessing": profile.instances_postprocessing,
        "preprocessing_parameters": _sorted_parameters(preprocessing_params),
        "engine_parameters": _sorted_parameters(engine_params),
        "engine_instances": engine_instances(profile),
        "postprocessing_parameters": _sorted_parameters(tokenizer_params),
    }


def _environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATES_DIR)),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
    )


def _pbtxt_string(value: str) -> str:
    """A protobuf text-format string literal."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def render_files(profile: Profile, tokenizer_env: str | None = None) -> dict[str, bytes]:
    """The rendered repository as {relative posix path: content}, nothing written."""
    environment = _environment()
    environment.filters["pbtxt_string"] = _pbtxt_string
    context = template_context(profile, tokenizer_env)
    files: dict[str, bytes] = {}
    for model in MODELS:
        text = environment.get_template(f"{model}.pbtxt.j2").render(**context)
        files[f"{model}/config.pbtxt"] = text.encode()
    files["ensemble/1/.gitkeep"] = b""
    for model in PYTHON_MODELS:
        source = MODEL_SOURCES_DIR / f"{model}.py"
        if source.is_file():
            files[f"{model}/1/model.py"] = source.read_bytes()
    return dict(sorted(files.items()))


def _existing_files(out_dir: Path) -> set[str]:
    """Files inside the four model folders of out_dir (never under __pycache__)."""
    found: set[str] = set()
    for model in MODELS:
        model_dir = out_dir / model
        if not model_dir.is_dir():
            continue
        for root, dirs, names in os.walk(model_dir):
            dirs[:] = sorted(d for d in dirs if d not in IGNORED_NAMES)
            for name in names:
                found.add((Path(root) / name).relative_to(out_dir).as_posix())
    return found


def render(profile: Profile, out_dir, tokenizer_env: str | None = None) -> list[str]:
    """Write the rendered repository into out_dir; returns the paths written or removed
    (files whose content was already right are left untouched)."""
    out_dir = Path(out_dir)
    files = render_files(profile, tokenizer_env)
    changed: list[str] = []
    for model in MODELS:
        (out_dir / model / "1").mkdir(parents=True, exist_ok=True)
    for relative, content in files.items():
        target = out_dir / relative
        if target.is_file() and target.read_bytes() == content:
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(content)
        changed.append(relative)
    for relative in sorted(_existing_files(out_dir) - set(files)):
        (out_dir / relative).unlink()
        changed.append(relative)
    _remove_empty_stale_dirs(out_dir)
    return changed


def _remove_empty_stale_dirs(out_dir: Path) -> None:
    for model in MODELS:
        for root, _dirs, _files in os.walk(out_dir / model, topdown=False):
            path = Path(root)
            if any(part in IGNORED_NAMES for part in path.relative_to(out_dir).parts):
                continue
            if path in (out_dir / model, out_dir / model / "1"):
                continue
            if not any(path.iterdir()):
                path.rmdir()


def check(profile: Profile, out_dir, tokenizer_env: str | None = None) -> list[str]:
    """Compare out_dir with a fresh render; returns one description per drifted file
    (a unified diff for a changed file), empty when they match."""
    out_dir = Path(out_dir)
    files = render_files(profile, tokenizer_env)
    drift: list[str] = []
    for relative, content in files.items():
        target = out_dir / relative
        if not target.is_file():
            drift.append(f"missing: {relative}")
            continue
        actual = target.read_bytes()
        if actual == content:
            continue
        try:
            diff = difflib.unified_diff(
                actual.decode().splitlines(keepends=True),
                content.decode().splitlines(keepends=True),
                fromfile=f"{out_dir.as_posix()}/{relative}",
                tofile=f"rendered/{relative}",
            )
            drift.append(f"differs: {relative}\n" + "".join(diff).rstrip("\n"))
        except UnicodeDecodeError:
            drift.append(f"differs: {relative} (binary)")
    for relative in sorted(_existing_files(out_dir) - set(files)):
        drift.append(f"extra: {relative} (the render does not produce it)")
    return drift


def fix_advice(profile: Profile, profile_arg, out_dir) -> str:
    """What to run after `--check` found drift. The committed `model_repo/` belongs to the
    default profile: for another profile, advise a folder of its own, never a command
    that would overwrite the committed repository."""
    committed = (REPO_ROOT / "model_repo").resolve()
    is_default = Path(profile.source_path).resolve() == DEFAULT_PROFILE.resolve()
    if Path(out_dir).resolve() == committed and not is_default:
        own = f"build/model_repo-{profile.name}"
        return (f"model_repo/ is the render of the default profile ({profile_display_path_of(DEFAULT_PROFILE)}), "
                f"so it differs from {profile_arg} by design; render this profile into a folder of its own: "
                f"python tools/render_configs.py --profile {profile_arg} --out {own} "
                f"(make render-configs PROFILE={profile_arg} OUT={own})")
    return f"run: python tools/render_configs.py --profile {profile_arg} --out {out_dir}"


def profile_display_path_of(path: Path) -> str:
    try:
        return Path(path).resolve().relative_to(REPO_ROOT).as_posix()
    except ValueError:
        return Path(path).as_posix()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Render a profile into a Triton model repository.")
    parser.add_argument("--profile", type=Path, default=DEFAULT_PROFILE, help="profile YAML (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "model_repo", help="output folder (default: %(default)s)")
    parser.add_argument("--check", action="store_true", help="compare --out with a fresh render; write nothing")
    parser.add_argument(
        "--no-device-check",
        action="store_true",
        help="do not check device.gpu_ids against this machine's GPUs (rendering for another machine)",
    )
    parser.add_argument(
        "--tokenizer-env",
        metavar="PATH",
        help="EXECUTION_ENV_PATH of preprocessing and postprocessing: a NumPy < 2 venv (GPU hosts with NumPy 2)",
    )
    args = parser.parse_args(argv)
    if args.tokenizer_env is not None and not args.tokenizer_env.strip():
        print("--tokenizer-env: must not be empty (leave the option out for no environment)", file=sys.stderr)
        return 2
    try:
        profile = load_profile(args.profile)
        if not args.no_device_check and not args.check:
            note = check_devices(profile, visible_gpu_count())
            if note:
                print(note, file=sys.stderr)
    except ProfileError as error:
        print(error, file=sys.stderr)
        return 2
    if args.check:
        drift = check(profile, args.out, args.tokenizer_env)
        if drift:
            for item in drift:
                print(item)
            print(f"{args.out}: {len(drift)} file(s) differ from a fresh render of {args.profile}; "
                  + fix_advice(profile, args.profile, args.out))
            return 1
        print(f"{args.out}: up to date with {args.profile}")
        return 0
    changed = render(profile, args.out, args.tokenizer_env)
    total = len(render_files(profile, args.tokenizer_env))
    print(f"rendered {args.profile} into {args.out}: {total} files, {len(changed)} written or removed")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
