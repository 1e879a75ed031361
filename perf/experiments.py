"""The seed articles' experiments, each run side by side in one process against real servers.

    .venv/bin/python -m perf.experiments inflight-vs-static   [--profile P]
    .venv/bin/python -m perf.experiments prefix-cache         [--profile P]
    .venv/bin/python -m perf.experiments dynamic-batching     [--profile P]
    .venv/bin/python -m perf.experiments triton-vs-engine     [--profile P]

Each starts one server per variant, one after another, on the same profile with one
setting changed, sends the same requests (same seeds) and writes
`perf/results/<experiment>-<profile>.{json,md}`, the load generator's plots and a bar chart
`...-bars.png`. Sizes depend on the profile's device: small on `cpu` (a few minutes on
2 cores), the articles' sizes on `gpu`. Every size can be overridden on the command line.

- inflight-vs-static (the in-flight batching article, seeds/000): the mixed workload (one
  request in ten long) at one closed-loop concurrency, `engine.batching_strategy` inflight
  vs static. Requests/s, p99 e2e latency overall and of the short requests.
- prefix-cache: the shared-prefix workload, `engine.enable_kv_cache_reuse` true vs false.
  TTFT and throughput.
- dynamic-batching (the dynamic batching article, seeds/004): `preprocessing` called
  directly (unary gRPC) at concurrency 8, 16, 32, with the profile's `dynamic_batching`
  (`preferred_batch_size`, `max_queue_delay_microseconds`) vs none (Triton's default
  scheduler, one request per `execute`). QPS, p95 latency and the average batch
  `execute` received (Triton's statistics); then the whole ensemble with `max_tokens` 1.
  `postprocessing` has no dynamic batcher in any profile (one instance on the default
  scheduler relays cancellations: docs/PROFILES.md), so it is not varied.
- triton-vs-engine: the same fixed-length requests all sent at once through tritonserver
  (gRPC streaming, the whole ensemble) and given at once to the engine in-process
  (`inflightllm.llm.LLM`, the profile's engine settings). Output tokens/s of each.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
import time
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from perf import loadgen  # noqa: E402
from perf.loadgen import SLO, Load  # noqa: E402
from perf.workloads import CHAT_QUESTIONS, WorkloadSpec, build_requests  # noqa: E402

EXPERIMENTS = ("inflight-vs-static", "prefix-cache", "dynamic-batching", "triton-vs-engine")

# Per device kind: the workload, the load points, the time limit of one point, the SLO.
DEFAULTS = {
    "inflight-vs-static": {
        "cpu": dict(workload=WorkloadSpec("mixed", num_requests=40, input_len=32, short_len=32, long_len=256,
                                          long_every=10), concurrency="8", max_seconds=420,
                    slo=SLO(ttft_ms=2000, e2e_ms=10000)),
        "gpu": dict(workload=WorkloadSpec("mixed", num_requests=600, input_len=128, short_len=50, long_len=2000,
                                          long_every=10), concurrency="64", max_seconds=600,
                    slo=SLO(ttft_ms=500, e2e_ms=2000)),
    },
    "prefix-cache": {
        "cpu": dict(workload=WorkloadSpec("shared-prefix", num_requests=24, input_len=16, output_len=16,
                                          prefix_len=384), concurrency="4", max_seconds=240,
                    slo=SLO(ttft_ms=1000)),
        "gpu": dict(workload=WorkloadSpec("shared-prefix", num_requests=512, input_len=128, output_len=128,
                                          prefix_len=2048), concurrency="64", max_seconds=600,
                    slo=SLO(ttft_ms=200)),
    },
    "dynamic-batching": {
        "cpu": dict(workload=WorkloadSpec("chat", num_requests=400, output_len=1), concurrency="8,16,32",
                    max_seconds=60, slo=SLO(), ensemble_requests=48),
        "gpu": dict(workload=WorkloadSpec("chat", num_requests=4000, output_len=1), concurrency="8,16,32",
                    max_seconds=120, slo=SLO(), ensemble_requests=512),
    },
    "triton-vs-engine": {
        "cpu": dict(workload=WorkloadSpec("fixed", num_requests=32, input_len=64, output_len=64), concurrency="",
                    rate="inf", max_seconds=300, slo=SLO()),
        "gpu": dict(workload=WorkloadSpec("fixed", num_requests=512, input_len=512, output_len=256), concurrency="",
                    rate="inf", max_seconds=600, slo=SLO()),
    },
}


def _ratio(a, b) -> str:
    return "—" if not a or not b else f"{a / b:.2f}x"


def _series_label_stat(series: dict, label: str, metric: str, pct: str):
    point = series["points"][0]
    return point["by_label"].get(label, {}).get(metric, {}).get(pct)


def _result(title: str, spec: WorkloadSpec, slo: SLO, series: list[dict], args) -> dict:
    return {"title": title, "meta": args.meta, "workload": dataclasses.asdict(spec),
            "workload_text": spec.describe(), "slo": slo.describe(), "series": series}


def _run_variants(profile_path: Path, variants: list[tuple[str, dict, dict]], spec: WorkloadSpec, loads, tokenizer,
                  max_seconds: float, slo: SLO, progress: bool, options=None) -> list[dict]:
    from perf import servers

    all_series = []
    for name, overrides, serve_kwargs in variants:
        with servers.serve_profile(profile_path, overrides, suffix=name, options=options, **serve_kwargs) as served:
            all_series.append(loadgen.run_series(
                name, served.server.grpc_url, served.server.metrics_url, spec, loads, tokenizer, max_seconds,
                slo=slo, server=served.describe(), progress=progress))
    return all_series


# --- in-flight vs static ---------------------------------------------------------------------


def inflight_vs_static(args, cfg, profile, tokenizer) -> tuple[dict, str, list]:
    spec, slo = cfg["workload"], cfg["slo"]
    loads = loadgen.parse_loads(cfg["concurrency"], cfg.get("rate"))
    series = _run_variants(args.profile, [("in-flight", {"engine.batching_strategy": "inflight"}, {}),
                                          ("static", {"engine.batching_strategy": "static"}, {})],
                           spec, loads, tokenizer, cfg["max_seconds"], slo, not args.no_progress,
                           args.server_options)
    lines = ["| batching | load | req/s | out tok/s | e2e p99 all (ms) | e2e p99 short (ms) | e2e p50 short (ms) | "
             "TTFT p99 short (ms) | e2e p99 long (ms) |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for s in series:
        for point in s["points"]:
            sm, lab = point["summary"], point["by_label"]
            lines.append(f"| {s['name']} | {Load(**point['load'])} | {sm['requests_per_s']:.3f} | "
                         f"{sm['output_tokens_per_s']:.1f} | {loadgen._fmt(sm['e2e_ms']['p99'])} | "
                         f"{loadgen._fmt(lab.get('short', {}).get('e2e_ms', {}).get('p99'))} | "
                         f"{loadgen._fmt(lab.get('short', {}).get('e2e_ms', {}).get('p50'))} | "
                         f"{loadgen._fmt(lab.get('short', {}).get('ttft_ms', {}).get('p99'))} | "
                         f"{loadgen._fmt(lab.get('long', {}).get('e2e_ms', {}).get('p99'))} |")
    inflight, static = series
    rps = [s["points"][0]["summary"]["requests_per_s"] for s in series]
    p99_short = [_series_label_stat(s, "short", "e2e_ms", "p99") for s in series]
    lines += ["", f"In-flight / static: requests/s {_ratio(rps[0], rps[1])} (goal ≥ 3x); p99 e2e of the short "
              f"requests {_ratio(p99_short[0], p99_short[1])} of static's (goal ≤ 0.2x). The article (A100, "
              "Llama-3.1-70B): 36 vs 15 requests/s, p99 1,500 vs 4,200 ms.", ""]
    panels = [("requests/s", {s["name"]: [s["points"][0]["summary"]["requests_per_s"]] for s in series}),
              ("e2e p99, all (ms)", {s["name"]: [s["points"][0]["summary"]["e2e_ms"]["p99"]] for s in series}),
              ("e2e p99, short (ms)", {s["name"]: [_series_label_stat(s, "short", "e2e_ms", "p99")] for s in series})]
    result = _result("In-flight vs static batching (mixed workload)", spec, slo, series, args)
    return result, "\n".join(lines) + "\n", [([str(load) for load in loads], panels)]


# --- prefix caching ---------------------------------------------------------------------------


def prefix_cache(args, cfg, profile, tokenizer) -> tuple[dict, str, list]:
    spec, slo = cfg["workload"], cfg["slo"]
    loads = loadgen.parse_loads(cfg["concurrency"], cfg.get("rate"))
    series = _run_variants(args.profile, [("prefix cache on", {"engine.enable_kv_cache_reuse": True}, {}),
                                          ("prefix cache off", {"engine.enable_kv_cache_reuse": False}, {})],
                           spec, loads, tokenizer, cfg["max_seconds"], slo, not args.no_progress,
                           args.server_options)
    lines = ["| prefix cache | load | req/s | out tok/s | TTFT p50 / p99 (ms) | e2e p50 / p99 (ms) | "
             "prompt tokens from the cache | engine hit rate |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for s in series:
        for point in s["points"]:
            sm = point["summary"]
            hit = point["engine"].get("prefix_cache_hit_rate")
            lines.append(f"| {s['name']} | {Load(**point['load'])} | {sm['requests_per_s']:.3f} | "
                         f"{sm['output_tokens_per_s']:.1f} | {loadgen._fmt(sm['ttft_ms']['p50'])} / "
                         f"{loadgen._fmt(sm['ttft_ms']['p99'])} | {loadgen._fmt(sm['e2e_ms']['p50'])} / "
                         f"{loadgen._fmt(sm['e2e_ms']['p99'])} | {sm['cached_prompt_tokens']:,} of "
                         f"{sm['prompt_tokens']:,} | {'—' if hit is None else f'{hit:.2f}'} |")
    ttft = [s["points"][0]["summary"]["ttft_ms"]["p50"] for s in series]
    tps = [s["points"][0]["summary"]["output_tokens_per_s"] for s in series]
    lines += ["", f"On / off: TTFT p50 {_ratio(ttft[0], ttft[1])}, output tokens/s {_ratio(tps[0], tps[1])}.", ""]
    panels = [("TTFT p50 (ms)", {s["name"]: [s["points"][0]["summary"]["ttft_ms"]["p50"]] for s in series}),
              ("output tokens/s", {s["name"]: [s["points"][0]["summary"]["output_tokens_per_s"]] for s in series}),
              ("requests/s", {s["name"]: [s["points"][0]["summary"]["requests_per_s"]] for s in series})]
    result = _result("Prefix caching on vs off (shared-prefix workload)", spec, slo, series, args)
    return result, "\n".join(lines) + "\n", [([str(load) for load in loads], panels)]


# --- dynamic batching of the tokenizer model ----------------------------------------------------


def _preprocessing_inputs(question: str) -> list:
    """Inputs for `preprocessing` called directly (its inputs are the ensemble's)."""
    return loadgen.make_inputs({"messages": [{"role": "user", "content": question}], "max_tokens": 16})


async def unary_point(url: str, model: str, concurrency: int, num_requests: int, max_seconds: float) -> dict:
    """Closed-loop unary gRPC calls of `model`; latencies and Triton's batch statistics."""
    import tritonclient.grpc.aio as aio

    client = aio.InferenceServerClient(url)
    questions = [CHAT_QUESTIONS[i % len(CHAT_QUESTIONS)] + f" (#{i})" for i in range(num_requests)]
    inputs = [_preprocessing_inputs(q) for q in questions]

    async def stats():
        s = (await client.get_inference_statistics(model)).model_stats[0]
        return s.inference_count, s.execution_count

    for i in range(min(concurrency, num_requests)):  # warm-up, not measured
        await client.infer(model, inputs[i])
    before = await stats()
    latencies, errors = [], 0
    t0 = time.perf_counter()
    deadline = t0 + max_seconds
    next_index = iter(range(num_requests))

    async def worker():
        nonlocal errors
        for i in next_index:
            if time.perf_counter() >= deadline:
                return
            start = time.perf_counter()
            try:
                await client.infer(model, inputs[i])
                latencies.append(time.perf_counter() - start)
            except Exception:  # counted; a benchmark keeps going
                errors += 1

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    duration = time.perf_counter() - t0
    after = await stats()
    await client.close()
    inferences, executions = after[0] - before[0], after[1] - before[1]
    lat = np.asarray(latencies) * 1000
    return {"concurrency": concurrency, "completed": len(latencies), "errors": errors, "duration_s": round(duration, 3),
            "qps": round(len(latencies) / duration, 1),
            **{f"p{p}_ms": round(float(np.percentile(lat, p)), 2) if len(lat) else None for p in (50, 95, 99)},
            "avg_batch": round(inferences / executions, 2) if executions else None}


def dynamic_batching(args, cfg, profile, tokenizer) -> tuple[dict, str, list]:
    from perf import servers

    spec, slo = cfg["workload"], cfg["slo"]
    concurrencies = [int(c) for c in cfg["concurrency"].split(",")]
    ensemble_spec = dataclasses.replace(spec, num_requests=min(cfg["ensemble_requests"], spec.num_requests))
    loads = [Load("concurrency", c) for c in concurrencies]
    series, unary = [], {}
    for name, enabled in (("dynamic batching on", True), ("dynamic batching off", False)):
        with servers.serve_profile(args.profile, {}, suffix="dynbatch", preprocessing_dynamic_batching=enabled,
                                   options=args.server_options) as served:
            unary[name] = [asyncio.run(unary_point(served.server.grpc_url, "preprocessing", c, spec.num_requests,
                                                   cfg["max_seconds"])) for c in concurrencies]
            for row in unary[name]:
                print(f"[{name}] preprocessing concurrency {row['concurrency']}: {row['qps']} QPS, "
                      f"p95 {row['p95_ms']} ms, avg batch {row['avg_batch']}", file=sys.stderr, flush=True)
            series.append(loadgen.run_series(
                f"ensemble, {name}", served.server.grpc_url, served.server.metrics_url, ensemble_spec, loads,
                tokenizer, cfg["max_seconds"], slo=slo, server=served.describe(), progress=not args.no_progress))
    lines = [f"`preprocessing` called directly (unary gRPC, one chat question each, {spec.num_requests} requests "
             f"per point; dynamic batching: preferred_batch_size {list(profile.preferred_batch_size)}, "
             f"max_queue_delay_microseconds {profile.max_queue_delay_microseconds}, "
             f"{profile.instances_preprocessing} instance(s)):", "",
             "| concurrency | dynamic batching | QPS | p50 (ms) | p95 (ms) | p99 (ms) | avg batch per execute |",
             "|---:|---|---:|---:|---:|---:|---:|"]
    for i, c in enumerate(concurrencies):
        for name, rows in unary.items():
            row = rows[i]
            lines.append(f"| {c} | {name.removeprefix('dynamic batching ')} | {row['qps']:,.1f} | {row['p50_ms']} | "
                         f"{row['p95_ms']} | {row['p99_ms']} | {row['avg_batch']} |")
    lines += ["", "The whole ensemble, same servers, chat questions with `max_tokens` 1 "
              f"({ensemble_spec.num_requests} requests per point): the table below.", ""]
    groups = [f"c{c}" for c in concurrencies]
    panels = [("preprocessing QPS", {name: [r["qps"] for r in rows] for name, rows in unary.items()}),
              ("preprocessing p95 (ms)", {name: [r["p95_ms"] for r in rows] for name, rows in unary.items()}),
              ("ensemble req/s (max_tokens 1)",
               {s["name"].removeprefix("ensemble, "): [p["summary"]["requests_per_s"] for p in s["points"]]
                for s in series})]
    result = _result("Dynamic batching of preprocessing on vs off", ensemble_spec, slo, series, args)
    result["preprocessing_direct"] = unary
    return result, "\n".join(lines) + "\n", [(groups, panels)]


# --- Triton vs the engine in-process -------------------------------------------------------------


def triton_vs_engine(args, cfg, profile, tokenizer) -> tuple[dict, str, list]:
    from inflightllm.llm import LLM
    from inflightllm.sampling_params import SamplingParams

    spec, slo = cfg["workload"], cfg["slo"]
    loads = loadgen.parse_loads(cfg.get("concurrency"), cfg.get("rate"))
    series = _run_variants(args.profile, [("tritonserver (ensemble, gRPC streaming)", {}, {})], spec, loads,
                           tokenizer, cfg["max_seconds"], slo, not args.no_progress,
                           args.server_options)
    # The engine in-process, the same requests as the Triton point (seed + point index 0).
    requests = build_requests(spec, tokenizer)
    prompts = [tokenizer.encode(r.inputs["text_input"], add_special_tokens=False) for r in requests]
    params = [SamplingParams(max_tokens=r.inputs["max_tokens"], min_tokens=r.inputs["min_tokens"]) for r in requests]
    import torch

    if args.engine_threads:
        torch.set_num_threads(args.engine_threads)
    llm = LLM(profile.model, config=profile.engine, load_tokenizer_too=False)
    llm.generate(prompts[:1], [dataclasses.replace(params[0], max_tokens=2, min_tokens=2)])  # warm-up
    started = time.perf_counter()
    outputs = llm.generate(prompts, params)
    seconds = time.perf_counter() - started
    engine_tokens = sum(len(o.token_ids) for o in outputs)
    engine_row = {"seconds": round(seconds, 3), "output_tokens": engine_tokens,
                  "output_tokens_per_s": round(engine_tokens / seconds, 2),
                  "requests_per_s": round(len(outputs) / seconds, 4), "torch_threads": torch.get_num_threads()}
    triton = series[0]["points"][0]["summary"]
    lines = ["| system | requests | seconds | output tokens | output tok/s | req/s |", "|---|---:|---:|---:|---:|---:|",
             f"| tritonserver ensemble (gRPC streaming, {loads[0]}) | {triton['completed']} | {triton['duration_s']:.1f} | "
             f"{triton['output_tokens']:,} | {triton['output_tokens_per_s']:.1f} | {triton['requests_per_s']:.3f} |",
             f"| engine in-process (`LLM.generate`, all at once, {engine_row['torch_threads']} torch threads) | {len(outputs)} | {seconds:.1f} | {engine_tokens:,} | "
             f"{engine_row['output_tokens_per_s']:.1f} | {engine_row['requests_per_s']:.3f} |", "",
             f"Triton / engine-only output tokens/s: "
             f"{_ratio(triton['output_tokens_per_s'], engine_row['output_tokens_per_s'])}.", ""]
    panels = [("output tokens/s", {"tritonserver": [triton["output_tokens_per_s"]],
                                   "engine in-process": [engine_row["output_tokens_per_s"]]})]
    result = _result("Triton vs engine-only (fixed lengths, all requests at once)", spec, slo, series, args)
    result["engine_only"] = engine_row
    return result, "\n".join(lines) + "\n", [([spec.name], panels)]


RUNNERS = {"inflight-vs-static": inflight_vs_static, "prefix-cache": prefix_cache,
           "dynamic-batching": dynamic_batching, "triton-vs-engine": triton_vs_engine}


def main(argv: list[str] | None = None) -> int:
    from inflightllm.model_source import load_tokenizer
    from inflightllm.profile import DEFAULT_PROFILE, load_profile
    from perf import plots, servers

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("experiment", choices=EXPERIMENTS)
    parser.add_argument("--profile", type=Path, default=DEFAULT_PROFILE)
    parser.add_argument("--num-requests", type=int, default=None, help="requests per point")
    parser.add_argument("--concurrency", default=None)
    parser.add_argument("--max-seconds", type=float, default=None, help="time limit of one point")
    for name in ("input-len", "output-len", "short-len", "long-len", "prefix-len"):
        parser.add_argument(f"--{name}", type=int, default=None)
    parser.add_argument("--out", type=Path, default=None, help="default perf/results/<experiment>-<profile>")
    parser.add_argument("--engine-threads", type=int, default=None,
                        help="triton-vs-engine: torch threads of the in-process engine (default: torch's)")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--no-plots", action="store_true", help="write JSON and markdown only")
    servers.add_server_arguments(parser)
    args = parser.parse_args(argv)
    args.server_options = servers.server_options(args)
    args.command = loadgen.command_line("perf.experiments", argv)
    args.meta = loadgen.run_metadata(args.command)  # at the start: the commit that ran

    profile = load_profile(args.profile)
    cfg = dict(DEFAULTS[args.experiment][profile.engine.device])
    overrides = {key: getattr(args, key.replace("-", "_")) for key in
                 ("input-len", "output-len", "short-len", "long-len", "prefix-len")}
    spec = dataclasses.replace(cfg["workload"], **{k.replace("-", "_"): v for k, v in overrides.items() if v is not None})
    if args.num_requests is not None:
        spec = dataclasses.replace(spec, num_requests=args.num_requests)
    cfg["workload"] = spec
    if args.concurrency is not None:
        cfg["concurrency"] = args.concurrency
    if args.max_seconds is not None:
        cfg["max_seconds"] = args.max_seconds
    tokenizer = load_tokenizer(profile.model)
    result, comparison, charts = RUNNERS[args.experiment](args, cfg, profile, tokenizer)
    out = args.out or loadgen.RESULTS_DIR / f"{args.experiment}-{profile.name}"
    # Kept in the JSON, so that `python -m perf.plots --from-json` can redo the markdown and
    # the bar chart elsewhere (the GPU host may lack matplotlib).
    result["extra_markdown"] = comparison + "\n"
    result["charts"] = [[groups, [[title, values] for title, values in panels]] for groups, panels in charts]
    written = loadgen.write_result(result, out, plots=not args.no_plots)
    if not args.no_plots and plots.available():
        for groups, panels in charts:
            written.append(plots.bar_chart(groups, panels, out.with_name(out.name + "-bars.png")))
    for path in written:
        print(f"wrote {path}")
    print(comparison)
    print(loadgen.markdown_table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
