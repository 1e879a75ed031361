"""`make serve-openai`: the OpenAI-compatible front end (FastAPI + uvicorn) beside Triton.

Starts a tritonserver on the profile (as `make serve` does) and the front end on
127.0.0.1:9000, or, with `--triton-grpc HOST:PORT`, attaches to a Triton that is already
running. The tokenizer and the limits come from the running server's `preprocessing`
config, so the front end always matches what it forwards to.

Usage:
  python tools/serve_openai.py [--profile profiles/smollm2-cpu.yaml] [--port 9000]
  python tools/serve_openai.py --triton-grpc 127.0.0.1:8001 [--port 9000]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import signal
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from inflightllm.profile import DEFAULT_PROFILE, ProfileError  # noqa: E402


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def loopback_warning(host: str, what: str) -> str | None:
    """The warning to print when `what` listens beyond this machine (there is no authentication)."""
    if is_loopback(host):
        return None
    return (f"warning: {what} listens on {host}: anyone who can reach this address can use it "
            "(no authentication, no TLS); put it behind a proxy that adds them")


async def _serve(args, triton_grpc: str) -> int:
    import uvicorn

    from inflightllm.model_source import ModelSpec, load_tokenizer
    from inflightllm.openai_frontend.app import ServingLimits, create_app
    from inflightllm.openai_frontend.triton_backend import TritonBackend

    backend = TritonBackend(triton_grpc, model=args.triton_model)
    deadline = time.monotonic() + args.wait_s
    while not await backend.is_ready():
        if time.monotonic() > deadline:
            print(f"error: no ready Triton server with model '{args.triton_model}' at {triton_grpc} (gRPC) "
                  f"after {args.wait_s:g} s", file=sys.stderr)
            await backend.close()
            return 2
        await asyncio.sleep(0.5)
    params = await backend.model_parameters("preprocessing")
    tokenizer = load_tokenizer(ModelSpec.from_parameters(params))
    app = create_app(backend, tokenizer, ServingLimits.from_parameters(params),
                     served_model=args.served_model_name, max_concurrent_requests=args.max_concurrent_requests)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    print(f"OpenAI-compatible API on http://{args.host}:{args.port}/v1 (model '{args.served_model_name}') "
          f"-> Triton gRPC {triton_grpc}", flush=True)
    try:
        await server.serve()
    finally:
        await backend.close()
    return 0


def _terminate(signum, frame):
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", type=Path, default=DEFAULT_PROFILE, help="served when Triton is started here")
    parser.add_argument("--host", default="127.0.0.1", help="address of the front end (default: %(default)s)")
    parser.add_argument("--port", type=int, default=9000, help="default: %(default)s")
    parser.add_argument("--triton-grpc", metavar="HOST:PORT",
                        help="attach to this running Triton instead of starting one")
    parser.add_argument("--http-port", type=int, default=8000, help="Triton's, when started here")
    parser.add_argument("--grpc-port", type=int, default=8001, help="Triton's, when started here")
    parser.add_argument("--metrics-port", type=int, default=8002, help="Triton's, when started here")
    parser.add_argument("--triton-model", default="ensemble", help="the Triton model requests go to")
    parser.add_argument("--served-model-name", default="ensemble", help="the model id clients use")
    parser.add_argument("--max-concurrent-requests", type=int, default=256,
                        help="more at once are answered 503 (default: %(default)s)")
    parser.add_argument("--wait-s", type=float, default=60.0, help="how long to wait for an attached Triton")
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)
    if args.max_concurrent_requests < 1:
        parser.error("--max-concurrent-requests must be at least 1")
    warning = loopback_warning(args.host, "the OpenAI front end")
    if warning:
        print(warning, file=sys.stderr)

    # uvicorn re-raises a SIGTERM it caught once it has shut down; as KeyboardInterrupt it
    # reaches the `finally` below, which stops the tritonserver started here (it runs in a
    # session of its own and would otherwise outlive us).
    signal.signal(signal.SIGTERM, _terminate)
    server = None
    triton_grpc = args.triton_grpc
    if triton_grpc is None:
        from inflightllm.model_source import prepare
        from inflightllm.profile import load_profile
        from tools.serve import check_servable, repository_for
        from tools.server_launcher import ServerStartError, TritonServer

        try:
            profile = load_profile(args.profile)
            check_servable(profile)
            repository = repository_for(profile)
        except ProfileError as error:
            print(error, file=sys.stderr)
            return 2
        prepare(profile.model)
        server = TritonServer(repository, http_port=args.http_port, grpc_port=args.grpc_port,
                              metrics_port=args.metrics_port)
        print(f"starting tritonserver on {repository} (gRPC {server.grpc_url}, metrics {server.metrics_url}); "
              f"log: {server.log_path}", flush=True)
        try:
            server.start(timeout=600)
        except ServerStartError as error:
            print(error, file=sys.stderr)
            return 1
        triton_grpc = server.grpc_url
    try:
        with contextlib.suppress(KeyboardInterrupt):
            return asyncio.run(_serve(args, triton_grpc))
        return 0
    finally:
        if server is not None:
            print("stopping tritonserver", flush=True)
            server.stop()


if __name__ == "__main__":
    raise SystemExit(main())
