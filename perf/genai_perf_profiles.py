"""`make genai-perf`: genai-perf 0.0.16 against the real server in its four formats.

genai-perf lives in a venv of its own (`build/genai-perf-venv`: its NumPy 2, pandas and
transformers collide with the project's NumPy < 2); it drives `build/bin/perf_analyzer`.
This script starts tritonserver (default profile) and the OpenAI front end on free
loopback ports, exports SmolLM2's tokenizer to `build/tokenizer-smollm2` (genai-perf
reads a tokenizer by folder; nothing can be downloaded), and runs one short profile per
format, keeping each one's CSV/JSON exports and plots under `--out`:

- `triton-tensorrtllm`: `--endpoint-type kserve --backend tensorrtllm` (sends
  `text_input`, `max_tokens`, `exclude_input_in_output`, `stream`, `min_length`);
- `triton-vllm`: `--endpoint-type kserve --backend vllm` (`text_input`, `stream`,
  `exclude_input_in_output`, `sampling_parameters` with numbers as strings);
- `openai-chat`, `openai-completions`: `--endpoint-type chat|completions` against the
  OpenAI front end.

genai-perf 0.0.16 has no `--service-kind`: `--endpoint-type kserve` is its Triton gRPC
kind. Figures are printed and saved, never asserted.

Usage: python perf/genai_perf_profiles.py [--out build/genai-perf] [--requests 6] [--only NAME ...]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

GENAI_PERF = REPO_ROOT / "build" / "genai-perf-venv" / "bin" / "genai-perf"
TOKENIZER_DIR = REPO_ROOT / "build" / "tokenizer-smollm2"

# name -> the genai-perf arguments that select the format (and which server it talks to).
FORMATS = {
    "triton-tensorrtllm": (["--endpoint-type", "kserve", "--backend", "tensorrtllm"], "triton"),
    "triton-vllm": (["--endpoint-type", "kserve", "--backend", "vllm"], "triton"),
    "openai-chat": (["--endpoint-type", "chat"], "openai"),
    "openai-completions": (["--endpoint-type", "completions"], "openai"),
}


def export_tokenizer(folder: Path = TOKENIZER_DIR) -> Path:
    """SmolLM2's tokenizer as a Hugging Face folder that genai-perf can read."""
    from inflightllm.model_source import DEFAULT_MODEL, load_tokenizer

    if not (folder / "tokenizer.json").is_file():
        load_tokenizer(DEFAULT_MODEL).save_pretrained(str(folder))
    return folder


def genai_perf_command(name: str, url: str, out: Path, args) -> list[str]:
    selection, server = FORMATS[name]
    # Fixed output lengths: Triton formats ask with min_length / min_tokens (genai-perf's
    # --output-tokens-mean-deterministic, refused for OpenAI); the OpenAI formats send the
    # front end's vLLM-style `min_tokens` extra.
    fixed_length = (["--output-tokens-mean-deterministic"] if server == "triton"
                    else ["--extra-inputs", f"min_tokens:{args.output_tokens}"])
    return [
        str(GENAI_PERF), "profile", "-m", "ensemble", *selection, "--streaming", "-u", url,
        "--tokenizer", str(TOKENIZER_DIR),
        "--synthetic-input-tokens-mean", str(args.input_tokens), "--synthetic-input-tokens-stddev", "0",
        "--output-tokens-mean", str(args.output_tokens), *fixed_length,
        "--concurrency", str(args.concurrency), "--request-count", str(args.requests),
        "--warmup-request-count", str(args.concurrency), "--random-seed", "0",
        "--artifact-dir", str(out / name), "--generate-plots",
    ]


