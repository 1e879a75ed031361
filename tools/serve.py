"""`make serve`: serve a profile with a real tritonserver in the foreground.

The default profile serves the committed `model_repo/`; any other profile is rendered
into `build/model_repo-<profile name>/` first. The model is prepared (converted and
cached) before the server starts, so the server's model load takes seconds.

On a GPU host whose Python has NumPy 2 (the air-gapped bundle, tools/bundle.py),
`--tokenizer-env DIR` names the NumPy < 2 venv that preprocessing and postprocessing run
in (EXECUTION_ENV_PATH); the repository is then always rendered into
`build/model_repo-<profile name>-tokenizer-env/`. `--server-dir` names the server folder
(default `build/tritonserver`).

Before anything starts, the profile is checked against this machine (a GPU profile on a
machine without CUDA is refused at once, not after Triton's start-up).

The server listens on 127.0.0.1 only. `--host 0.0.0.0` (`make serve HOST=0.0.0.0`)
listens on every interface, with a warning: Triton has no authentication here.

Usage: python tools/serve.py [--profile profiles/smollm2-cpu.yaml] [--http-port 8000 ...] [--host ADDRESS]
       python tools/serve.py --profile P --server-dir DIR --tokenizer-env DIR
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from inflightllm.model_source import prepare  # noqa: E402
from inflightllm.profile import DEFAULT_PROFILE, ProfileError, load_profile  # noqa: E402
from tools import render_configs, server_launcher  # noqa: E402


def check_servable(profile) -> None:
    """Refuse a profile this machine cannot serve, before Triton starts (ProfileError)."""
    engine = profile.engine
    if engine.device == "cpu":
        return
    import torch

    file = str(profile.source_path)
    if not torch.cuda.is_available():
        raise ProfileError(
            file, "device.kind",
            f"{engine.device!r} needs CUDA, and this machine has none (torch.cuda.is_available() is False); "
            "serve a cpu profile here (e.g. profiles/smollm2-cpu.yaml)",
        )
    count = torch.cuda.device_count()
    missing = [gpu for gpu in engine.gpu_ids if gpu >= count]
    if missing:
        raise ProfileError(
            file, "device.gpu_ids",
            f"{list(engine.gpu_ids)} names GPU(s) {missing}, and this machine has {count} (ids 0 to {count - 1})",
        )


def repository_for(profile, build_dir: Path = REPO_ROOT / "build", tokenizer_env: str | None = None) -> Path:
    """The model repository to serve for a loaded profile: the committed `model_repo/`
    for the default profile (refusing to serve it if it drifted), else a render into
    `<build_dir>/model_repo-<name>`; with a tokenizer environment always a render, into
    `<build_dir>/model_repo-<name>-tokenizer-env`."""
    if tokenizer_env:
        out = Path(build_dir) / f"model_repo-{profile.name}-tokenizer-env"
        render_configs.render(profile, out, tokenizer_env=tokenizer_env)
        return out
    if Path(profile.source_path).resolve() == DEFAULT_PROFILE.resolve():
        drift = render_configs.check(profile, REPO_ROOT / "model_repo")
        if drift:
            raise SystemExit(
                "model_repo/ differs from a fresh render of the default profile; run "
                "`make render-configs` (or revert your edit):\n" + "\n".join(drift)
            )
        return REPO_ROOT / "model_repo"
    out = Path(build_dir) / f"model_repo-{profile.name}"
    render_configs.render(profile, out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", type=Path, default=DEFAULT_PROFILE)
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--grpc-port", type=int, default=8001)
    parser.add_argument("--metrics-port", type=int, default=8002)
    parser.add_argument("--log-verbose", type=int, default=0)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    parser.add_argument("--server-dir", type=Path, default=server_launcher.DEFAULT_SERVER_DIR)
    parser.add_argument(
        "--tokenizer-env", help="NumPy < 2 venv for preprocessing/postprocessing (EXECUTION_ENV_PATH)"
    )
    args = parser.parse_args(argv)
    from tools.serve_openai import loopback_warning

    warning = loopback_warning(args.host, "tritonserver (HTTP, gRPC and metrics)")
    if warning:
        print(warning, file=sys.stderr)
    if args.tokenizer_env and not (Path(args.tokenizer_env) / "bin" / "activate").is_file():
        print(f"--tokenizer-env: {args.tokenizer_env} is not a venv (no bin/activate)", file=sys.stderr)
        return 2
    try:
        profile = load_profile(args.profile)
        check_servable(profile)
        tokenizer_env = str(Path(args.tokenizer_env).absolute()) if args.tokenizer_env else None
        repository = repository_for(profile, tokenizer_env=tokenizer_env)
    except ProfileError as error:
        print(error, file=sys.stderr)
        return 2
    folder = prepare(profile.model)
    print(f"model {profile.model.describe()} ready in {folder}", flush=True)
    return server_launcher.main([
        "--model-repository", str(repository),
        "--http-port", str(args.http_port),
        "--grpc-port", str(args.grpc_port),
        "--metrics-port", str(args.metrics_port),
        "--log-verbose", str(args.log_verbose),
        "--server-dir", str(args.server_dir),
        "--host", args.host,
    ])


if __name__ == "__main__":
    raise SystemExit(main())
