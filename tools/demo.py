"""Start the server, ask one question through the chat template, stream the answer, stop.

    python tools/demo.py --profile profiles/smollm2-cpu.yaml      (what `make demo` runs)

The default profile is served from the committed `model_repo/`; any other profile is
rendered first into `build/model_repo-<profile name>` (tools/render_configs.py). The
server runs on free loopback ports and is stopped at the end, also on errors. Exit
status: 0 when an answer arrived, 1 otherwise.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))  # so that `tools.*` imports when run as a script

from inflightllm.client import ClientError, chat_messages, stream_generate  # noqa: E402
from inflightllm.profile import DEFAULT_PROFILE, ProfileError, load_profile  # noqa: E402
from tools.serve import check_servable, repository_for  # noqa: E402
from tools.server_launcher import DEFAULT_SERVER_DIR, ServerStartError, TritonServer  # noqa: E402

DEFAULT_QUESTION = "What is the capital of France?"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", type=Path, default=DEFAULT_PROFILE, help="default: %(default)s")
    parser.add_argument("--question", default=DEFAULT_QUESTION, help="default: %(default)r")
    parser.add_argument("--max-tokens", type=int, default=64, help="default: %(default)s")
    parser.add_argument("--server-dir", type=Path, default=DEFAULT_SERVER_DIR, help="default: %(default)s")
    parser.add_argument("--start-timeout", type=float, default=600.0, help="seconds (default: %(default)s)")
    args = parser.parse_args(argv)

    try:
        profile = load_profile(args.profile)
        check_servable(profile)
        repository = repository_for(profile)
    except ProfileError as error:
        print(error, file=sys.stderr)
        return 1
    server = TritonServer(repository, server_dir=args.server_dir)
    print(f"starting tritonserver on {repository} (gRPC {server.grpc_url}, HTTP {server.http_url}); "
          f"log: {server.log_path} (removed at the end unless the server fails)", flush=True)
    started = time.monotonic()
    try:
        server.start(timeout=args.start_timeout)
    except ServerStartError as error:
        print(error, file=sys.stderr)
        return 1
    try:
        print(f"server ready in {time.monotonic() - started:.1f} s", flush=True)
        print(f"user: {args.question}", flush=True)
        sys.stdout.write("assistant: ")
        sys.stdout.flush()

        def write(piece: str) -> None:
            sys.stdout.write(piece)
            sys.stdout.flush()

        try:
            stats = stream_generate(
                server.grpc_url,
                messages=chat_messages(args.question),
                max_tokens=args.max_tokens,
                on_text=write,
                timeout=300.0,
            )
        except ClientError as error:
            print(f"\nerror: {error}", file=sys.stderr)
            return 1
        print(flush=True)
        print(stats.summary_line(), flush=True)
        if not stats.text.strip():
            print("error: the answer is empty", file=sys.stderr)
            return 1
        return 0
    finally:
        print("stopping tritonserver", flush=True)
        server.stop()


if __name__ == "__main__":
    raise SystemExit(main())
