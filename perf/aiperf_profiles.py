"""`make aiperf`: AIPerf (genai-perf's successor) against the OpenAI front end.

AIPerf lives in a venv of its own (`build/aiperf-venv`). This script starts tritonserver
(default profile) and the OpenAI front end on free loopback ports, exports SmolLM2's
tokenizer to `build/tokenizer-smollm2` (nothing can be downloaded), and runs one short
streaming profile for `chat` and one for `completions`, keeping AIPerf's exports (CSV,
JSON) under `--out/<endpoint type>/`. Figures are printed and saved, never asserted.

Usage: python perf/aiperf_profiles.py [--out build/aiperf] [--requests 4] [--only chat]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from perf.genai_perf_profiles import TOKENIZER_DIR, export_tokenizer, start_servers  # noqa: E402

AIPERF = REPO_ROOT / "build" / "aiperf-venv" / "bin" / "aiperf"
ENDPOINT_TYPES = ("chat", "completions")


def aiperf_command(endpoint_type: str, url: str, out: Path, args) -> list[str]:
    return [
        str(AIPERF), "profile", "-m", "ensemble", "--endpoint-type", endpoint_type, "--streaming", "-u", url,
        "--tokenizer", str(TOKENIZER_DIR),
        "--prompt-input-tokens-mean", str(args.input_tokens), "--prompt-input-tokens-stddev", "0",
        "--prompt-output-tokens-mean", str(args.output_tokens), "--prompt-output-tokens-stddev", "0",
        # The front end takes vLLM's min_tokens: fixed output lengths.
        "--extra-inputs", f"min_tokens:{args.output_tokens}",
        "--concurrency", str(args.concurrency), "--request-count", str(args.requests),
        "--warmup-request-count", str(args.concurrency), "--random-seed", "0",
        "--output-artifact-dir", str(out / endpoint_type), "--ui-type", "none",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "build" / "aiperf")
    parser.add_argument("--only", nargs="+", choices=ENDPOINT_TYPES)
    parser.add_argument("--requests", type=int, default=6)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--input-tokens", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=16)
    parser.add_argument("--triton-grpc", help="use this running Triton (HOST:PORT) instead of starting one")
    args = parser.parse_args(argv)
    if not AIPERF.exists():
        print(f"{AIPERF} is missing: run `make aiperf` (it builds the venv)", file=sys.stderr)
        return 2
    out = args.out.resolve()
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    export_tokenizer()
    # Not HF_HUB_OFFLINE: AIPerf 0.13 then looks a local tokenizer folder up as a cached
    # hub repository and fails; without it a local folder is loaded as such (no network).
    env = {key: value for key, value in os.environ.items() if key not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    with start_servers(args.triton_grpc) as (_triton_grpc, openai_url):
        failures = []
        for endpoint_type in args.only or ENDPOINT_TYPES:
            command = aiperf_command(endpoint_type, openai_url, out, args)
            print("$ " + " ".join(command), flush=True)
            with open(out / f"{endpoint_type}.log", "w") as log:
                status = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=out).returncode
            print((out / f"{endpoint_type}.log").read_text()[-5000:], flush=True)
            if status != 0:
                failures.append(endpoint_type)
    print(f"exports: {out}/<endpoint type>/", flush=True)
    if failures:
        print(f"failed: {', '.join(failures)} (logs: {out}/<endpoint type>.log)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
