"""Load generator over the real server: asyncio gRPC streaming with `tritonclient`.

Each request is its own gRPC stream to the ensemble (`tritonclient.grpc.aio`), so the
client never serialises requests. Two ways to apply load, each point bounded by a
request count and a time limit:
- closed loop (`--concurrency 1,4,8`): N clients, each sends its next request when the
  previous one finishes;
- open loop (`--rate 0.5,1,inf`): requests arrive as a Poisson process of the given rate
  (requests/s; `inf` sends them all at once), whatever the server's state.
At the time limit the streams still open are cancelled and counted as `incomplete`.

Metrics, as vLLM's `bench serve` defines them:
- TTFT: send to the first response that carries output tokens;
- ITL: the gaps between a request's consecutive token-bearing responses (all gaps pooled);
- TPOT: per request, (e2e − TTFT) / (output tokens − 1);
- e2e: send to the final response;
- output tokens/s and requests/s: over completed requests, divided by the point's duration
  (first send to last completion);
- goodput: completed requests/s that met every given SLO (`--slo-ttft-ms`,
  `--slo-tpot-ms`, `--slo-e2e-ms`).
While a point runs, the server's metrics endpoint is polled (KV-cache usage, running and
waiting requests, prefix-cache counters: docs/METRICS.md).

Output: `<out>.json` (everything, per request), `<out>.md` (a table) and PNG plots
`<out>-latency.png`, `<out>-distributions.png`, `<out>-kv-cache.png`.

    .venv/bin/python -m perf.loadgen --workload fixed --input-len 64 --output-len 32 \\
        --concurrency 1,4,8 --num-requests 24 --out perf/results/loadgen-fixed-cpu
    .venv/bin/python -m perf.loadgen --url 127.0.0.1:8001 --metrics-url http://127.0.0.1:8002/metrics ...

Without `--url` it starts a server for `--profile` (with `--set KEY=VALUE` overrides).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import datetime
import json
import math
import os
import platform
import random
import re
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from perf.workloads import WORKLOADS, BenchRequest, WorkloadSpec, build_requests  # noqa: E402

RESULTS_DIR = REPO_ROOT / "perf" / "results"
PERCENTILES = (50, 90, 99)


# --- one request ---------------------------------------------------------------------------


@dataclass
class RequestRecord:
    """What the client saw of one request (times in seconds from the point's start)."""

    index: int
    label: str
    send_time: float = 0.0
    token_times: list[float] = field(default_factory=list)  # since send, per token-bearing response
    token_counts: list[int] = field(default_factory=list)  # tokens in each of those responses
    end_time: float | None = None  # since send: the final response
    num_input_tokens: int | None = None
    num_cached_tokens: int | None = None
    num_output_tokens: int = 0
    finish_reason: str = ""
    error: str | None = None
    completed: bool = False

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] if self.token_times else None

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]

    @property
    def tpot(self) -> float | None:
        if not self.completed or self.num_output_tokens < 2 or self.ttft is None:
            return None
        return (self.end_time - self.ttft) / (self.num_output_tokens - 1)

    def to_json(self) -> dict:
        def ms(value):
            return None if value is None else round(value * 1000, 2)

        return {
            "index": self.index, "label": self.label, "send_s": round(self.send_time, 4),
            "completed": self.completed, "error": self.error, "finish_reason": self.finish_reason,
            "num_input_tokens": self.num_input_tokens, "num_cached_tokens": self.num_cached_tokens,
            "num_output_tokens": self.num_output_tokens, "ttft_ms": ms(self.ttft), "e2e_ms": ms(self.end_time),
            "tpot_ms": ms(self.tpot), "token_times_ms": [ms(t) for t in self.token_times],
            "token_counts": self.token_counts,
        }


