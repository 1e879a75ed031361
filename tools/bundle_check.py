"""Check an installed bundle end to end: serve a profile from it, stream requests over gRPC.

Starts the bundle's tritonserver on free loopback ports exactly as `make serve-bundle`
does (the profile rendered with `--tokenizer-env`, the engine in the bundle's `venv`,
preprocessing/postprocessing in `venv-np1`), sends a chat request and a `text_input`
request through the ensemble with the installed `tritonclient` (gRPC streaming), prints
each answer's pieces and statistics, and stops the server. Exit status 0 when every
answer streamed text back and its pieces concatenate to the final text.

Usage (on the host, from the checkout, after `bash build/bundle/part1/install.sh`):
  ~/inflightllm-bundle/venv/bin/python tools/bundle_check.py \
      [--profile profiles/smollm2-random-cpu.yaml] [--prefix ~/inflightllm-bundle] [--log-dir DIR]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

DEFAULT_PREFIX = Path(os.environ.get("INFLIGHTLLM_BUNDLE_PREFIX", str(Path.home() / "inflightllm-bundle")))
DEFAULT_PROFILE = REPO_ROOT / "profiles" / "smollm2-random-cpu.yaml"
QUESTION = "What is the capital of France?"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", type=Path, default=DEFAULT_PROFILE)
    parser.add_argument("--prefix", type=Path, default=DEFAULT_PREFIX)
    parser.add_argument("--server-dir", type=Path, help="default: <prefix>/tritonserver")
    parser.add_argument("--tokenizer-env", type=Path, help="default: <prefix>/venv-np1")
    parser.add_argument("--log-dir", type=Path, default=None, help="where tritonserver.log goes")
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args(argv)
    prefix = args.prefix.absolute()
    # Before anything reads it: the model cache of the bundle (the server inherits it).
    os.environ.setdefault("INFLIGHTLLM_CACHE_DIR", str(prefix / "cache"))

    from inflightllm.client import stream_generate
    from inflightllm.model_source import load_tokenizer, prepare
    from inflightllm.profile import load_profile
    from tools import serve, server_launcher

    server_dir = (args.server_dir or prefix / "tritonserver").absolute()
    tokenizer_env = (args.tokenizer_env or prefix / "venv-np1").absolute()
    profile = load_profile(args.profile)
    repository = serve.repository_for(profile, tokenizer_env=str(tokenizer_env))
    folder = prepare(profile.model)
    print(f"model {profile.model.describe()} ready in {folder}; repository {repository}", flush=True)
    log_path = None
    if args.log_dir:
        args.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = args.log_dir / "tritonserver.log"
    server = server_launcher.TritonServer(repository, server_dir=server_dir, log_path=log_path)
    print(f"starting {server_dir / 'bin' / 'tritonserver'} (gRPC {server.grpc_url}, log {server.log_path})", flush=True)
    server.start(timeout=600)
    print("server ready", flush=True)
    tokenizer = load_tokenizer(profile.model)
    failures = 0
    try:
        for label, request in (
            ("chat", {"messages": [{"role": "user", "content": QUESTION}]}),
            ("text_input", {"prompt": "Once upon a time"}),
        ):
            pieces: list[str] = []
            stats = stream_generate(
                server.grpc_url, max_tokens=args.max_tokens, timeout=300, on_text=pieces.append,
                **request,
            )
            print(f"{label}: {len(pieces)} streamed pieces {pieces!r}")
            print(f"{label}: text {stats.text!r}")
            print(f"{label}: {stats.summary_line()}", flush=True)
            if not stats.text or "".join(pieces) != stats.text or stats.num_output_tokens <= 0:
                failures += 1
                print(f"{label}: FAILED (no text, or the pieces do not make the text)")
        print(f"client tokenizer {type(tokenizer).__name__} (vocab {len(tokenizer)})")
    finally:
        status = server.stop(timeout=10)
        print(f"server stopped (status {status})")
    print("bundle check: " + ("OK" if failures == 0 else f"{failures} request(s) failed"))
    return 0 if failures == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
