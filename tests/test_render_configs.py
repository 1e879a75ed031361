"""tools/render_configs.py: determinism, the committed model_repo, --check, the CLI,
parameter round trips, and the ensemble's wiring (configs parsed with Triton's own
ModelConfig protobuf, so a misspelt field fails here too)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from inflightllm.config import EngineConfig
from inflightllm.model_source import ModelSpec
from inflightllm.profile import DEFAULT_PROFILE, REPO_ROOT, load_profile

sys.path.insert(0, str(REPO_ROOT))
from tools import render_configs  # noqa: E402

SCRIPT = REPO_ROOT / "tools" / "render_configs.py"
MODELS = ("ensemble", "preprocessing", "engine", "postprocessing")
PROFILES = sorted((REPO_ROOT / "profiles").glob("*.yaml"))
# docs/INTERFACE.md writes BYTES; Triton's config calls it TYPE_STRING.
DOC_TYPES = {"BYTES": "TYPE_STRING", "INT32": "TYPE_INT32", "INT64": "TYPE_INT64", "UINT64": "TYPE_UINT64", "UINT8": "TYPE_UINT8",
             "FP32": "TYPE_FP32", "BOOL": "TYPE_BOOL"}


@pytest.fixture(scope="module")
def default_profile():
    return load_profile(DEFAULT_PROFILE)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )


def all_files(folder: Path) -> dict[str, bytes]:
    return {
        path.relative_to(folder).as_posix(): path.read_bytes()
        for path in sorted(folder.rglob("*"))
        if path.is_file() and "__pycache__" not in path.parts
    }


def parse_config(path: Path) -> model_config_pb2.ModelConfig:
    return text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())


def parameters(config: model_config_pb2.ModelConfig) -> dict[str, str]:
    return {key: value.string_value for key, value in config.parameters.items()}


def tensors(items) -> list[tuple[str, str, list[int], bool]]:
    return [
        (t.name, model_config_pb2.DataType.Name(t.data_type), list(t.dims), bool(getattr(t, "optional", False)))
        for t in items
    ]


def interface_table(heading: str, optional_column: bool = False) -> list[tuple[str, str, list[int], bool]]:
    """The tensors of one table of docs/INTERFACE.md, in order."""
    text = (REPO_ROOT / "docs" / "INTERFACE.md").read_text()
    section = text.split(f"## {heading}\n", 1)[1].split("\n#", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0].startswith("`"):
            continue
        dims = [int(d) for d in cells[2].strip("[]").split(",")]
        optional = optional_column and cells[3] != "required"
        for name in re.findall(r"`([^`]+)`", cells[0]):
            rows.append((name, DOC_TYPES[cells[1]], dims, optional))
    return rows


# --- determinism and the committed repository ------------------------------------------------


def test_render_is_deterministic(tmp_path, default_profile):
    render_configs.render(default_profile, tmp_path / "a")
    render_configs.render(default_profile, tmp_path / "b")
    first, second = all_files(tmp_path / "a"), all_files(tmp_path / "b")
    assert first == second
    assert {f"{model}/config.pbtxt" for model in MODELS} | {"ensemble/1/.gitkeep"} <= set(first)
    for model in MODELS:
        assert (tmp_path / "a" / model / "1").is_dir()
    # A second render into the same folder changes nothing.
    assert render_configs.render(default_profile, tmp_path / "a") == []


def test_committed_model_repo_matches_a_fresh_render(default_profile):
    drift = render_configs.check(default_profile, REPO_ROOT / "model_repo")
    assert drift == [], (
        "model_repo/ drifted from a fresh render; run "
        "`python tools/render_configs.py --profile profiles/smollm2-cpu.yaml --out model_repo`:\n"
        + "\n".join(drift)
    )


def test_model_sources_are_copied(tmp_path, default_profile, monkeypatch):
    sources = tmp_path / "sources"
    sources.mkdir()
    (sources / "engine.py").write_text("# engine adapter\n")
    (sources / "postprocessing.py").write_text("# postprocessing adapter\n")
    monkeypatch.setattr(render_configs, "MODEL_SOURCES_DIR", sources)
    out = tmp_path / "repo"
    render_configs.render(default_profile, out)
    assert (out / "engine" / "1" / "model.py").read_text() == "# engine adapter\n"
    assert (out / "postprocessing" / "1" / "model.py").read_text() == "# postprocessing adapter\n"
    assert not (out / "preprocessing" / "1" / "model.py").exists()
    assert render_configs.check(default_profile, out) == []

    (sources / "engine.py").write_text("# engine adapter, new\n")
    drift = render_configs.check(default_profile, out)
    assert len(drift) == 1 and drift[0].startswith("differs: engine/1/model.py\n")
    assert "+# engine adapter, new" in drift[0]


def test_stale_files_inside_model_folders_are_removed(tmp_path, default_profile):
    out = tmp_path / "repo"
    render_configs.render(default_profile, out)
    (out / "engine" / "2").mkdir()
    (out / "engine" / "2" / "model.py").write_text("old version\n")
    (out / "engine" / "notes.txt").write_text("stale\n")
    (out / "engine" / "1" / "__pycache__").mkdir()
    (out / "engine" / "1" / "__pycache__" / "model.cpython-311.pyc").write_bytes(b"\0")
    (out / "README.md").write_text("not a model folder\n")
    (out / "other_model").mkdir()
    (out / "other_model" / "config.pbtxt").write_text("name: 'other'\n")

    assert render_configs.check(default_profile, out) == [
        "extra: engine/2/model.py (the render does not produce it)",
        "extra: engine/notes.txt (the render does not produce it)",
    ]
    assert render_configs.render(default_profile, out) == ["engine/2/model.py", "engine/notes.txt"]
    assert not (out / "engine" / "2").exists()
    assert not (out / "engine" / "notes.txt").exists()
    assert (out / "engine" / "1" / "__pycache__" / "model.cpython-311.pyc").exists()
    assert (out / "README.md").exists()
    assert (out / "other_model" / "config.pbtxt").exists()
    assert render_configs.check(default_profile, out) == []


def test_check_reports_missing_files(tmp_path, default_profile):
    out = tmp_path / "repo"
    render_configs.render(default_profile, out)
    (out / "engine" / "config.pbtxt").unlink()
    assert render_configs.check(default_profile, out) == ["missing: engine/config.pbtxt"]
    assert "missing: engine/config.pbtxt" in render_configs.check(default_profile, tmp_path / "absent")


def test_header_names_the_profile_relative_to_the_repository(tmp_path, default_profile):
    render_configs.render(default_profile, tmp_path)
    for model in MODELS:
        first_line = (tmp_path / model / "config.pbtxt").read_text().splitlines()[0]
        assert first_line == (
            "# Rendered by tools/render_configs.py from profiles/smollm2-cpu.yaml"
            " — do not edit; edit the profile or templates/."
        )


# --- the CLI ------------------------------------------------------------------------------------


def test_cli_render_then_check(tmp_path):
    out = tmp_path / "repo"
    result = run_cli("--profile", "profiles/smollm2-cpu.yaml", "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("\n") == 1 and result.stdout.startswith("rendered profiles/smollm2-cpu.yaml")

    result = run_cli("--profile", "profiles/smollm2-cpu.yaml", "--out", str(out), "--check")
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout == f"{out}: up to date with profiles/smollm2-cpu.yaml\n"

    config = out / "postprocessing" / "config.pbtxt"
    config.write_text(config.read_text().replace("count: 1", "count: 2"))
    result = run_cli("--profile", "profiles/smollm2-cpu.yaml", "--out", str(out), "--check")
    assert result.returncode == 1
    assert "differs: postprocessing/config.pbtxt" in result.stdout
    assert "-    count: 2" in result.stdout
    assert "+    count: 1" in result.stdout
    assert "engine/config.pbtxt" not in result.stdout


def test_cli_bad_profile_exits_2_and_writes_nothing(tmp_path):
    data = yaml.safe_load(DEFAULT_PROFILE.read_text())
    data["engine"]["block_size"] = 24
    profile = tmp_path / "bad.yaml"
    profile.write_text(yaml.safe_dump(data))
    out = tmp_path / "out"
    result = run_cli("--profile", str(profile), "--out", str(out))
    assert result.returncode == 2
    assert result.stderr == f"{profile}: engine.block_size: 24 is not allowed; allowed values: 8, 16, 32, 64, 128\n"
    assert result.stdout == ""
    assert not out.exists()
    result = run_cli("--profile", str(profile), "--out", str(out), "--check")
    assert result.returncode == 2
    assert not out.exists()


# --- parameters -----------------------------------------------------------------------------------


@pytest.mark.parametrize("profile_path", PROFILES, ids=lambda p: p.stem)
def test_parameters_round_trip(tmp_path, profile_path):
    profile = load_profile(profile_path)
    render_configs.render(profile, tmp_path)
    engine_params = parameters(parse_config(tmp_path / "engine" / "config.pbtxt"))
    assert EngineConfig.from_parameters(engine_params) == profile.engine
    assert ModelSpec.from_parameters(engine_params) == profile.model
    assert set(engine_params) == set(profile.engine.to_parameters()) | set(profile.model.to_parameters()) | {
        "postprocessing_instances"}
    assert engine_params["postprocessing_instances"] == str(profile.instances_postprocessing)

    pre_params = parameters(parse_config(tmp_path / "preprocessing" / "config.pbtxt"))
    assert ModelSpec.from_parameters(pre_params) == profile.model
    assert {key: pre_params[key] for key in ("max_input_length", "max_output_len", "priority_levels", "max_model_len")} == {
        "max_input_length": str(profile.engine.max_input_length),
        "max_output_len": str(profile.engine.max_output_len),
        "priority_levels": str(profile.engine.priority_levels),
        "max_model_len": str(profile.context_length()),
    }

    post_params = parameters(parse_config(tmp_path / "postprocessing" / "config.pbtxt"))
    assert post_params == profile.model.to_parameters()

    for model in MODELS:
        text = (tmp_path / model / "config.pbtxt").read_text()
        keys = re.findall(r'^  key: "([^"]+)"$', text, flags=re.MULTILINE)
        assert keys == sorted(keys)


def test_profile_settings_reach_the_configs(tmp_path, default_profile):
    render_configs.render(default_profile, tmp_path)
    pre = parse_config(tmp_path / "preprocessing" / "config.pbtxt")
    post = parse_config(tmp_path / "postprocessing" / "config.pbtxt")
    engine = parse_config(tmp_path / "engine" / "config.pbtxt")
    for config, count in ((pre, 2), (post, 1), (engine, 1)):
        assert config.backend == "python"
        assert [(group.count, model_config_pb2.ModelInstanceGroup.Kind.Name(group.kind)) for group in config.instance_group] == [
            (count, "KIND_CPU")
        ]
    assert list(pre.dynamic_batching.preferred_batch_size) == [4, 8]
    assert pre.dynamic_batching.max_queue_delay_microseconds == 500
    # postprocessing stays on the default scheduler: it must see cancelled pieces.
    assert not post.HasField("dynamic_batching")
    assert engine.model_transaction_policy.decoupled is True
    assert engine.HasField("dynamic_batching")


# --- tensors and ensemble wiring ------------------------------------------------------------------


@pytest.fixture(scope="module")
def configs(tmp_path_factory, default_profile):
    out = tmp_path_factory.mktemp("repo")
    render_configs.render(default_profile, out)
    return {model: parse_config(out / model / "config.pbtxt") for model in MODELS}


def test_tensors_follow_the_interface_document(configs):
    ensemble_inputs = interface_table("Ensemble inputs", optional_column=True)
    ensemble_outputs = interface_table("Ensemble outputs (every response)")
    # The section ends with the engine's control input, cancel_request.
    *to_engine, control = interface_table("preprocessing → engine")
    assert control[0] == "cancel_request"
    to_postprocessing = interface_table("engine → postprocessing")  # packed (inflightllm/packed_outputs.py)
    engine_outputs = interface_table("engine outputs (called directly)")
    # text_input is optional in the config: messages can replace it.
    ensemble_inputs = [(n, t, d, True if n == "text_input" else o) for n, t, d, o in ensemble_inputs]
    assert [row[0] for row in ensemble_inputs if not row[3]] == []  # preprocessing names what is missing
    assert len(ensemble_inputs) == 39 and len(ensemble_outputs) == 14
    assert len(to_engine) == 29 and len(to_postprocessing) == 3 and len(engine_outputs) == 13
    assert to_postprocessing[0] == engine_outputs[0]  # request_handle: in both sets

    assert tensors(configs["ensemble"].input) == ensemble_inputs
    assert tensors(configs["ensemble"].output) == ensemble_outputs
    assert tensors(configs["preprocessing"].input) == ensemble_inputs
    assert tensors(configs["preprocessing"].output) == to_engine
    # The engine's inputs are all optional (a control request carries cancel_request alone).
    assert tensors(configs["engine"].input) == [(n, t, d, True) for n, t, d, _ in [*to_engine, control]]
    # The engine declares both sets: the documented outputs, then the two packed ones.
    assert tensors(configs["engine"].output) == engine_outputs + to_postprocessing[1:]
    assert tensors(configs["postprocessing"].input) == to_postprocessing
    assert tensors(configs["postprocessing"].output) == ensemble_outputs


def test_ensemble_wiring_is_complete(configs):
    ensemble = configs["ensemble"]
    assert ensemble.platform == "ensemble"
    for model in MODELS[1:]:
        assert 0 < ensemble.max_batch_size <= configs[model].max_batch_size
    steps = {step.model_name: step for step in ensemble.ensemble_scheduling.step}
    assert [step.model_name for step in ensemble.ensemble_scheduling.step] == list(MODELS[1:])
    assert all(step.model_version == -1 for step in steps.values())

    def names(items) -> set[str]:
        return {item.name for item in items}

    pre, engine, post = steps["preprocessing"], steps["engine"], steps["postprocessing"]
    # Every ensemble input goes to preprocessing's input of the same name.
    assert dict(pre.input_map) == {name: name for name in names(ensemble.input)}
    # Each step maps exactly its model's inputs and outputs.
    for model, step in steps.items():
        control = {"cancel_request"} if model == "engine" else set()  # sent by postprocessing, not mapped
        assert set(step.input_map) == names(configs[model].input) - control, model
        # the engine's step maps only its packed outputs: postprocessing's inputs
        produced_here = names(configs["postprocessing"].input) if model == "engine" else names(configs[model].output)
        assert set(step.output_map) == produced_here, model
    # Internal tensors start with `_` and are each produced once.
    produced = {}
    for model in MODELS[1:]:
        for tensor in steps[model].output_map.values():
            assert tensor not in produced, tensor
            produced[tensor] = model
    internal = [t for t in produced if t not in names(ensemble.output)]
    assert internal and all(t.startswith("_") for t in internal)
    # Every engine input is fed by preprocessing; every postprocessing input by the engine.
    assert {produced[t] for t in engine.input_map.values()} == {"preprocessing"}
    assert {produced[t] for t in post.input_map.values()} == {"engine"}
    # Every internal tensor is consumed.
    consumed = set(engine.input_map.values()) | set(post.input_map.values())
    assert set(internal) == consumed
    # All ensemble outputs come from postprocessing, same names.
    assert dict(post.output_map) == {name: name for name in names(ensemble.output)}
    # Types agree across each internal link.
    types = {model: {t.name: (t.data_type, list(t.dims)) for t in configs[model].output} for model in MODELS[1:]}
    for model, step in (("engine", engine), ("postprocessing", post)):
        inputs = {t.name: (t.data_type, list(t.dims)) for t in configs[model].input}
        for key, tensor in step.input_map.items():
            source_model = produced[tensor]
            source_name = next(k for k, v in steps[source_model].output_map.items() if v == tensor)
            assert inputs[key] == types[source_model][source_name], (model, key)


@pytest.mark.parametrize("profile_path", PROFILES, ids=lambda p: p.stem)
def test_every_shipped_profile_renders_valid_configs(tmp_path, profile_path):
    profile = load_profile(profile_path)
    render_configs.render(profile, tmp_path)
    for model in MODELS:
        config = parse_config(tmp_path / model / "config.pbtxt")
        assert config.name == model
        assert config.max_batch_size == 64
    engine = parse_config(tmp_path / "engine" / "config.pbtxt")
    assert parameters(engine)["gpu_ids"] == ",".join(str(i) for i in profile.engine.gpu_ids)


def test_preprocessing_code_emits_exactly_the_rendered_engine_inputs():
    from inflightllm.text.preprocess import ENGINE_REQUEST_DTYPES

    numpy_to_triton = {"int32": "TYPE_INT32", "int64": "TYPE_INT64", "float32": "TYPE_FP32", "bool": "TYPE_BOOL",
                       "uint8": "TYPE_UINT8"}
    emitted = {name: numpy_to_triton[np.dtype(dtype).name] for name, dtype in ENGINE_REQUEST_DTYPES.items()}
    assert emitted == {t.name: t.data_type for t in render_configs.PREPROCESSING_TO_ENGINE}


def test_check_of_another_profile_never_advises_overwriting_model_repo(capsys):
    status = render_configs.main(["--profile", str(REPO_ROOT / "profiles" / "llama3-8b-h200.yaml"), "--check"])
    assert status == 1
    advice = capsys.readouterr().out.splitlines()[-1]
    assert "model_repo/ is the render of the default profile (profiles/smollm2-cpu.yaml)" in advice
    assert "--out build/model_repo-llama3-8b-h200" in advice
    assert not advice.rstrip().endswith("model_repo")  # no command that writes into model_repo/


def test_a_missing_profile_lists_the_profiles_that_exist(tmp_path, capsys):
    assert render_configs.main(["--profile", str(tmp_path / "nope.yaml"), "--out", str(tmp_path / "out")]) == 2
    message = capsys.readouterr().err
    assert "nope.yaml: cannot read the profile: No such file or directory; profiles that exist: " in message
    assert "profiles/smollm2-cpu.yaml" in message and "profiles/llama3-8b-h200.yaml" in message
