"""`make perf-analyzer`: the documented perf_analyzer streaming sweep against the ensemble.

Starts a server for `--profile` (or uses `--url`), runs `build/bin/perf_analyzer -m ensemble
-i grpc --streaming` over a concurrency range, and keeps perf_analyzer's own CSV (`-f`)
and its profile export. perf_analyzer 2.51 reports the time to the *last* response as its
latency (perf/README.md), so TTFT and inter-token gaps are computed from the export's
per-request `response_timestamps`. Writes, under `--out` (default
`perf/results/perf-analyzer-<profile>`): `.csv` (perf_analyzer's), `-export.json` (its
profile export), `.json` and `.md` (figures per concurrency) and `.png`.

    .venv/bin/python -m perf.perf_analyzer_sweep [--profile P] [--concurrency-range 1:16:5]
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from perf import loadgen  # noqa: E402

WRAPPER = REPO_ROOT / "build" / "bin" / "perf_analyzer"
DEFAULT_RANGE = {"cpu": "1:16:5", "gpu": "8:128:40"}


def perf_analyzer_command(grpc_url: str, input_data: Path, concurrency_range: str, request_count: int,
                          csv_path: Path, export_path: Path, perf_analyzer: Path = WRAPPER) -> list[str]:
    return [
        str(perf_analyzer), "-m", "ensemble", "-i", "grpc", "--streaming", "-u", grpc_url,
        "--input-data", str(input_data), "--concurrency-range", concurrency_range,
        # Windows close after N finished requests, not after a time (a slow machine cannot
        # leave a window empty); three windows per point, all accepted as stable.
        "--measurement-mode", "count_windows", "--measurement-request-count", str(request_count),
        "--max-trials", "3", "--stability-percentage", "1000",
        "-f", str(csv_path), "--profile-export-file", str(export_path),
    ]


def export_figures(export: dict) -> list[dict]:
    """Per concurrency: TTFT and inter-token gaps (ms) from the profile export."""
    rows = []
    for experiment in export.get("experiments", []):
        ttfts, gaps, last = [], [], []
        for request in experiment.get("requests", []):
            times = request.get("response_timestamps") or []
            if not times:
                continue
            ttfts.append((times[0] - request["timestamp"]) / 1e6)
            last.append((times[-1] - request["timestamp"]) / 1e6)
            gaps.extend((b - a) / 1e6 for a, b in zip(times, times[1:]))

        def pct(values, p):
            return round(float(np.percentile(values, p)), 1) if values else None

        rows.append({"concurrency": experiment["experiment"]["value"], "requests": len(ttfts),
                     "ttft_p50_ms": pct(ttfts, 50), "ttft_p99_ms": pct(ttfts, 99),
                     "inter_response_p50_ms": pct(gaps, 50), "inter_response_p99_ms": pct(gaps, 99),
                     "last_response_p50_ms": pct(last, 50), "last_response_p99_ms": pct(last, 99)})
    return rows


def read_csv(path: Path) -> list[dict]:
    with open(path, newline="") as handle:
        return [row for row in csv.DictReader(handle) if row.get("Concurrency", "").strip().isdigit()]


def plot(rows: list[dict], path: Path) -> Path:
    from perf.plots import _require, _save, plt

    _require()

    fig, (ax_tp, ax_lat) = plt.subplots(1, 2, figsize=(10, 3.6))
    c = [r["concurrency"] for r in rows]
    ax_tp.plot(c, [r["requests_per_s"] for r in rows], "-o", label="requests/s")
    ax_tp2 = ax_tp.twinx()
    ax_tp2.plot(c, [r["responses_per_s"] for r in rows], "-s", color="tab:orange", label="responses/s (≈ tokens/s)")
    ax_tp.set_ylabel("requests/s")
    ax_tp2.set_ylabel("responses/s")
    ax_tp.set_xlabel("concurrency")
    ax_tp.legend(loc="upper left", fontsize=7)
    ax_tp2.legend(loc="lower right", fontsize=7)
    for key, label in (("ttft_p50_ms", "TTFT p50"), ("inter_response_p50_ms", "inter-response p50"),
                       ("last_response_p50_ms", "last response p50")):
        ax_lat.plot(c, [r[key] for r in rows], "-o", label=label)
    ax_lat.set_yscale("log")
    ax_lat.set_xlabel("concurrency")
    ax_lat.set_ylabel("ms")
    ax_lat.legend(fontsize=7)
    for ax in (ax_tp, ax_lat):
        ax.grid(alpha=0.3)
    return _save(fig, path)


def _display(path: Path) -> str:
    path = Path(path).resolve()
    return path.relative_to(REPO_ROOT).as_posix() if path.is_relative_to(REPO_ROOT) else path.as_posix()


def sweep_markdown(record: dict) -> str:
    """The `.md` of a sweep's JSON record (meta, rows)."""
    meta, rows = record["meta"], record["rows"]
    lines = [f"# perf_analyzer sweep ({record['profile_name']})", "",
             f"{meta['date_utc']} UTC, commit `{meta['commit']}`, {meta['machine']}"
             f"{', ' + meta['gpu'] if meta.get('gpu') else ''}, load average "
             f"{meta.get('load_average_1m_at_start')} at the start", "",
             f"Command: `{meta['command']}`; input data `{record['input_data']}`.", "",
             "| concurrency | requests/s | responses/s | TTFT p50 / p99 ms | inter-response p50 / p99 ms | "
             "last response p50 / p99 ms |", "|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['concurrency']} | {r['requests_per_s']:.2f} | {r['responses_per_s']:.1f} | "
                     f"{r.get('ttft_p50_ms')} / {r.get('ttft_p99_ms')} | {r.get('inter_response_p50_ms')} / "
                     f"{r.get('inter_response_p99_ms')} | {r.get('last_response_p50_ms')} / {r.get('last_response_p99_ms')} |")
    return "\n".join(lines) + "\n"