def make_inputs(values: dict) -> list:
    """Ensemble inputs (`{"text_input": "hi", "max_tokens": 8, "messages": [...]}`) -> InferInputs
    with the batch dimension of 1 and the types the ensemble declares."""
    import tritonclient.grpc as grpcclient

    from tools.render_configs import ENSEMBLE_INPUTS

    types = {tensor.name: tensor.data_type.removeprefix("TYPE_").replace("STRING", "BYTES")
             for tensor in ENSEMBLE_INPUTS}
    numpy_types = {"BYTES": object, "BOOL": bool, "INT32": np.int32, "UINT64": np.uint64, "FP32": np.float32}
    inputs = []
    for name, value in values.items():
        if name in ("messages", "sampling_parameters") and not isinstance(value, str):
            value = json.dumps(value)
        items = value if isinstance(value, list) else [value]
        if types[name] == "BYTES":
            array = np.array([[v.encode() if isinstance(v, str) else v for v in items]], dtype=object)
        else:
            array = np.array([items], dtype=numpy_types[types[name]])
        tensor = grpcclient.InferInput(name, list(array.shape), types[name])
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


async def send_one(client, model: str, request: BenchRequest, record: RequestRecord, t0: float,
                   deadline: float) -> RequestRecord:
    """Stream one request to the end (or to `deadline`, a perf_counter time; then cancel)."""
    finished = asyncio.Event()

    async def request_iterator():
        yield {"model_name": model, "inputs": make_inputs(request.inputs), "request_id": str(record.index),
               "parameters": {"triton_enable_empty_final_response": True}}
        await finished.wait()  # keep the stream open until the final response

    sent = time.perf_counter()
    record.send_time = sent - t0
    responses = client.stream_infer(request_iterator())

    async def consume():
        async for result, error in responses:
            now = time.perf_counter() - sent
            if error is not None:
                record.error = str(error)
                return
            response = result.get_response()
            if response.outputs:
                num_new = int(result.as_numpy("output_ids").size)
                if num_new:
                    record.token_times.append(now)
                    record.token_counts.append(num_new)
                record.num_output_tokens = int(result.as_numpy("num_output_tokens").reshape(-1)[0])
                record.num_input_tokens = int(result.as_numpy("num_input_tokens").reshape(-1)[0])
                record.num_cached_tokens = int(result.as_numpy("num_cached_tokens").reshape(-1)[0])
                reason = result.as_numpy("finish_reason").reshape(-1)[0]
                record.finish_reason = reason.decode() if isinstance(reason, bytes) else str(reason)
            if response.parameters["triton_final_response"].bool_param:
                record.end_time = now
                record.completed = True
                return

    try:
        await asyncio.wait_for(consume(), timeout=max(deadline - time.perf_counter(), 0.001))
    except asyncio.TimeoutError:
        record.error = "incomplete: the point's time limit passed"
        responses.cancel()
    except Exception as error:  # a transport error fails this request only
        record.error = f"{type(error).__name__}: {error}"
        responses.cancel()
    finally:
        finished.set()
    return record


# --- the server's metrics ------------------------------------------------------------------

