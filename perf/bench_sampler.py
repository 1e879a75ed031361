"""Per-step cost of the batched sampler (inflightllm/gpu/sampler.py) by setting.

    .venv/bin/python perf/bench_sampler.py [--rows 1024] [--vocab 128256] [--out sampler.json]
        [--baseline /tmp/old_sampler.py]
    .venv/bin/python perf/bench_sampler.py --device cpu --rows 8 --vocab 1000   # a smoke run

One step = `GpuSampler.sample` over [rows, vocab] logits (bf16 on the GPU, as the LM head
gives them; float32 on the CPU), every row with the same settings:
- greedy;
- sampled: temperature 0.8, top-p 0.95, top-k 50 (issue 27's workload);
- sampled + penalty + logprobs: the same with repetition_penalty 1.1 and 5 top log probs;
- top-p only: temperature 0.8, top-p 0.95 (the whole-row bisection path).
Printed and saved (`--out`, JSON): device milliseconds per step (CUDA events around
`--steps` queued steps) and host milliseconds per step (the time to queue one), and each
sampled setting's device time over greedy's.

`--baseline FILE` times another implementation of the same interface as well (a file
holding an older `inflightllm/gpu/sampler.py`, e.g. `git show 67ab833:inflightllm/gpu/
sampler.py > /tmp/old_sampler.py`, the full-sort sampler of before issue 27), so old and
new are measured in one run on one machine. The logits are N(0, 4^2) per entry with a few
ids lifted per row (a peaked, language-model-like distribution: top-p 0.95 keeps a few
hundred to a few thousand ids).

The end-to-end figure (128/128 x 1,024 output tok/s, each setting against greedy in one run)
is `python -m perf.bench_rows --profile ... --rows 128/128x1024 --sampling
greedy,sampled,sampled-penalty`.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from inflightllm.gpu.sampler import GpuSampler
from inflightllm.request import Request
from inflightllm.sampling_params import SamplingParams

SETTINGS = {
    "greedy": SamplingParams(max_tokens=128),
    "sampled t0.8 p0.95 k50": SamplingParams(max_tokens=128, temperature=0.8, top_p=0.95, top_k=50),
    "sampled + repetition 1.1 + top-5 logprobs": SamplingParams(
        max_tokens=128, temperature=0.8, top_p=0.95, top_k=50, repetition_penalty=1.1, top_logprobs=5),
    "top-p only t0.8 p0.95": SamplingParams(max_tokens=128, temperature=0.8, top_p=0.95),
}


def load_sampler_class(path: str | None):
    """GpuSampler of the file at `path` (imported under its own module name), or ours."""
    if path is None:
        return GpuSampler
    spec = importlib.util.spec_from_file_location("baseline_gpu_sampler", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (dataclasses look their module up there)
    spec.loader.exec_module(module)
    return module.GpuSampler


def make_logits(rows: int, vocab: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    generator = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(rows, vocab, device=device, generator=generator) * 4.0  # [rows, vocab]
    lifted = torch.randint(0, vocab, (rows, 8), device=device, generator=generator)
    logits.scatter_add_(1, lifted, torch.linspace(12.0, 4.0, 8, device=device).expand(rows, -1).contiguous())
    return logits.to(dtype)


def make_requests(params: SamplingParams, rows: int, vocab: int) -> list[Request]:
    """Requests with a 128-token prompt and 64 generated tokens (the penalties' history)."""
    rng = np.random.default_rng(1)
    requests = []
    for index in range(rows):
        request = Request(request_id=f"r{index}", prompt_token_ids=rng.integers(0, vocab, 128).tolist(), params=params)
        request.token_ids.extend(rng.integers(0, vocab, 64).tolist())
        requests.append(request)
    return requests


def time_setting(sampler_class, params, logits, steps: int, warmup: int) -> dict:
    device = logits.device
    rows, vocab = logits.shape
    staging = None
    if device.type == "cuda":
        from inflightllm.gpu.staging import PinnedStaging

        staging = PinnedStaging(device)
    sampler = sampler_class(device, max_rows=rows, seed=0, upload=staging.upload if staging else None)
    requests = make_requests(params, rows, vocab)
    row_ids = np.arange(rows)
    for row, request in enumerate(requests):
        sampler.add_row(row, request)
    counts = np.full(rows, 64, np.int64)

    def step():
        if staging is not None:
            staging.begin_step()
        return sampler.sample(logits, row_ids, requests, counts)

    for _ in range(warmup):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        host_started = time.perf_counter()
        start.record()
        for _ in range(steps):
            result = step()
        host_ms = (time.perf_counter() - host_started) / steps * 1e3
        end.record()
        torch.cuda.synchronize(device)
        device_ms = start.elapsed_time(end) / steps
    else:
        host_started = time.perf_counter()
        for _ in range(steps):
            result = step()
        host_ms = device_ms = (time.perf_counter() - host_started) / steps * 1e3
    ids = result.token_ids.cpu()
    assert bool(((ids >= 0) & (ids < vocab)).all()), "ids outside the vocabulary"
    return {"device_ms": round(device_ms, 4), "host_ms": round(host_ms, 4)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--dtype", default=None, help="logits dtype (default: bfloat16 on CUDA, float32 on CPU)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--baseline", default=None, help="a file with another GpuSampler to time beside ours")
    parser.add_argument("--out", default=None, help="write the figures here (JSON)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    logits = make_logits(args.rows, args.vocab, device, dtype)
    implementations = {"new": GpuSampler}
    if args.baseline:
        implementations["baseline"] = load_sampler_class(args.baseline)
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "rows": args.rows, "vocab": args.vocab, "dtype": str(dtype).removeprefix("torch."),
              "steps": args.steps, "baseline": args.baseline, "settings": {}}
    for name, params in SETTINGS.items():
        figures = {label: time_setting(cls, params, logits, args.steps, args.warmup)
                   for label, cls in implementations.items()}
        report["settings"][name] = figures
    greedy = report["settings"]["greedy"]
    for name, figures in report["settings"].items():
        for label, figure in figures.items():
            figure["over_greedy"] = round(figure["device_ms"] / max(greedy[label]["device_ms"], 1e-9), 3)
        line = "  ".join(f"{label}: {f['device_ms']:8.3f} ms device, {f['host_ms']:7.3f} ms host, "
                         f"{f['over_greedy']:6.2f}x greedy" for label, f in figures.items())
        print(f"{name:44s} {line}")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
        print(f"saved {args.out}")
    return report


if __name__ == "__main__":
    main()