def report(out: Path, plots: bool = True) -> list[Path]:
    """From the kept CSV and export (and the run's `out`.json): per-concurrency rows into
    `out`.json, a table `out`.md and (with plots, when matplotlib is there) a plot `out`.png."""
    from perf import plots as plotting

    csv_path, export_path, json_path = out.with_suffix(".csv"), out.with_name(out.name + "-export.json"), out.with_suffix(".json")
    record = json.loads(json_path.read_text())
    figures = {row["concurrency"]: row for row in export_figures(json.loads(export_path.read_text()))}
    rows = []
    for row in sorted(read_csv(csv_path), key=lambda row: int(row["Concurrency"])):
        c = int(row["Concurrency"])
        rows.append({"concurrency": c, "requests_per_s": float(row["Inferences/Second"]),
                     "responses_per_s": float(row.get("Response Throughput") or "nan"),
                     **{k: v for k, v in figures.get(c, {}).items() if k != "concurrency"}})
    record["rows"] = rows
    json_path.write_text(json.dumps(record, indent=1) + "\n")
    text = sweep_markdown(record)
    out.with_suffix(".md").write_text(text)
    print(text)
    written = [csv_path, export_path, json_path, out.with_suffix(".md")]
    if plots and plotting.available():
        written.append(plot(rows, out.with_suffix(".png")))
    elif plots:
        print(plotting.MISSING, file=sys.stderr)
    return written


def main(argv: list[str] | None = None) -> int:
    from inflightllm.profile import DEFAULT_PROFILE, load_profile
    from perf import servers

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", type=Path, default=DEFAULT_PROFILE)
    parser.add_argument("--url", default=None, help="an already running server's gRPC address")
    parser.add_argument("--input-data", type=Path, default=REPO_ROOT / "perf" / "inputs" / "chat_stream.json")
    parser.add_argument("--concurrency-range", default=None, help="start:end:step (default by device)")
    parser.add_argument("--request-count", type=int, default=8, help="finished requests per measurement window")
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--report-only", action="store_true",
                        help="redo the table and plot from the kept CSV and export of --out")
    parser.add_argument("--perf-analyzer", type=Path, default=None,
                        help="the perf_analyzer to run (default build/bin/perf_analyzer, or the bundle's)")
    parser.add_argument("--no-plots", action="store_true", help="write CSV, JSON and markdown only")
    servers.add_server_arguments(parser)
    args = parser.parse_args(argv)
    options = servers.server_options(args)
    if args.report_only:
        report(args.out or loadgen.RESULTS_DIR / f"perf-analyzer-{load_profile(args.profile).name}",
               plots=not args.no_plots)
        return 0
    perf_analyzer = args.perf_analyzer or options.perf_analyzer
    if not perf_analyzer.exists():
        print(f"{perf_analyzer} is missing: run `make install` (or install the bundle's part 1)", file=sys.stderr)
        return 2
    meta = loadgen.run_metadata(loadgen.command_line("perf.perf_analyzer_sweep", argv))  # the commit that ran
    profile = load_profile(args.profile)
    concurrency_range = args.concurrency_range or DEFAULT_RANGE[profile.engine.device]
    out = args.out or loadgen.RESULTS_DIR / f"perf-analyzer-{profile.name}"
    out.parent.mkdir(parents=True, exist_ok=True)
    csv_path, export_path = out.with_suffix(".csv"), out.with_name(out.name + "-export.json")

    def run(url: str) -> subprocess.CompletedProcess:
        command = perf_analyzer_command(url, args.input_data, concurrency_range, args.request_count,
                                        csv_path, export_path, perf_analyzer)
        print(" ".join(command), flush=True)
        return subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)

    if args.url:
        result, server = run(args.url), {"url": args.url}
    else:
        with servers.serve_profile(args.profile, options=options) as served:
            result, server = run(served.server.grpc_url), served.describe()
    print(result.stdout[-4000:])
    if result.returncode != 0:
        print(result.stderr[-4000:], file=sys.stderr)
        return result.returncode
    (out.with_suffix(".json")).write_text(json.dumps(
        {"meta": meta, "server": server, "profile_name": profile.name, "input_data": _display(args.input_data)},
        indent=1) + "\n")
    for path in report(out, plots=not args.no_plots):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
