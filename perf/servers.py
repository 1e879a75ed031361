"""Start a real tritonserver for a profile, or for a variant of it, for the benchmarks.

A variant is the profile with a few keys overridden (`engine.batching_strategy=static`,
`engine.enable_kv_cache_reuse=false`): it is written as a YAML file under
`build/bench/profiles/`, validated like any profile and rendered into
`build/bench/model_repo-<name>/`. The unchanged default profile serves the committed
`model_repo/` (tools/serve.py's rule).

One benchmark switch is not a profile key: `preprocessing_dynamic_batching=False`
removes the `dynamic_batching { }` block from the rendered preprocessing config (Triton's
default scheduler then hands `execute` one request at a time), so "dynamic batching off"
can be measured without a new profile key.

On the air-gapped GPU host the server comes from the installed bundle: `--bundle PREFIX`
(`add_server_arguments`) takes its server folder (`PREFIX/tritonserver`), renders the
tokenizer models into its NumPy < 2 venv (`PREFIX/venv-np1`, EXECUTION_ENV_PATH) and names
its perf_analyzer (`PREFIX/bin/perf_analyzer`); `--server-dir`/`--tokenizer-env` set
one of them alone, `--server-log-dir` keeps each server's log.

Likewise `postprocessing_dynamic_batching=True` adds `dynamic_batching { preserve_ordering:
true }` (no queue delay) to the rendered postprocessing config, so that Triton hands its
`execute` every piece waiting at once and the batched decode can be measured. It is a
measurement switch only: behind a dynamic batcher Triton 2.51 drops the cancelled pieces
that postprocessing relays to the engine, so a client's cancellation would not reach it
(docs/INTERFACE.md).
"""

from __future__ import annotations

import argparse
import contextlib
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import yaml

from inflightllm.model_source import prepare
from inflightllm.profile import Profile, load_profile
from tools import render_configs
from tools.serve import repository_for
from tools.server_launcher import DEFAULT_SERVER_DIR, TritonServer

REPO_ROOT = Path(__file__).resolve().parent.parent
BENCH_BUILD_DIR = REPO_ROOT / "build" / "bench"
_DYNAMIC_BATCHING_BLOCK = re.compile(r"^dynamic_batching \{.*?^\}\n\n?", re.MULTILINE | re.DOTALL)


def parse_overrides(items: list[str] | None) -> dict[str, object]:
    """`["engine.batching_strategy=static", "engine.max_batch_size=8"]` -> a dict of dotted
    keys to YAML-parsed values (`8` is an int, `false` a bool)."""
    overrides: dict[str, object] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set {item!r}: expected KEY=VALUE, e.g. engine.batching_strategy=static")
        overrides[key.strip()] = yaml.safe_load(value)
    return overrides


def variant_profile(profile_path: Path, overrides: dict[str, object], suffix: str) -> Path:
    """Write the profile with `overrides` applied as `build/bench/profiles/<name>-<suffix>.yaml`
    and return its path (the unchanged profile's own path when there is nothing to change)."""
    if not overrides:
        return Path(profile_path)
    data = yaml.safe_load(Path(profile_path).read_text())
    for dotted, value in overrides.items():
        node = data
        *parents, leaf = dotted.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    slug = re.sub(r"[^a-z0-9]+", "-", suffix.lower()).strip("-")  # profile names: lowercase, digits, '-'
    data["name"] = f"{data['name']}-{slug}"
    data["description"] = f"{data.get('description', '')} [bench variant: " + ", ".join(
        f"{key}={value}" for key, value in overrides.items()) + "]"
    out = BENCH_BUILD_DIR / "profiles" / f"{data['name']}.yaml"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(f"# Written by perf/servers.py from {Path(profile_path).as_posix()}; do not edit.\n"
                   + yaml.safe_dump(data, sort_keys=False))
    return out


def disable_preprocessing_dynamic_batching(repository: Path) -> None:
    """Remove the `dynamic_batching { }` block of `repository/preprocessing/config.pbtxt`."""
    config = repository / "preprocessing" / "config.pbtxt"
    text = config.read_text()
    stripped, count = _DYNAMIC_BATCHING_BLOCK.subn("", text)
    if count != 1:
        raise RuntimeError(f"{config}: expected one dynamic_batching block, found {count}")
    config.write_text(stripped)


POSTPROCESSING_DYNAMIC_BATCHING = (
    "\n# Added by perf/servers.py (a measurement switch): every waiting piece in one execute call.\n"
    "dynamic_batching {\n  preserve_ordering: true\n}\n"
)


def enable_postprocessing_dynamic_batching(repository: Path) -> None:
    """Add a `dynamic_batching` block (no delay, order kept) to `repository/postprocessing/config.pbtxt`."""
    config = repository / "postprocessing" / "config.pbtxt"
    text = config.read_text()
    if "dynamic_batching" in text:
        raise RuntimeError(f"{config}: already has a dynamic_batching block")
    config.write_text(text + POSTPROCESSING_DYNAMIC_BATCHING)


