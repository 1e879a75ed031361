"""Assemble a runnable Triton server folder from the `nvidia-pytriton` wheel.

The wheel ships `tritonserver` 2.51 as plain files (docs/RUNTIME-NOTES.md). This tool
lays them out as a server folder that `tritonserver --backend-directory` accepts:

    build/tritonserver/
      bin/tritonserver
      backends/python/{libtriton_python.so, triton_python_backend_utils.py,
                       triton_python_backend_stub}   <- the stub of *this* Python
      caches/local/libtritoncache_local.so
      lib/            every shared library of nvidia_pytriton.libs, plus the
                      unhashed names perf_analyzer asks for (libb64.so.0d,
                      libcudart.so.12)
    build/bin/perf_analyzer   (next to the server folder) a bash wrapper that puts
                      that lib/ on LD_LIBRARY_PATH and runs this venv's perf_analyzer

`--copy` copies the libraries instead of linking them (for an offline bundle that
must not point back into a virtual environment); the unhashed alias names are then
relative links to the copies. `--python-version 3.12` takes another Python's stub (the
wheel has 3.8 ... 3.13); the folder then suits a machine whose Python is that version.
`--no-perf-analyzer-wrapper` skips `../bin/perf_analyzer` (a bundle brings its own).
`tools/bundle.py` uses all three for the air-gapped GPU host.

Usage: python tools/build_server.py [--out build/tritonserver] [--copy] [--python-version X.Y]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path

# perf_analyzer (tritonclient 2.51) links these unhashed names; the wheel's hashed
# copies serve under them.
PERF_ANALYZER_ALIASES = {"libb64.so.0d": "libb64-", "libcudart.so.12": "libcudart-"}
# In the wheel's library folder but linked by none of the server's files (pytriton's own
# Python): left out of a copied folder, where it would add 32 MB.
UNNEEDED_LIBRARY_PREFIXES = ("libpython3",)


def pytriton_paths() -> tuple[Path, Path]:
    """Return (server folder inside the wheel, its shared-library folder)."""
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("build_server: nvidia-pytriton is not installed in this Python")
    package_dir = Path(list(spec.submodule_search_locations)[0])
    server_dir = package_dir / "tritonserver"
    libs_dir = package_dir.parent / "nvidia_pytriton.libs"
    for required in (server_dir / "bin" / "tritonserver", libs_dir):
        if not required.exists():
            raise SystemExit(f"build_server: {required} is missing from the nvidia-pytriton wheel")
    return server_dir, libs_dir


def python_version_tag() -> str:
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def _place(src: Path, dst: Path, copy: bool) -> None:
    if dst.is_symlink() or dst.exists():
        dst.unlink()
    if copy:
        shutil.copy2(src, dst)
    else:
        dst.symlink_to(src.resolve())


def build(
    out_dir: Path, copy: bool = False, python_version: str | None = None, perf_analyzer_wrapper: bool = True
) -> Path:
    """Lay out the server folder at `out_dir`; return it. Idempotent.

    `python_version` ("3.12") picks the stub of another Python than this one;
    `perf_analyzer_wrapper=False` writes no `../bin/perf_analyzer`."""
    server_dir, libs_dir = pytriton_paths()
    version = python_version or python_version_tag()
    stub = server_dir / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.exists():
        raise SystemExit(
            f"build_server: the wheel has no Python backend stub for Python {version}"
            f" (looked for {stub})"
        )
    stamp = out_dir / "BUILD_INFO.json"
    info = {
        "source": str(server_dir),
        "python": version,
        "copy": copy,
        "stub_size": stub.stat().st_size,
    }
    if stamp.exists() and json.loads(stamp.read_text()) == info and (out_dir / "bin" / "tritonserver").exists():
        if perf_analyzer_wrapper:
            write_perf_analyzer_wrapper(out_dir)  # refreshed even when the folder is current
        return out_dir

    if out_dir.exists():
        shutil.rmtree(out_dir)
    (out_dir / "bin").mkdir(parents=True)
    (out_dir / "backends" / "python").mkdir(parents=True)
    (out_dir / "caches" / "local").mkdir(parents=True)
    (out_dir / "lib").mkdir(parents=True)

    shutil.copy2(server_dir / "bin" / "tritonserver", out_dir / "bin" / "tritonserver")
    python_backend = server_dir / "backends" / "python"
    for name in ("libtriton_python.so", "triton_python_backend_utils.py"):
        shutil.copy2(python_backend / name, out_dir / "backends" / "python" / name)
    shutil.copy2(stub, out_dir / "backends" / "python" / "triton_python_backend_stub")
    for cache_lib in (server_dir / "caches" / "local").glob("*.so"):
        shutil.copy2(cache_lib, out_dir / "caches" / "local" / cache_lib.name)

    for lib in sorted(libs_dir.iterdir()):
        if copy and lib.name.startswith(UNNEEDED_LIBRARY_PREFIXES):
            continue
        _place(lib, out_dir / "lib" / lib.name, copy)
    for alias, prefix in PERF_ANALYZER_ALIASES.items():
        matches = sorted(libs_dir.glob(prefix + "*"))
        if not matches:
            raise SystemExit(f"build_server: no {prefix}* library in {libs_dir} to serve as {alias}")
        if copy:  # a relative link to the copy: the folder stays movable and small
            (out_dir / "lib" / alias).symlink_to(matches[0].name)
        else:
            _place(matches[0], out_dir / "lib" / alias, copy)

    stamp.write_text(json.dumps(info, indent=2) + "\n")
    if perf_analyzer_wrapper:
        write_perf_analyzer_wrapper(out_dir)
    return out_dir


def perf_analyzer_wrapper_text(server_dir: Path, wrapper_dir: Path, perf_analyzer: Path) -> str:
    """The wrapper script: the server folder's lib/ is found relative to the script."""
    lib_dir = os.path.relpath(Path(server_dir).absolute() / "lib", Path(wrapper_dir).absolute())
    return (
        "#!/usr/bin/env bash\n"
        "# Written by tools/build_server.py. perf_analyzer (tritonclient 2.51) links libb64.so.0d and\n"
        "# libcudart.so.12 (even without a GPU); the server folder's lib/ has both.\n"
        'here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"\n'
        f'export LD_LIBRARY_PATH="$here/{lib_dir}${{LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}}"\n'
        f'exec "{perf_analyzer}" "$@"\n'
    )


