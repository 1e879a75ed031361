"""`--tokenizer-env`: EXECUTION_ENV_PATH for the models that read BYTES, never the engine."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from inflightllm.profile import DEFAULT_PROFILE, REPO_ROOT, load_profile
from tools import render_configs, serve

ENV = "/root/inflightllm-bundle/venv-np1"
PARAMETER_BLOCK = [
    "parameters {\n",
    '  key: "EXECUTION_ENV_PATH"\n',
    f'  value: {{ string_value: "{ENV}" }}\n',
    "}\n",
]
PROFILES = sorted((REPO_ROOT / "profiles").glob("*.yaml"))


def _without_block(text: bytes) -> bytes:
    """The text with the EXECUTION_ENV_PATH parameter block removed (it must be there once)."""
    block = "".join(PARAMETER_BLOCK).encode()
    assert text.count(block) == 1
    return text.replace(block, b"", 1)


@pytest.mark.parametrize("profile_path", PROFILES, ids=lambda p: p.stem)
def test_tokenizer_env_adds_one_parameter_to_preprocessing_and_postprocessing_only(profile_path):
    profile = load_profile(profile_path)
    plain = render_configs.render_files(profile)
    with_env = render_configs.render_files(profile, tokenizer_env=ENV)
    assert sorted(plain) == sorted(with_env)
    for name in plain:
        if name in ("preprocessing/config.pbtxt", "postprocessing/config.pbtxt"):
            assert _without_block(with_env[name]) == plain[name], name
        else:  # the engine (DLPack, NumPy 2, CuPy) and the ensemble are untouched
            assert plain[name] == with_env[name], name


def test_no_tokenizer_env_is_the_committed_render():
    profile = load_profile(DEFAULT_PROFILE)
    assert render_configs.render_files(profile) == render_configs.render_files(profile, tokenizer_env=None)
    assert render_configs.render_files(profile) == render_configs.render_files(profile, tokenizer_env="")
    assert b"EXECUTION_ENV_PATH" not in b"".join(render_configs.render_files(profile).values())


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "tools/render_configs.py", *args], cwd=REPO_ROOT, capture_output=True, text=True
    )


def test_cli_renders_and_checks_with_the_option(tmp_path):
    out = tmp_path / "repo"
    result = _cli("--profile", "profiles/smollm2-random-cpu.yaml", "--out", str(out), "--tokenizer-env", ENV)
    assert result.returncode == 0, result.stderr
    assert f'string_value: "{ENV}"' in (out / "preprocessing" / "config.pbtxt").read_text()
    assert "EXECUTION_ENV_PATH" not in (out / "engine" / "config.pbtxt").read_text()
    result = _cli("--profile", "profiles/smollm2-random-cpu.yaml", "--out", str(out), "--check", "--tokenizer-env", ENV)
    assert result.returncode == 0, result.stdout
    result = _cli("--profile", "profiles/smollm2-random-cpu.yaml", "--out", str(out), "--check")
    assert result.returncode == 1
    assert "differs: postprocessing/config.pbtxt" in result.stdout
    assert "differs: preprocessing/config.pbtxt" in result.stdout
    assert "engine/config.pbtxt" not in result.stdout


def test_cli_refuses_an_empty_tokenizer_env(tmp_path):
    result = _cli("--profile", "profiles/smollm2-cpu.yaml", "--out", str(tmp_path), "--tokenizer-env", " ")
    assert result.returncode == 2
    assert result.stderr == "--tokenizer-env: must not be empty (leave the option out for no environment)\n"
    assert not any(tmp_path.iterdir())


def test_serve_renders_even_the_default_profile_elsewhere_with_a_tokenizer_env(tmp_path):
    profile = load_profile(DEFAULT_PROFILE)
    repository = serve.repository_for(profile, build_dir=tmp_path, tokenizer_env=ENV)
    assert repository == tmp_path / "model_repo-smollm2-cpu-tokenizer-env"
    assert f'string_value: "{ENV}"' in (repository / "postprocessing" / "config.pbtxt").read_text()
    assert serve.repository_for(profile, build_dir=tmp_path) == Path(REPO_ROOT) / "model_repo"


def test_serve_refuses_a_tokenizer_env_that_is_not_a_venv(tmp_path, capsys):
    assert serve.main(["--tokenizer-env", str(tmp_path)]) == 2
    assert capsys.readouterr().err == f"--tokenizer-env: {tmp_path} is not a venv (no bin/activate)\n"
