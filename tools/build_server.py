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

`--copy` copies the libraries instead of linking them (for an offline bundle that
must not point back into a virtual environment).

Usage: python tools/build_server.py [--out build/tritonserver] [--copy]
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


def build(out_dir: Path, copy: bool = False) -> Path:
    """Lay out the server folder at `out_dir`; return it. Idempotent."""
    server_dir, libs_dir = pytriton_paths()
    stub = server_dir / "python_backend_stubs" / python_version_tag() / "triton_python_backend_stub"
    if not stub.exists():
        raise SystemExit(
            f"build_server: the wheel has no Python backend stub for Python {python_version_tag()}"
            f" (looked for {stub})"
        )
    stamp = out_dir / "BUILD_INFO.json"
    info = {
        "source": str(server_dir),
        "python": python_version_tag(),
        "copy": copy,
        "stub_size": stub.stat().st_size,
    }
    if stamp.exists() and json.loads(stamp.read_text()) == info and (out_dir / "bin" / "tritonserver").exists():
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
        _place(lib, out_dir / "lib" / lib.name, copy)
    for alias, prefix in PERF_ANALYZER_ALIASES.items():
        matches = sorted(libs_dir.glob(prefix + "*"))
        if not matches:
            raise SystemExit(f"build_server: no {prefix}* library in {libs_dir} to serve as {alias}")
        _place(matches[0], out_dir / "lib" / alias, copy)

    stamp.write_text(json.dumps(info, indent=2) + "\n")
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("build/tritonserver"))
    parser.add_argument("--copy", action="store_true", help="copy libraries instead of linking")
    args = parser.parse_args(argv)
    out = build(args.out, copy=args.copy)
    print(f"tritonserver folder ready: {os.path.relpath(out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
