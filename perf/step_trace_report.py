"""Summarise engine step traces (INFLIGHTLLM_STEP_TRACE, inflightllm/step_trace.py).

For each trace file (one engine): the steps, the wall time from the first step's start to
the last step's end, the time inside steps and between them (the loop's own work: admitting
requests, handing outputs to the sender, metrics), when the requests arrived (the step by
which half and all of them were added), the host parts of the steps, and the slowest gaps.
A trace holds every step of the engine's life (warm-up included), split into busy stretches
where the engine was idle at least `--idle-ms` between two steps (a warm-up, then the measured
run); `--last-busy` keeps only the last stretch.

    python -m perf.step_trace_report OUT/engine/trace OUT/base/trace --last-busy
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path


def load(path: Path) -> list[dict[str, float]]:
    with path.open(encoding="utf-8") as file:
        return [{key: float(value) for key, value in row.items()} for row in csv.DictReader(file, delimiter="\t")]


def busy_stretches(rows: list[dict[str, float]], idle_ms: float) -> list[list[dict[str, float]]]:
    """The rows split where a gap between steps is at least `idle_ms`."""
    stretches: list[list[dict[str, float]]] = []
    for row in rows:
        if not stretches or row["gap_ms"] >= idle_ms:
            stretches.append([])
        stretches[-1].append(row)
    return stretches


def summarise(rows: list[dict[str, float]]) -> dict[str, float]:
    start = rows[0]["start_ms"]
    end = rows[-1]["start_ms"] + rows[-1]["dur_ms"]
    added = sum(r["added"] for r in rows)
    running = 0.0
    half_at = all_at = None
    for row in rows:
        running += row["added"]
        if half_at is None and added and running >= added / 2:
            half_at = row["start_ms"] - start
        if all_at is None and added and running >= added:
            all_at = row["start_ms"] - start
    inside = sum(r["dur_ms"] for r in rows)
    return {
        "steps": len(rows), "wall_ms": end - start, "in_steps_ms": inside, "between_ms": (end - start) - inside,
        "added": added, "half_added_at_ms": half_at or 0.0, "all_added_at_ms": all_at or 0.0,
        "tokens": sum(r["tokens"] for r in rows), "outputs": sum(r["outputs"] for r in rows),
        **{f"{part}_ms": sum(r[f"{part}_ms"] for r in rows) for part in ("schedule", "launch", "wait", "emit")},
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="+", type=Path, help="trace files or folders of them")
    parser.add_argument("--idle-ms", type=float, default=200.0, help="a gap this long ends a busy stretch")
    parser.add_argument("--last-busy", action="store_true", help="only the last busy stretch of each trace")
    parser.add_argument("--gaps", type=int, default=5, help="the slowest gaps between steps to list")
    args = parser.parse_args(argv)
    files = [p for path in args.paths for p in (sorted(path.glob("*.tsv")) if path.is_dir() else [path])]
    for path in files:
        rows = load(path)
        if not rows:
            print(f"{path}: empty")
            continue
        stretches = busy_stretches(rows, args.idle_ms)
        chosen = [stretches[-1]] if args.last_busy else stretches
        for index, stretch in enumerate(chosen):
            figures = summarise(stretch)
            print(f"{path} stretch {index if not args.last_busy else len(stretches) - 1}: " + ", ".join(
                f"{key} {value:,.1f}" if isinstance(value, float) and not value.is_integer() else f"{key} {value:,.0f}"
                for key, value in figures.items()))
            slow = sorted(stretch, key=lambda r: -r["gap_ms"])[: args.gaps]
            print("  slowest gaps (ms at, gap ms, tokens of the next step, added, outputs): " + "; ".join(
                f"{r['start_ms'] - stretch[0]['start_ms']:.0f}: {r['gap_ms']:.1f} ({r['tokens']:.0f}, "
                f"{r['added']:.0f}, {r['outputs']:.0f})" for r in slow))


if __name__ == "__main__":
    main()
