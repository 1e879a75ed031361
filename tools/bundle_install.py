"""Install the air-gapped bundle (tools/bundle.py) on a GPU host, one part at a time.

Runs with the host's own `python3` (standard library only; no package index there).
Every part of the bundle holds this script, `install.sh` (which runs it) and
`MANIFEST.json` (the whole bundle: every file, its part and sha256, and the components
they make). Each run:

1. copies this part's files into `<prefix>/parts/<bundle id>/` (sha256 checked), so
   parts may arrive over several sessions or device calls (a checkout that is copied
   afresh each time is fine: the files live outside it afterwards);
2. creates, once, the two environments that the server needs:
   - `<prefix>/venv`: a plain venv whose `.pth` names the repository, `<prefix>/site`
     (the bundle's packages) and the host Python's site-packages (torch, CuPy, NumPy 2,
     transformers, ...). `make serve-bundle` runs `tools/serve.py` with it; the engine
     model runs in it (DLPack, NumPy 2, CuPy);
   - `<prefix>/venv-np1`: the same plus NumPy 1.26 in its own site-packages (first on
     `sys.path`, so it shadows the host's NumPy 2), for the models that read BYTES
     tensors (preprocessing, postprocessing: `EXECUTION_ENV_PATH`). The host's SciPy,
     built for NumPy 2, is hidden there (`_inflightllm_numpy1.py`): transformers then
     treats SciPy as absent instead of failing to import (docs/RUNTIME-NOTES.md);
3. installs every component whose files are all there and that is not installed yet
   (`<prefix>/.installed/<name>` holds the sha256 it was installed from):
   `tar` components are extracted, `wheel` components are joined from their chunks,
   checked and unpacked into `<prefix>/site`; a component with `prepare_profile`
   then prepares (converts and caches) that profile's model in `<prefix>/cache`;
4. writes `<prefix>/env.sh` and prints what is installed and which parts are missing.

Usage (on the host, from the repository root):
  bash build/bundle/part1/install.sh [--prefix /root/inflightllm-bundle] [--repo .]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import site
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

DEFAULT_PREFIX = Path(os.environ.get("INFLIGHTLLM_BUNDLE_PREFIX", str(Path.home() / "inflightllm-bundle")))
MANIFEST_NAME = "MANIFEST.json"
# Modules hidden from the NumPy < 2 environment: the host's builds need NumPy 2 and fail
# at import under 1.26 ("module 'numpy' has no attribute 'long'"), which breaks
# `from transformers import AutoTokenizer`; transformers runs fine without them.
HIDDEN_IN_NUMPY1_ENV = ("scipy", "sklearn")
NUMPY1_HOOK_MODULE = "_inflightllm_numpy1"
PTH_NAME = "inflightllm-bundle.pth"


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class Layout:
    """The folders of an installed bundle under `prefix`."""

    def __init__(self, prefix: Path, bundle_id: str):
        self.prefix = Path(prefix).absolute()
        self.parts = self.prefix / "parts" / bundle_id
        self.stamps = self.prefix / ".installed"
        self.site = self.prefix / "site"
        self.venv = self.prefix / "venv"
        self.venv_np1 = self.prefix / "venv-np1"
        self.cache = self.prefix / "cache"
        self.server = self.prefix / "tritonserver"
        self.bin = self.prefix / "bin"


def bundle_id(manifest: dict) -> str:
    """Names one build of the bundle: parts of another build are kept apart."""
    text = json.dumps(manifest["files"], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


# --- step 1: the part's files -------------------------------------------------------------


def copy_part(part_dir: Path, manifest: dict, layout: Layout, part: str) -> list[str]:
    """Copy this part's files into the parts folder, checking each sha256."""
    layout.parts.mkdir(parents=True, exist_ok=True)
    copied = []
    for name, entry in sorted(manifest["files"].items()):
        if entry["part"] != part:
            continue
        source = part_dir / name
        target = layout.parts / name
        if target.is_file() and target.stat().st_size == entry["size"] and sha256_of(target) == entry["sha256"]:
            continue
        if not source.is_file():
            raise SystemExit(f"install: {source} is missing from {part} (the bundle is incomplete)")
        if sha256_of(source) != entry["sha256"]:
            raise SystemExit(f"install: {source} does not match the manifest's sha256 (damaged in transit?)")
        tmp = target.with_name(target.name + ".tmp")
        shutil.copyfile(source, tmp)
        tmp.rename(target)
        copied.append(name)
    shutil.copyfile(part_dir / MANIFEST_NAME, layout.parts / MANIFEST_NAME)
    return copied