def run_profile(name: str, url: str, out: Path, args) -> int:
    artifacts = out / name
    # Two genai-perf 0.0.16 bugs in --generate-plots: it writes the plot configuration into
    # <artifact-dir>/plots without creating the folder, and it reads `profile_export.json`
    # from the working directory, not from the run's folder
    # (<artifact-dir>/<model>-<format>-concurrency<N>/). Run it in <artifact-dir>, where a
    # link points at the run's export.
    (artifacts / "plots").mkdir(parents=True, exist_ok=True)
    run_folder = f"ensemble-{name}-concurrency{args.concurrency}"
    (artifacts / "profile_export.json").symlink_to(Path(run_folder) / "profile_export.json")
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(REPO_ROOT / "build" / "bin"), env.get("PATH", "")])  # its perf_analyzer
    env.setdefault("HF_HUB_OFFLINE", "1")
    command = genai_perf_command(name, url, out, args)
    print("$ " + " ".join(command), flush=True)
    export = artifacts / run_folder / "profile_export.json"
    with open(out / f"{name}.log", "w") as log:
        result = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=artifacts)
        if result.returncode != 0 and (not export.exists() or export.stat().st_size == 0):
            # perf_analyzer left no export (seen once on a loaded 2-core machine, its output
            # hidden by genai-perf): once more, with its output in the log this time
            print(f"\n--- {name}: no profile export; once more, verbose ---\n", file=log, flush=True)
            result = subprocess.run([*command, "--verbose"], stdout=log, stderr=subprocess.STDOUT, env=env,
                                    cwd=artifacts)
    print((out / f"{name}.log").read_text()[-4000:], flush=True)
    return result.returncode


def _wait_healthy(url: str, process: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the OpenAI front end exited with status {process.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the OpenAI front end at {url} was not healthy after {timeout:.0f} s")


@contextlib.contextmanager
def start_servers(triton_grpc: str | None = None):
    """A tritonserver on the committed model_repo (unless `triton_grpc` names a running
    one) and the OpenAI front end attached to it, on free loopback ports; yields
    (Triton gRPC address, front end URL) and stops what it started."""
    from tools.server_launcher import TritonServer, free_port

    server = frontend = None
    try:
        if triton_grpc is None:
            server = TritonServer(REPO_ROOT / "model_repo")
            print(f"starting tritonserver (gRPC {server.grpc_url})", flush=True)
            server.start(timeout=600)
            triton_grpc = server.grpc_url
        port = free_port()
        openai_url = f"http://127.0.0.1:{port}"
        frontend = subprocess.Popen([sys.executable, str(REPO_ROOT / "tools" / "serve_openai.py"),
                                     "--triton-grpc", triton_grpc, "--port", str(port), "--log-level", "warning"])
        _wait_healthy(openai_url, frontend)
        yield triton_grpc, openai_url
    finally:
        if frontend is not None and frontend.poll() is None:
            frontend.terminate()
            frontend.wait(timeout=30)
        if server is not None:
            server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "build" / "genai-perf")
    parser.add_argument("--only", nargs="+", choices=list(FORMATS), help="run these formats only")
    parser.add_argument("--requests", type=int, default=6, help="requests measured per profile")
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--input-tokens", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=16)
    parser.add_argument("--triton-grpc", help="use this running Triton (HOST:PORT) instead of starting one")
    args = parser.parse_args(argv)
    if args.requests % args.concurrency:
        # Seen with perf_analyzer 2.51: --request-count 3 at concurrency 2 never ends.
        parser.error(f"--requests ({args.requests}) must be a multiple of --concurrency ({args.concurrency}): "
                     "perf_analyzer 2.51 waits forever otherwise")
    if not GENAI_PERF.exists():
        print(f"{GENAI_PERF} is missing: run `make genai-perf` (it builds the venv)", file=sys.stderr)
        return 2
    out = args.out.resolve()
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    export_tokenizer()

    with start_servers(args.triton_grpc) as (triton_grpc, openai_url):
        failures = []
        for name in args.only or list(FORMATS):
            url = triton_grpc if FORMATS[name][1] == "triton" else openai_url
            if run_profile(name, url, out, args) != 0:
                failures.append(name)
    print(f"exports and plots: {out}/<format>/", flush=True)
    if failures:
        print(f"failed: {', '.join(failures)} (logs: {out}/<format>.log)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
