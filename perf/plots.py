"""PNG plots of a load-generator result (matplotlib, Agg backend, small files).

- `<out>-latency.png`: TTFT, TPOT and e2e latency against output tokens/s, one line per
  series, each point labelled with its load (concurrency or rate);
- `<out>-distributions.png`: CDFs of TTFT and of inter-token latency per (series, point);
- `<out>-kv-cache.png`: KV-cache usage and running/waiting requests over time, read from
  the server's metrics endpoint while each point ran;
- `bar_chart`: side-by-side bars for the experiments (perf/experiments.py).

matplotlib is optional (the GPU host may not have it): without it `available()` is False
and the writers of results skip their plots with `MISSING`. Later, on a machine that has
it, `python -m perf.plots --from-json FILE.json ... [--out-dir DIR]` renders the PNGs and
rewrites the markdown of any saved result (load generator, experiment, perf_analyzer
sweep, perf/bench_gpu_server.py).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
except ImportError:  # plots are skipped; see MISSING
    plt = None

DPI = 80
MISSING = ("matplotlib is missing here: plots skipped. Render them later from the saved JSON with "
           "`python -m perf.plots --from-json FILE.json ...`")


def available() -> bool:
    """Whether matplotlib can be used here."""
    return plt is not None


def _require() -> None:
    if plt is None:
        raise RuntimeError(MISSING)


def _load_text(load: dict) -> str:
    if load["mode"] == "concurrency":
        return f"c{int(load['value'])}"
    return "r∞" if load["value"] == float("inf") else f"r{load['value']:g}"


def _save(fig, path: Path) -> Path:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def _lines_by_mode(result: dict):
    """(series name, mode, points) for each series and load mode that has points: closed- and
    open-loop points are separate lines."""
    for series in result["series"]:
        for mode in ("concurrency", "rate"):
            points = [p for p in series["points"] if p["load"]["mode"] == mode]
            if points:
                yield series["name"], mode, points


def plot_latency(result: dict, path: Path) -> Path:
    panels = [("ttft_ms", "TTFT (ms)"), ("tpot_ms", "TPOT (ms)"), ("e2e_ms", "e2e latency (ms)")]
    fig, axes = plt.subplots(1, len(panels), figsize=(11, 3.6))
    for ax, (key, title) in zip(axes, panels):
        for name, mode, all_points in _lines_by_mode(result):
            points = [p for p in all_points if p["summary"][key]["p50"] is not None]
            x = [p["summary"]["output_tokens_per_s"] for p in points]
            for pct, style in (("p50", "-o"), ("p99", "--x")):
                ax.plot(x, [p["summary"][key][pct] for p in points], style, label=f"{name}, {mode} {pct}")
            for p, xv in zip(points, x):
                ax.annotate(_load_text(p["load"]), (xv, p["summary"][key]["p50"]), fontsize=7,
                            textcoords="offset points", xytext=(3, 3))
        ax.set_xlabel("output tokens/s")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=6)
    return _save(fig, path)


def _cdf(ax, values: list[float], label: str) -> None:
    if not values:
        return
    ordered = sorted(values)
    ax.plot(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))], label=label)


def plot_distributions(result: dict, path: Path) -> Path:
    fig, (ax_ttft, ax_itl) = plt.subplots(1, 2, figsize=(10, 3.6))
    for series in result["series"]:
        for point in series["points"]:
            done = [r for r in point["requests"] if r["completed"]]
            label = f"{series['name']} {_load_text(point['load'])}"
            _cdf(ax_ttft, [r["ttft_ms"] for r in done if r["ttft_ms"] is not None], label)
            gaps = [b - a for r in done for a, b in zip(r["token_times_ms"], r["token_times_ms"][1:])]
            _cdf(ax_itl, gaps, label)
    for ax, title in ((ax_ttft, "TTFT (ms)"), (ax_itl, "inter-token latency (ms)")):
        ax.set_xlabel(title)
        ax.set_ylabel("fraction of requests" if ax is ax_ttft else "fraction of gaps")
        ax.set_xscale("log")
        ax.grid(alpha=0.3)
    ax_ttft.legend(fontsize=7)
    return _save(fig, path)


def plot_kv_cache(result: dict, path: Path) -> Path:
    fig, (ax_kv, ax_req) = plt.subplots(1, 2, figsize=(10, 3.6))
    for series in result["series"]:
        for point in series["points"]:
            samples = [s for s in point["kv_samples"] if s.get("kv_cache_usage") is not None]
            if not samples:
                continue
            label = f"{series['name']} {_load_text(point['load'])}"
            t = [s["t"] for s in samples]
            ax_kv.plot(t, [s["kv_cache_usage"] * 100 for s in samples], label=label)
            line, = ax_req.plot(t, [s["running"] for s in samples], label=f"{label} running")
            ax_req.plot(t, [s["waiting"] for s in samples], ":", color=line.get_color(), label=f"{label} waiting")
    ax_kv.set_ylabel("KV-cache blocks used (%)")
    ax_req.set_ylabel("requests in the engine")
    for ax in (ax_kv, ax_req):
        ax.set_xlabel("seconds since the point started")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6)
    return _save(fig, path)


def plot_all(result: dict, out: Path) -> list[Path]:
    _require()
    out = Path(out)
    return [
        plot_latency(result, out.with_name(out.name + "-latency.png")),
        plot_distributions(result, out.with_name(out.name + "-distributions.png")),
        plot_kv_cache(result, out.with_name(out.name + "-kv-cache.png")),
    ]


def _number(value) -> str:
    if value is None:
        return "—"
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"


def bar_chart(groups: list[str], panels: list[tuple[str, dict[str, list[float]]]], path: Path) -> Path:
    """`panels`: (title, {variant: [value per group]}); one subplot per panel, bars side by side."""
    _require()
    fig, axes = plt.subplots(1, len(panels), figsize=(3.6 * len(panels), 3.4))
    axes = axes if len(panels) > 1 else [axes]
    for ax, (title, variants) in zip(axes, panels):
        width = 0.8 / max(len(variants), 1)
        for i, (variant, values) in enumerate(variants.items()):
            xs = [g + i * width for g in range(len(groups))]
            bars = ax.bar(xs, [v or 0 for v in values], width, label=variant)
            ax.bar_label(bars, labels=[_number(v) for v in values], fontsize=7)
        ax.set_xticks([g + width * (len(variants) - 1) / 2 for g in range(len(groups))], groups, fontsize=8)
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3, axis="y")
    axes[0].legend(fontsize=7)
    return _save(fig, path)


def render_from_json(path: Path, out_dir: Path | None = None) -> list[Path]:
    """Markdown and PNGs of a saved result, written beside it or into `out_dir` (for a
    read-only folder of fetched results). Recognises a load generator / experiment result
    (`series`), a perf_analyzer sweep (`rows`) and a perf/bench_gpu_server.py report (`phases`)."""
    path = Path(path)
    result = json.loads(path.read_text())
    out = (Path(out_dir) / path.stem) if out_dir else path.with_suffix("")
    out.parent.mkdir(parents=True, exist_ok=True)
    if "series" in result:
        from perf import loadgen

        written = loadgen.write_result(result, out, plots=True)
        for groups, panels in result.get("charts", []):
            written.append(bar_chart(groups, panels, out.with_name(out.name + "-bars.png")))
        return written
    if "rows" in result and "input_data" in result:
        from perf import perf_analyzer_sweep

        md = out.with_suffix(".md")
        md.write_text(perf_analyzer_sweep.sweep_markdown(result))
        if out.with_suffix(".json") != path:
            out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
        return [md, perf_analyzer_sweep.plot(result["rows"], out.with_suffix(".png"))]
    if "phases" in result:
        from perf import bench_gpu_server

        return bench_gpu_server.write_report(result, out.parent, out.name, plots=True)
    raise SystemExit(f"{path}: not a result this module knows (no 'series', 'rows' or 'phases')")


def main(argv: list[str] | None = None) -> int:
    """Redraw a saved result's plots: python -m perf.plots perf/results/NAME.json, or
    python -m perf.plots --from-json A.json B.json [--out-dir DIR] for any saved result."""
    import argparse

    parser = argparse.ArgumentParser(description="Redraw plots (and markdown) from saved JSON results.")
    parser.add_argument("result", type=Path, nargs="?", help="a load generator result: its plots only")
    parser.add_argument("--from-json", type=Path, nargs="+", default=[], metavar="FILE",
                        help="any saved result (load generator, experiment, perf_analyzer sweep, bench_gpu_server): "
                             "markdown and PNGs")
    parser.add_argument("--out-dir", type=Path, default=None, help="with --from-json: write there, not beside the JSON")
    args = parser.parse_args(argv)
    if not available():
        print(MISSING, file=sys.stderr)
        return 2
    if args.result is None and not args.from_json:
        parser.error("give a result file or --from-json FILE ...")
    written = []
    if args.result is not None:
        written += plot_all(json.loads(args.result.read_text()), args.result.with_suffix(""))
    for path in args.from_json:
        written += render_from_json(path, args.out_dir)
    for path in written:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