def present(manifest: dict, layout: Layout, name: str) -> bool:
    entry = manifest["files"][name]
    path = layout.parts / name
    return path.is_file() and path.stat().st_size == entry["size"]


# --- step 2: the environments ---------------------------------------------------------------


def venv_purelib(venv: Path) -> Path:
    """The venv's site-packages, as its own Python names it."""
    out = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    )
    return Path(out.stdout.strip())


def host_site_packages() -> list[str]:
    """The site-packages of the Python running this script (the host venv's)."""
    return [path for path in site.getsitepackages() if Path(path).is_dir()]


def numpy1_hook_source(hidden: tuple[str, ...] = HIDDEN_IN_NUMPY1_ENV) -> str:
    return (
        '"""Written by tools/bundle_install.py: hides modules built for NumPy 2 from this NumPy < 2\n'
        'environment, so that importing them fails cleanly (ModuleNotFoundError) and optional users\n'
        '(transformers) treat them as absent."""\n'
        "import sys\n"
        "from importlib.machinery import PathFinder\n\n"
        f"HIDDEN = {tuple(hidden)!r}\n\n\n"
        "class _Hide:\n"
        "    def __init__(self, inner):\n"
        "        self.inner = inner\n\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        '        if name.partition(".")[0] in HIDDEN:\n'
        "            return None\n"
        "        return self.inner.find_spec(name, path, target)\n\n"
        "    def __getattr__(self, attribute):\n"
        "        return getattr(self.inner, attribute)\n\n\n"
        "sys.meta_path[:] = [_Hide(finder) if finder is PathFinder else finder for finder in sys.meta_path]\n"
    )


def make_venv(venv: Path, lines: list[str], numpy1_hook: bool) -> Path:
    """Create a plain venv once (no pip) and (re)write its .pth; returns its site-packages."""
    if not (venv / "bin" / "python").exists():
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    purelib = venv_purelib(venv)
    purelib.mkdir(parents=True, exist_ok=True)
    text = "\n".join(lines) + "\n"
    if numpy1_hook:
        (purelib / f"{NUMPY1_HOOK_MODULE}.py").write_text(numpy1_hook_source())
        text += f"import {NUMPY1_HOOK_MODULE}\n"
    (purelib / PTH_NAME).write_text(text)
    return purelib


def make_environments(layout: Layout, repo: Path) -> dict[str, Path]:
    layout.site.mkdir(parents=True, exist_ok=True)
    lines = [str(repo), str(layout.site), *host_site_packages()]
    return {
        "site": layout.site,
        "venv_site": make_venv(layout.venv, lines, numpy1_hook=False),
        "np1_site": make_venv(layout.venv_np1, lines, numpy1_hook=True),
    }


# --- step 3: the components ----------------------------------------------------------------


def component_digest(manifest: dict, component: dict) -> str:
    return hashlib.sha256("".join(manifest["files"][name]["sha256"] for name in component["files"]).encode()).hexdigest()


def destination(layout: Layout, targets: dict[str, Path], dest: str) -> Path:
    if dest.startswith("@"):
        return targets[dest[1:]]
    return layout.prefix / dest


def extract_tar(archive: Path, dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive) as tar:
        if hasattr(tarfile, "data_filter"):
            tar.extractall(dest, filter="data")
        else:  # Python < 3.12 without the backported filters
            tar.extractall(dest)


def join_chunks(layout: Layout, component: dict) -> Path:
    wheel = layout.prefix / "wheels" / component["wheel"]
    wheel.parent.mkdir(parents=True, exist_ok=True)
    if not (wheel.is_file() and sha256_of(wheel) == component["sha256"]):
        tmp = wheel.with_name(wheel.name + ".tmp")
        with open(tmp, "wb") as out:
            for name in component["files"]:
                with open(layout.parts / name, "rb") as chunk:
                    shutil.copyfileobj(chunk, out, 1 << 20)
        if sha256_of(tmp) != component["sha256"]:
            tmp.unlink()
            raise SystemExit(f"install: the joined {component['wheel']} does not match its sha256")
        tmp.rename(wheel)
    return wheel


def unpack_wheel(wheel: Path, site_dir: Path) -> None:
    """A pure-Python wheel unpacked into a --target style folder (what pip does for it)."""
    with zipfile.ZipFile(wheel) as archive:
        for member in archive.namelist():
            if ".data/" in member.split("/", 1)[0] + "/":
                raise SystemExit(f"install: {wheel.name} has a .data folder; only plain wheels are handled")
        archive.extractall(site_dir)