@dataclass
class ServerOptions:
    """Where the server comes from: its folder, the tokenizer models' venv (None: none),
    the perf_analyzer to run against it, and where server logs go (None: temporary)."""

    server_dir: Path = DEFAULT_SERVER_DIR
    tokenizer_env: Path | None = None
    perf_analyzer: Path = REPO_ROOT / "build" / "bin" / "perf_analyzer"
    log_dir: Path | None = None

    def describe(self) -> dict:
        return {"server_dir": str(self.server_dir), "tokenizer_env": str(self.tokenizer_env or ""),
                "perf_analyzer": str(self.perf_analyzer)}


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    """--bundle / --server-dir / --tokenizer-env / --server-log-dir (see `server_options`)."""
    parser.add_argument("--bundle", type=Path, default=None, metavar="PREFIX",
                        help="serve from an installed bundle (tools/bundle_install.py), e.g. ~/inflightllm-bundle: "
                             "its tritonserver/, venv-np1/ and bin/perf_analyzer")
    parser.add_argument("--server-dir", type=Path, default=None,
                        help=f"the tritonserver folder (default {DEFAULT_SERVER_DIR.relative_to(REPO_ROOT)}, or the bundle's)")
    parser.add_argument("--tokenizer-env", type=Path, default=None,
                        help="NumPy < 2 venv for preprocessing/postprocessing (default none, or the bundle's venv-np1)")
    parser.add_argument("--server-log-dir", type=Path, default=None,
                        help="keep each server's log there as tritonserver-<profile>.log")


def server_options(args) -> ServerOptions:
    """The options of `add_server_arguments` as a `ServerOptions`."""
    options = ServerOptions()
    bundle = getattr(args, "bundle", None)
    if bundle is not None:
        bundle = Path(bundle).expanduser().absolute()
        options.server_dir = bundle / "tritonserver"
        options.tokenizer_env = bundle / "venv-np1"
        options.perf_analyzer = bundle / "bin" / "perf_analyzer"
    if getattr(args, "server_dir", None) is not None:
        options.server_dir = Path(args.server_dir).expanduser().absolute()
    if getattr(args, "tokenizer_env", None) is not None:
        options.tokenizer_env = Path(args.tokenizer_env).expanduser().absolute()
    if getattr(args, "server_log_dir", None) is not None:
        options.log_dir = Path(args.server_log_dir).absolute()
    if options.tokenizer_env is not None and not (options.tokenizer_env / "bin" / "activate").is_file():
        raise SystemExit(f"--tokenizer-env: {options.tokenizer_env} is not a venv (no bin/activate)")
    return options


@dataclass
class ServedProfile:
    """A running server and what it serves."""

    profile: Profile
    repository: Path
    server: TritonServer
    preprocessing_dynamic_batching: bool
    postprocessing_dynamic_batching: bool = False

    def describe(self) -> dict:
        engine = self.profile.engine
        return {
            "profile": render_configs.profile_display_path(self.profile),
            "profile_name": self.profile.name,
            "model": self.profile.model.describe(),
            "device": engine.device,
            "max_batch_size": engine.max_batch_size,
            "max_num_tokens": engine.max_num_tokens,
            "batching_strategy": engine.batching_strategy,
            "enable_kv_cache_reuse": engine.enable_kv_cache_reuse,
            "stream_interval": engine.stream_interval,
            "preprocessing_instances": self.profile.instances_preprocessing,
            "preprocessing_dynamic_batching": self.preprocessing_dynamic_batching,
            "postprocessing_dynamic_batching": self.postprocessing_dynamic_batching,
            "preferred_batch_size": list(self.profile.preferred_batch_size),
            "max_queue_delay_microseconds": self.profile.max_queue_delay_microseconds,
            "server_dir": str(self.server.server_dir),
            "repository": str(self.repository),
        }


@contextlib.contextmanager
def serve_profile(profile_path: Path, overrides: dict[str, object] | None = None, suffix: str = "variant",
                  preprocessing_dynamic_batching: bool = True, timeout: float = 600.0,
                  options: ServerOptions | None = None,
                  postprocessing_dynamic_batching: bool = False) -> Iterator[ServedProfile]:
    """Render (if needed) and start a tritonserver on free loopback ports; stop it afterwards."""
    options = options or ServerOptions()
    path = variant_profile(Path(profile_path), overrides or {}, suffix)
    profile = load_profile(path)
    tokenizer_env = str(options.tokenizer_env) if options.tokenizer_env else None
    if preprocessing_dynamic_batching and not postprocessing_dynamic_batching:
        repository = repository_for(profile, build_dir=BENCH_BUILD_DIR, tokenizer_env=tokenizer_env)
    else:
        switches = ("" if preprocessing_dynamic_batching else "-no-dynamic-batching") + (
            "-batched-postprocessing" if postprocessing_dynamic_batching else "")
        repository = BENCH_BUILD_DIR / f"repo-{profile.name}{switches}"
        render_configs.render(profile, repository, tokenizer_env=tokenizer_env)
        if not preprocessing_dynamic_batching:
            disable_preprocessing_dynamic_batching(repository)
        if postprocessing_dynamic_batching:
            enable_postprocessing_dynamic_batching(repository)
    prepare(profile.model)  # convert the model before the server's model load
    log_path = None
    if options.log_dir is not None:
        options.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = options.log_dir / f"tritonserver-{repository.name}.log"
    server = TritonServer(repository, server_dir=options.server_dir, log_path=log_path)
    server.start(timeout=timeout)
    try:
        yield ServedProfile(profile, repository, server, preprocessing_dynamic_batching,
                            postprocessing_dynamic_batching)
    finally:
        server.stop()