_METRIC_LINE = re.compile(r"^(inflightllm_\w+)(?:\{([^}]*)\})?\s+(\S+)$")


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {"name{label=value}": value} for the inflightllm_* series (the
    `model` label dropped; histograms' buckets skipped)."""
    values = {}
    for line in text.splitlines():
        match = _METRIC_LINE.match(line)
        if not match or match.group(1).endswith("_bucket"):
            continue
        labels = [item for item in (match.group(2) or "").split(",") if item and not item.startswith("model=")]
        key = match.group(1) + ("{" + ",".join(labels).replace('"', "") + "}" if labels else "")
        values[key] = float(match.group(3))
    return values


def fetch_metrics(url: str | None) -> dict[str, float]:
    if not url:
        return {}
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return parse_metrics(response.read().decode())
    except OSError:
        return {}


class MetricsPoller:
    """Polls the metrics endpoint every `interval` seconds while a point runs."""

    SAMPLED = {
        "kv_cache_usage": "inflightllm_kv_cache_usage_ratio",
        "running": "inflightllm_requests{state=running}",
        "waiting": "inflightllm_requests{state=waiting}",
        "kv_blocks_used": "inflightllm_kv_cache_blocks{state=used}",
    }

    def __init__(self, url: str | None, interval: float = 0.5):
        self.url = url
        self.interval = interval
        self.samples: list[dict] = []

    async def run(self, t0: float) -> None:
        while self.url:
            values = await asyncio.to_thread(fetch_metrics, self.url)
            if values:
                sample = {"t": round(time.perf_counter() - t0, 3)}
                sample.update({name: values.get(key) for name, key in self.SAMPLED.items()})
                self.samples.append(sample)
            await asyncio.sleep(self.interval)


def engine_deltas(before: dict[str, float], after: dict[str, float]) -> dict:
    """Engine-side figures over a point, from two metrics snapshots."""
    if not before or not after:
        return {}

    def delta(key):
        return after.get(key, 0.0) - before.get(key, 0.0)

    queries = delta("inflightllm_prefix_cache_queries_total")
    steps = delta("inflightllm_engine_steps_total")
    return {
        "engine_steps": int(steps),
        "generation_tokens": int(delta("inflightllm_generation_tokens_total")),
        "tokens_per_step": round(delta("inflightllm_generation_tokens_total") / steps, 2) if steps else None,
        "prefix_cache_hit_rate": round(delta("inflightllm_prefix_cache_hits_total") / queries, 4) if queries else None,
        "preemptions": int(delta("inflightllm_preemptions_total")),
    }


# --- running a point -----------------------------------------------------------------------


@dataclass
class Load:
    """One point of a sweep: `concurrency` clients (closed loop) or a Poisson `rate`."""

    mode: str  # "concurrency" or "rate"
    value: float

    def __str__(self) -> str:
        if self.mode == "concurrency":
            return f"concurrency {int(self.value)}"
        return "rate inf" if math.isinf(self.value) else f"rate {self.value:g}/s"


async def run_point(url: str, requests: list[BenchRequest], load: Load, max_seconds: float,
                    metrics_url: str | None = None, model: str = "ensemble", seed: int = 0,
                    progress: bool = True, description: str = "") -> dict:
    """Send `requests` under `load`; returns the point's records and metrics samples."""
    import tritonclient.grpc.aio as aio

    client = aio.InferenceServerClient(url)
    records = [RequestRecord(i, request.label) for i, request in enumerate(requests)]
    bar = _progress_bar(len(requests), f"{description} {load}".strip(), progress)
    poller = MetricsPoller(metrics_url)
    before = await asyncio.to_thread(fetch_metrics, metrics_url)
    t0 = time.perf_counter()
    deadline = t0 + max_seconds
    poll_task = asyncio.create_task(poller.run(t0))

    async def one(i: int) -> None:
        await send_one(client, model, requests[i], records[i], t0, deadline)
        bar.update(1)

    sent: list[int] = []
    try:
        if load.mode == "concurrency":
            next_index = iter(range(len(requests)))

            async def worker() -> None:
                for i in next_index:
                    if time.perf_counter() >= deadline:
                        return
                    sent.append(i)
                    await one(i)

            await asyncio.gather(*(worker() for _ in range(int(load.value))))
        else:
            rng = random.Random(seed)
            tasks = []
            for i in range(len(requests)):
                if time.perf_counter() >= deadline:
                    break
                sent.append(i)
                tasks.append(asyncio.create_task(one(i)))
                if not math.isinf(load.value):
                    await asyncio.sleep(rng.expovariate(load.value))
            await asyncio.gather(*tasks)
    finally:
        poll_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await poll_task
        bar.close()
        await client.close()
    after = await asyncio.to_thread(fetch_metrics, metrics_url)
    sent_records = [records[i] for i in sorted(sent)]
    ends = [r.send_time + r.end_time for r in sent_records if r.completed]
    duration = max(ends) if ends else max_seconds
    return {"load": dataclasses.asdict(load), "records": sent_records, "duration_s": duration,
            "not_sent": len(requests) - len(sent), "kv_samples": poller.samples,
            "engine": engine_deltas(before, after)}


def _progress_bar(total: int, description: str, enabled: bool):
    try:
        from tqdm import tqdm
    except ImportError:  # the `bench` extra is missing: run without a bar
        enabled = False
    if not enabled:
        class _NoBar:
            def update(self, n):
                pass

            def close(self):
                pass

        return _NoBar()
    return tqdm(total=total, desc=description, unit="req", leave=False, file=sys.stderr)


# --- summaries ---------------------------------------------------------------------------


def _stats(values: list[float], scale: float = 1000.0) -> dict:
    """mean and p50/p90/p99 (ms by default); None where there is nothing."""
    if not values:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    array = np.asarray(values, dtype=float) * scale
    return {"mean": round(float(array.mean()), 2),
            **{f"p{p}": round(float(np.percentile(array, p)), 2) for p in PERCENTILES}}


@dataclass
class SLO:
    """Goodput's service-level objective: a request is good when it meets every given bound."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    def met(self, record: RequestRecord) -> bool:
        checks = [(self.ttft_ms, record.ttft), (self.tpot_ms, record.tpot), (self.e2e_ms, record.end_time)]
        return record.completed and all(
            bound is None or (value is not None and value * 1000 <= bound) for bound, value in checks)

    def describe(self) -> str:
        parts = [f"{name} <= {bound:g} ms" for name, bound in
                 (("TTFT", self.ttft_ms), ("TPOT", self.tpot_ms), ("e2e", self.e2e_ms)) if bound is not None]
        return " and ".join(parts) or "none"


def summarize(records: list[RequestRecord], duration_s: float, slo: SLO | None = None) -> dict:
    """The point's figures (latencies in ms)."""
    slo = slo or SLO()
    done = [r for r in records if r.completed]
    output_tokens = sum(r.num_output_tokens for r in done)
    input_tokens = sum(r.num_input_tokens or 0 for r in done)
    summary = {
        "sent": len(records),
        "completed": len(done),
        "failed": sum(1 for r in records if not r.completed and r.error and not r.error.startswith("incomplete")),
        "incomplete": sum(1 for r in records if not r.completed and (not r.error or r.error.startswith("incomplete"))),
        "duration_s": round(duration_s, 3),
        "requests_per_s": round(len(done) / duration_s, 4) if duration_s else None,
        "output_tokens": output_tokens,
        "output_tokens_per_s": round(output_tokens / duration_s, 2) if duration_s else None,
        "total_tokens_per_s": round((input_tokens + output_tokens) / duration_s, 2) if duration_s else None,
        "cached_prompt_tokens": sum(r.num_cached_tokens or 0 for r in done),
        "prompt_tokens": input_tokens,
        "ttft_ms": _stats([r.ttft for r in done if r.ttft is not None]),
        "itl_ms": _stats([gap for r in done for gap in r.itls]),
        "tpot_ms": _stats([r.tpot for r in done if r.tpot is not None]),
        "e2e_ms": _stats([r.end_time for r in done]),
        "slo": slo.describe(),
        "good_requests": sum(1 for r in done if slo.met(r)),
    }
    summary["goodput_requests_per_s"] = round(summary["good_requests"] / duration_s, 4) if duration_s else None
    errors = sorted({r.error for r in records if r.error and not r.error.startswith("incomplete")})
    if errors:
        summary["errors"] = errors[:5]
    return summary


def summarize_by_label(records: list[RequestRecord]) -> dict:
    labels = sorted({r.label for r in records})
    out = {}
    for label in labels:
        done = [r for r in records if r.label == label and r.completed]
        out[label] = {"completed": len(done), "e2e_ms": _stats([r.end_time for r in done]),
                      "ttft_ms": _stats([r.ttft for r in done if r.ttft is not None]),
                      "tpot_ms": _stats([r.tpot for r in done if r.tpot is not None])}
    return out


def point_result(raw: dict, slo: SLO | None) -> dict:
    records = raw["records"]
    return {
        "load": raw["load"],
        "summary": summarize(records, raw["duration_s"], slo),
        "by_label": summarize_by_label(records),
        "engine": raw["engine"],
        "not_sent": raw["not_sent"],
        "kv_samples": raw["kv_samples"],
        "requests": [r.to_json() for r in records],
    }


# --- a series: one server, several load points ----------------------------------------------


def run_series(name: str, url: str, metrics_url: str | None, spec: WorkloadSpec, loads: list[Load],
               tokenizer, max_seconds: float, slo: SLO | None = None, warmup: int = 1, server: dict | None = None,
               model: str = "ensemble", progress: bool = True) -> dict:
    """Run every load point against one server. Each point gets fresh prompts of the same
    shapes (seed + point index), so a prefix cache cannot serve one point's prompts to the
    next; `warmup` requests go first and are not measured."""
    if warmup:
        warm = build_requests(dataclasses.replace(spec, num_requests=warmup, seed=spec.seed + 1000), tokenizer)
        asyncio.run(run_point(url, warm, Load("concurrency", warmup), max_seconds, None, model, progress=False))
    points = []
    for index, load in enumerate(loads):
        requests = build_requests(dataclasses.replace(spec, seed=spec.seed + index), tokenizer)
        raw = asyncio.run(run_point(url, requests, load, max_seconds, metrics_url, model, seed=spec.seed + index,
                                    progress=progress, description=name))
        point = point_result(raw, slo)
        points.append(point)
        s = point["summary"]
        print(f"[{name}] {load}: {s['completed']}/{s['sent']} done in {s['duration_s']:.1f} s, "
              f"{s['requests_per_s']:.3f} req/s, {s['output_tokens_per_s']:.1f} out tok/s, "
              f"TTFT p50 {s['ttft_ms']['p50']} ms, e2e p99 {s['e2e_ms']['p99']} ms", file=sys.stderr, flush=True)
    return {"name": name, "server": server or {"url": url}, "points": points}


# --- recording -------------------------------------------------------------------------------


def run_metadata(command: str) -> dict:
    """Date, machine and commit of a run, and the command that made it."""
    def git(*args):
        try:
            return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True,
                                  timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    cpu = ""
    with contextlib.suppress(OSError):
        cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name")), "")
    gpu = ""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=10).stdout.strip().replace("\n", ", ")
    return {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "commit": git("rev-parse", "--short", "HEAD") + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else ""),
        "machine": f"{cpu or platform.processor()}, {os.cpu_count()} cores, {platform.system()} {platform.release()}",
        "gpu": gpu or None,
        "python": platform.python_version(),
        # Other work on the machine changes every figure: keep the load average beside them.
        "load_average_1m_at_start": round(os.getloadavg()[0], 2),
        "command": command,
    }