def prepare_model(layout: Layout, repo: Path, profile: str) -> None:
    env = dict(os.environ, INFLIGHTLLM_CACHE_DIR=str(layout.cache))
    print(f"install: preparing the model of {profile} (de-quantising once) ...", flush=True)
    subprocess.run(
        [str(layout.venv / "bin" / "python"), "-m", "inflightllm.model_source", "--profile", str(repo / profile)],
        check=True,
        cwd=repo,
        env=env,
    )


def install_components(
    manifest: dict, layout: Layout, targets: dict[str, Path], repo: Path, prepare: bool = True
) -> tuple[list[str], dict[str, list[str]]]:
    """Install what can be installed; returns (installed now, {component: missing parts})."""
    layout.stamps.mkdir(parents=True, exist_ok=True)
    installed_now: list[str] = []
    waiting: dict[str, list[str]] = {}
    for component in manifest["components"]:
        name = component["name"]
        missing = sorted({manifest["files"][f]["part"] for f in component["files"] if not present(manifest, layout, f)})
        if missing:
            waiting[name] = missing
            continue
        stamp = layout.stamps / name
        digest = component_digest(manifest, component)
        if stamp.is_file() and stamp.read_text().strip() == digest:
            continue
        dest = destination(layout, targets, component["dest"])
        if component["kind"] == "tar":
            if component.get("replace"):
                shutil.rmtree(dest / component["replace"], ignore_errors=True)
            for file_name in component["files"]:
                extract_tar(layout.parts / file_name, dest)
        elif component["kind"] == "wheel":
            unpack_wheel(join_chunks(layout, component), dest)
        else:
            raise SystemExit(f"install: unknown component kind {component['kind']!r}")
        if prepare and component.get("prepare_profile"):
            prepare_model(layout, repo, component["prepare_profile"])
        stamp.write_text(digest + "\n")
        installed_now.append(name)
    return installed_now, waiting


# --- step 4: env.sh and the report -----------------------------------------------------------


def write_env(layout: Layout) -> Path:
    perf_analyzer = layout.site / "bin" / "perf_analyzer"
    if perf_analyzer.is_file():
        layout.bin.mkdir(parents=True, exist_ok=True)
        link = layout.bin / "perf_analyzer"
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(perf_analyzer)
    env_file = layout.prefix / "env.sh"
    env_file.write_text(
        "# Written by tools/bundle_install.py: source it, then `make serve-bundle PROFILE=...`\n"
        f"export INFLIGHTLLM_BUNDLE_PREFIX={layout.prefix}\n"
        f"export INFLIGHTLLM_CACHE_DIR={layout.cache}\n"
        f'export PATH={layout.venv}/bin:{layout.bin}:"$PATH"\n'
    )
    return env_file


def default_repo(script: Path) -> Path:
    """The repository holding build/bundle/<part>/ when the part lies there, else the cwd."""
    candidate = script.resolve().parents[3] if len(script.resolve().parents) > 3 else Path.cwd()
    if (candidate / "inflightllm" / "__init__.py").is_file():
        return candidate
    return Path.cwd()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", type=Path, default=Path(__file__).resolve().parent, help="the part folder")
    parser.add_argument("--prefix", type=Path, default=DEFAULT_PREFIX)
    parser.add_argument("--repo", type=Path, default=None, help="the inflightllm checkout (default: found)")
    parser.add_argument("--no-prepare", action="store_true", help="do not convert the model after installing it")
    args = parser.parse_args(argv)
    part_dir = args.part.resolve()
    repo = (args.repo or default_repo(Path(__file__))).resolve()
    if not (repo / "inflightllm" / "__init__.py").is_file():
        raise SystemExit(f"install: {repo} is not the inflightllm checkout; pass --repo")
    wrapper = json.loads((part_dir / MANIFEST_NAME).read_text())
    manifest, part = wrapper["bundle"], wrapper["part"]
    layout = Layout(args.prefix, bundle_id(manifest))
    copied = copy_part(part_dir, manifest, layout, part)
    print(f"install: {part} of {len(manifest['parts'])} ({', '.join(manifest['parts'])}): "
          f"{len(copied)} file(s) copied to {layout.parts}", flush=True)
    targets = make_environments(layout, repo)
    installed_now, waiting = install_components(manifest, layout, targets, repo, prepare=not args.no_prepare)
    env_file = write_env(layout)
    for name in installed_now:
        print(f"install: installed {name}")
    done = [c["name"] for c in manifest["components"] if c["name"] not in waiting]
    print(f"install: ready: {', '.join(done) or 'nothing yet'}")
    for name, parts in waiting.items():
        print(f"install: {name} waits for {', '.join(parts)}")
    print(f"install: environment: source {env_file}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