def write_perf_analyzer_wrapper(server_dir: Path, wrapper_dir: Path | None = None) -> Path | None:
    """Write `<server_dir>/../bin/perf_analyzer` (only when its content changes); returns its
    path, or None when this venv has no perf_analyzer (tritonclient without the binary)."""
    wrapper_dir = Path(server_dir).parent / "bin" if wrapper_dir is None else Path(wrapper_dir)
    # Not resolved: the venv's bin/ is the right folder even when python is a symlink.
    perf_analyzer = Path(sys.executable).absolute().parent / "perf_analyzer"
    if not perf_analyzer.exists():
        print(f"build_server: {perf_analyzer} is missing; no perf_analyzer wrapper written", file=sys.stderr)
        return None
    wrapper = wrapper_dir / "perf_analyzer"
    text = perf_analyzer_wrapper_text(server_dir, wrapper_dir, perf_analyzer)
    wrapper_dir.mkdir(parents=True, exist_ok=True)
    if not wrapper.is_file() or wrapper.read_text() != text:
        wrapper.write_text(text)
    wrapper.chmod(0o755)
    return wrapper


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("build/tritonserver"))
    parser.add_argument("--copy", action="store_true", help="copy libraries instead of linking")
    parser.add_argument("--python-version", help="the stub of this Python (X.Y; default: this Python's)")
    parser.add_argument("--no-perf-analyzer-wrapper", action="store_true", help="write no ../bin/perf_analyzer")
    args = parser.parse_args(argv)
    out = build(
        args.out,
        copy=args.copy,
        python_version=args.python_version,
        perf_analyzer_wrapper=not args.no_perf_analyzer_wrapper,
    )
    print(f"tritonserver folder ready: {os.path.relpath(out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