def command_line(module: str, argv: list[str] | None) -> str:
    """The command as one would type it again."""
    import shlex

    return shlex.join([".venv/bin/python", "-m", module, *(sys.argv[1:] if argv is None else argv)])


def _fmt(value, digits: int = 0) -> str:
    if value is None:
        return "—"
    return f"{value:,.{digits}f}"


def markdown_table(result: dict) -> str:
    """One row per (series, point)."""
    lines = [
        "| series | load | done | req/s | out tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | TPOT p50 ms | "
        "e2e p50 / p90 / p99 ms | goodput req/s | KV max | prefix hit |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for series in result["series"]:
        for point in series["points"]:
            s, engine = point["summary"], point.get("engine") or {}
            kv = [sample["kv_cache_usage"] for sample in point["kv_samples"] if sample.get("kv_cache_usage") is not None]
            hit = engine.get("prefix_cache_hit_rate")
            lines.append(
                f"| {series['name']} | {Load(**point['load'])} | {s['completed']}/{s['sent']} | "
                f"{_fmt(s['requests_per_s'], 3)} | {_fmt(s['output_tokens_per_s'], 1)} | "
                f"{_fmt(s['ttft_ms']['p50'])} / {_fmt(s['ttft_ms']['p99'])} | "
                f"{_fmt(s['itl_ms']['p50'])} / {_fmt(s['itl_ms']['p99'])} | {_fmt(s['tpot_ms']['p50'])} | "
                f"{_fmt(s['e2e_ms']['p50'])} / {_fmt(s['e2e_ms']['p90'])} / {_fmt(s['e2e_ms']['p99'])} | "
                f"{_fmt(s['goodput_requests_per_s'], 3)} | {_fmt(max(kv) if kv else None, 3)} | "
                f"{'—' if hit is None else f'{hit:.2f}'} |")
    return "\n".join(lines) + "\n"


def label_table(result: dict) -> str:
    """Per request class (short/long, priority N, ...): e2e and TTFT percentiles."""
    lines = ["| series | load | class | done | TTFT p50 / p99 ms | e2e p50 / p90 / p99 ms |",
             "|---|---|---|---:|---:|---:|"]
    for series in result["series"]:
        for point in series["points"]:
            for label, stats in point["by_label"].items():
                lines.append(
                    f"| {series['name']} | {Load(**point['load'])} | {label} | {stats['completed']} | "
                    f"{_fmt(stats['ttft_ms']['p50'])} / {_fmt(stats['ttft_ms']['p99'])} | "
                    f"{_fmt(stats['e2e_ms']['p50'])} / {_fmt(stats['e2e_ms']['p90'])} / {_fmt(stats['e2e_ms']['p99'])} |")
    return "\n".join(lines) + "\n"


def markdown_document(result: dict, name: str, extra_markdown: str = "") -> str:
    """The `.md` of a result: header (date, commit, machine, command, workload), then
    `extra_markdown` (an experiment's comparison), then the tables."""
    meta = result["meta"]
    header = (f"# {result.get('title', name)}\n\n{meta['date_utc']} UTC, commit `{meta['commit']}`, "
              f"{meta['machine']}{', ' + meta['gpu'] if meta.get('gpu') else ''}\n\n"
              f"Command: `{meta['command']}`\n\nWorkload: {result['workload_text']}. SLO for goodput: "
              f"{result['slo']}.\n\n")
    body = markdown_table(result)
    if any(len(point["by_label"]) > 1 for series in result["series"] for point in series["points"]):
        body += "\n" + label_table(result)
    return header + extra_markdown + body


def write_result(result: dict, out: Path, plots: bool = True, extra_markdown: str | None = None) -> list[Path]:
    """`out`.json, `out`.md and (with plots, when matplotlib is there) `out`-*.png; returns
    the written paths. `extra_markdown` defaults to the result's own `extra_markdown`."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    written = [out.with_suffix(".json"), out.with_suffix(".md")]
    written[0].write_text(json.dumps(result, indent=1) + "\n")
    if extra_markdown is None:
        extra_markdown = result.get("extra_markdown", "")
    written[1].write_text(markdown_document(result, out.name, extra_markdown))
    if plots:
        from perf import plots as plotting

        if plotting.available():
            written += plotting.plot_all(result, out)
        else:
            print(plotting.MISSING, file=sys.stderr)
    return written


def parse_loads(concurrency: str | None, rate: str | None) -> list[Load]:
    loads = [Load("concurrency", int(c)) for c in (concurrency or "").split(",") if c.strip()]
    loads += [Load("rate", float(r)) for r in (rate or "").split(",") if r.strip()]
    if not loads:
        raise SystemExit("give --concurrency and/or --rate")
    return loads


def add_workload_arguments(parser: argparse.ArgumentParser, defaults: WorkloadSpec | None = None) -> None:
    d = defaults or WorkloadSpec()
    parser.add_argument("--workload", choices=WORKLOADS, default=d.name)
    parser.add_argument("--num-requests", type=int, default=d.num_requests, help="requests per load point")
    parser.add_argument("--input-len", type=int, default=d.input_len, help="prompt tokens (suffix for shared-prefix)")
    parser.add_argument("--output-len", type=int, default=d.output_len)
    parser.add_argument("--short-len", type=int, default=d.short_len, help="mixed: short requests' output tokens")
    parser.add_argument("--long-len", type=int, default=d.long_len, help="mixed: long requests' output tokens")
    parser.add_argument("--long-every", type=int, default=d.long_every, help="mixed: one request in N is long")
    parser.add_argument("--prefix-len", type=int, default=d.prefix_len)
    parser.add_argument("--num-prefixes", type=int, default=d.num_prefixes)
    parser.add_argument("--priority-levels", type=int, default=d.priority_levels)
    parser.add_argument("--seed", type=int, default=d.seed)


def workload_from_args(args) -> WorkloadSpec:
    return WorkloadSpec(name=args.workload, num_requests=args.num_requests, input_len=args.input_len,
                        output_len=args.output_len, short_len=args.short_len, long_len=args.long_len,
                        long_every=args.long_every, prefix_len=args.prefix_len, num_prefixes=args.num_prefixes,
                        priority_levels=args.priority_levels, seed=args.seed)


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    from inflightllm.profile import DEFAULT_PROFILE

    parser.add_argument("--profile", type=Path, default=DEFAULT_PROFILE,
                        help="the server to start (and whose tokenizer builds the prompts)")
    parser.add_argument("--set", action="append", metavar="KEY=VALUE", default=[],
                        help="profile override, e.g. engine.batching_strategy=static (repeatable)")
    parser.add_argument("--max-seconds", type=float, default=300.0, help="time limit of one load point")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured requests before the first point")
    parser.add_argument("--slo-ttft-ms", type=float, default=None)
    parser.add_argument("--slo-tpot-ms", type=float, default=None)
    parser.add_argument("--slo-e2e-ms", type=float, default=None)
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument("--no-progress", action="store_true")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_arguments(parser)
    add_run_arguments(parser)
    parser.add_argument("--concurrency", default=None, help="closed-loop points, e.g. 1,4,8")
    parser.add_argument("--rate", default=None, help="open-loop Poisson points in requests/s, e.g. 0.5,1,inf")
    parser.add_argument("--url", default=None, help="an already running server's gRPC address (HOST:PORT)")
    parser.add_argument("--metrics-url", default=None, help="with --url: its metrics endpoint")
    parser.add_argument("--model", default="ensemble")
    parser.add_argument("--name", default=None, help="the series' name in tables and plots")
    parser.add_argument("--out", type=Path, default=None,
                        help="output path without suffix (default perf/results/loadgen-<workload>-<profile>)")
    from perf import servers

    servers.add_server_arguments(parser)
    args = parser.parse_args(argv)

    from inflightllm.model_source import load_tokenizer
    from inflightllm.profile import load_profile

    meta = run_metadata(command_line("perf.loadgen", argv))  # at the start: the commit that ran
    loads = parse_loads(args.concurrency, args.rate)
    spec = workload_from_args(args)
    slo = SLO(args.slo_ttft_ms, args.slo_tpot_ms, args.slo_e2e_ms)
    overrides = servers.parse_overrides(args.set)
    profile = load_profile(args.profile)
    tokenizer = load_tokenizer(profile.model)
    name = args.name or (profile.name + ("" if not overrides else " " + ",".join(f"{k}={v}" for k, v in overrides.items())))
    common = dict(spec=spec, loads=loads, tokenizer=tokenizer, max_seconds=args.max_seconds, slo=slo,
                  warmup=args.warmup, model=args.model, progress=not args.no_progress)
    if args.url:
        series = run_series(name, args.url, args.metrics_url, server={"url": args.url}, **common)
    else:
        with servers.serve_profile(args.profile, overrides, suffix="loadgen",
                                   options=servers.server_options(args)) as served:
            series = run_series(name, served.server.grpc_url, served.server.metrics_url,
                                server=served.describe(), **common)
    result = {"title": f"Load generator: {spec.name} workload", "meta": meta,
              "workload": dataclasses.asdict(spec), "workload_text": spec.describe(), "slo": slo.describe(),
              "series": [series]}
    out = args.out or RESULTS_DIR / f"loadgen-{spec.name}-{profile.name}"
    for path in write_result(result, out, plots=not args.no_plots):
        print(f"wrote {path}")
    print(markdown_table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
