"""On a GPU host: the real server from the bundle against the engine's offline output.

1. Offline: the profile's engine (`LLM.generate`, in this process, on the GPU) answers
   N chat questions greedily; then it is freed.
2. The bundle's tritonserver serves the same profile (tokenizer models in the NumPy < 2
   environment, the engine on the GPU); N concurrent gRPC streams ask the same
   questions through the ensemble. Each answer's streamed pieces must concatenate to
   its final text, and that text must equal the offline answer. With FP8 weights
   (`model.quantization: fp8`) up to a tenth of the answers may diverge from the offline
   ones after their first few words, and are listed as such: the engine's numerics depend
   on the step's batch (one-token steps keep activations in bf16, W8A16; steps of several
   rows quantize them per token, W8A8), so near-ties can go the other way when the
   server's requests meet in other steps than the offline run's (docs/QUANTIZATION.md).
3. Optionally (`--also-profile`), a second profile (e.g. the 8B shape) is served and
   answers N concurrent streams; its throughput and TTFT are printed.

Usage (after all bundle parts are installed; README "GPU hosts"):
  ~/inflightllm-bundle/venv/bin/python tools/gpu_server_check.py \
      --profile profiles/smollm2-gpu-fp32.yaml --also-profile profiles/llama3-8b-h200.yaml --log-dir DIR
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import statistics
import sys
import threading
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

DEFAULT_PREFIX = Path(os.environ.get("INFLIGHTLLM_BUNDLE_PREFIX", str(Path.home() / "inflightllm-bundle")))
TOPICS = ["France", "the sea", "photosynthesis", "prime numbers", "Spain", "Jane Austen", "cooking", "the moon"]
FORMS = [
    "What is {} famous for?", "Write one sentence about {}.", "Explain {} to a child.", "Give me a fact about {}.",
    "Why do people like {}?", "Describe {} in three words.", "What should I know about {}?", "Tell me a joke about {}.",
]


def questions(count: int) -> list[str]:
    return [FORMS[i % len(FORMS)].format(TOPICS[(i // len(FORMS)) % len(TOPICS)]) for i in range(count)]


def offline_answers(profile, prompts: list[str], max_tokens: int) -> list[str]:
    import torch

    from inflightllm.llm import LLM
    from inflightllm.sampling_params import SamplingParams

    config = dataclasses.replace(profile.engine, gpu_memory_utilization=0.3)
    llm = LLM(profile.model, config=config)
    ids = [
        llm.tokenizer.encode(
            llm.tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False),
            add_special_tokens=False,
        )
        for q in prompts
    ]
    results = llm.generate(ids, SamplingParams(max_tokens=max_tokens))
    texts = [r.text for r in results]
    del llm, results
    gc.collect()
    try:
        import cupy

        cupy.get_default_memory_pool().free_all_blocks()
    except ImportError:
        pass
    torch.cuda.empty_cache()
    return texts


def concurrent_streams(url: str, prompts: list[str], max_tokens: int, **request):
    from inflightllm.client import stream_generate

    results: list = [None] * len(prompts)
    pieces: list[list[str]] = [[] for _ in prompts]

    def one(index: int) -> None:
        try:
            results[index] = stream_generate(
                url, messages=[{"role": "user", "content": prompts[index]}], max_tokens=max_tokens, timeout=600,
                on_text=pieces[index].append, **request,
            )
        except Exception as error:  # noqa: BLE001 - reported below
            results[index] = error

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results, pieces, time.perf_counter() - start


def serve(profile, args, tokenizer_env: Path, server_dir: Path, log_name: str):
    from tools import serve as serve_tool
    from tools import server_launcher

    repository = serve_tool.repository_for(profile, tokenizer_env=str(tokenizer_env))
    log_path = args.log_dir / log_name if args.log_dir else None
    server = server_launcher.TritonServer(repository, server_dir=server_dir, log_path=log_path)
    start = time.perf_counter()
    server.start(timeout=900)
    print(f"{profile.name}: server ready in {time.perf_counter() - start:.1f} s (gRPC {server.grpc_url})", flush=True)
    return server


def summary(label: str, results, elapsed: float) -> None:
    ok = [r for r in results if not isinstance(r, Exception)]
    tokens = sum(r.num_output_tokens for r in ok)
    ttfts = sorted(r.ttft_ms for r in ok if r.ttft_ms is not None)
    p50 = statistics.median(ttfts) if ttfts else float("nan")
    print(f"{label}: {len(ok)}/{len(results)} streams done, {tokens} tokens in {elapsed:.2f} s = "
          f"{tokens / elapsed:,.0f} tokens/s; TTFT p50 {p50:.1f} ms, max {max(ttfts, default=float('nan')):.1f} ms",
          flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", type=Path, default=REPO_ROOT / "profiles" / "smollm2-gpu-fp32.yaml")
    parser.add_argument("--also-profile", type=Path, default=None)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--prefix", type=Path, default=DEFAULT_PREFIX)
    parser.add_argument("--log-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    prefix = args.prefix.absolute()
    os.environ.setdefault("INFLIGHTLLM_CACHE_DIR", str(prefix / "cache"))
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    if args.log_dir:
        args.log_dir.mkdir(parents=True, exist_ok=True)

    from inflightllm.profile import load_profile

    server_dir, tokenizer_env = prefix / "tritonserver", prefix / "venv-np1"
    profile = load_profile(args.profile)
    prompts = questions(args.requests)
    start = time.perf_counter()
    expected = offline_answers(profile, prompts, args.max_tokens)
    print(f"{profile.name}: offline engine answered {len(expected)} questions in {time.perf_counter() - start:.1f} s",
          flush=True)
    failures = diverged = 0
    # FP8: batch-dependent numerics (see the docstring); a diverged answer must still agree
    # on its first words, and no more than a tenth may diverge.
    quantized = getattr(profile.model, "quantization", None) == "fp8"
    allowed = args.requests // 10 if quantized else 0
    server = serve(profile, args, tokenizer_env, server_dir, "tritonserver.log")
    try:
        results, pieces, elapsed = concurrent_streams(server.grpc_url, prompts, args.max_tokens)
    finally:
        server.stop(timeout=30)
    for index, (result, streamed, want) in enumerate(zip(results, pieces, expected)):
        if isinstance(result, Exception):
            failures += 1
            print(f"  stream {index}: ERROR {result}")
        elif "".join(streamed) != result.text:
            failures += 1
            print(f"  stream {index}: PIECES {streamed!r} do not make the final text {result.text!r}")
        elif result.text != want:
            agreed = len(os.path.commonprefix([result.text.split(), want.split()]))
            if quantized and agreed >= 2 and diverged < allowed:
                diverged += 1
                print(f"  stream {index}: diverged after {agreed} words (FP8, batch-dependent): server "
                      f"{result.text!r} offline {want!r}")
            else:
                failures += 1
                print(f"  stream {index}: MISMATCH server {result.text!r} offline {want!r} pieces {len(streamed)}")
    summary(f"{profile.name}: {args.requests} concurrent gRPC streams", results, elapsed)
    print(f"{profile.name}: {args.requests - failures - diverged}/{args.requests} streams equal the offline engine's "
          f"answer" + (f", {diverged} diverged (at most {allowed} allowed with FP8)" if quantized else "")
          + f"; example: {prompts[0]!r} -> {expected[0]!r}", flush=True)
    if args.also_profile:
        other = load_profile(args.also_profile)
        server = serve(other, args, tokenizer_env, server_dir, "tritonserver-2.log")
        try:
            concurrent_streams(server.grpc_url, prompts[:4], 8)  # warm-up
            results, _, elapsed = concurrent_streams(server.grpc_url, prompts, 128, min_tokens=128)
        finally:
            server.stop(timeout=30)
        summary(f"{other.name}: {args.requests} concurrent gRPC streams x 128 tokens", results, elapsed)
        failures += sum(1 for r in results if isinstance(r, Exception))
    print("gpu server check: " + ("OK" if failures == 0 else f"{failures} failure(s)"))
    return 0 if failures == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
