"""Summarise engine step traces (INFLIGHTLLM_STEP_TRACE, inflightllm/step_trace.py).

For each trace file (one engine): the steps, the wall time from the first step's start to
the last step's end, the time inside steps and between them (the loop's own work: admitting
requests, handing outputs to the sender, metrics), when the requests arrived (the step by
which half and all of them were added), the host parts of the steps, and the slowest gaps.
A trace holds every step of the engine's life (warm-up included), split into busy stretches
where the engine was idle at least `--idle-ms` between two steps (a warm-up, then the measured
run); `--last-busy` keeps only the last stretch.

With a response sender's trace beside it (`sender-<pid>-*.tsv`, same process): its rounds
during the stretch and after its last step (the tail a streaming client waits through), the
time spent sending and waiting for postprocessing, microseconds a response, and how far the
last round ended after the last step; `--rounds` lists every round.

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


def sender_summary(rounds: list[dict[str, float]], start_s: float, end_s: float) -> dict[str, float]:
    """The sender's rounds begun within [start_s, ...): those before `end_s` (the last step's
    end) and those after it, on the steps' clock (seconds)."""
    chosen = [r for r in rounds if r["clock_s"] >= start_s]
    figures: dict[str, float] = {}
    for name, part in (("during", [r for r in chosen if r["clock_s"] < end_s]),
                       ("after", [r for r in chosen if r["clock_s"] >= end_s])):
        responses = sum(r["responses"] for r in part)
        send_ms = sum(r["send_ms"] for r in part)
        figures.update({f"{name}_rounds": len(part), f"{name}_responses": responses,
                        f"{name}_send_ms": send_ms, f"{name}_wait_ms": sum(r["wait_ms"] for r in part),
                        f"{name}_us_per_response": send_ms * 1e3 / responses if responses else 0.0})
    if chosen:
        last = chosen[-1]
        figures["last_round_end_after_last_step_ms"] = (last["clock_s"] - end_s) * 1e3 + last["wait_ms"] + last["send_ms"]
        figures["answered_at_end"] = last["answered_after"]
    return figures


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="+", type=Path, help="trace files or folders of them")
    parser.add_argument("--idle-ms", type=float, default=200.0, help="a gap this long ends a busy stretch")
    parser.add_argument("--last-busy", action="store_true", help="only the last busy stretch of each trace")
    parser.add_argument("--gaps", type=int, default=5, help="the slowest gaps between steps to list")
    parser.add_argument("--rounds", action="store_true", help="list every round of the response sender")
    args = parser.parse_args(argv)
    files = [p for path in args.paths for p in (sorted(path.glob("steps-*.tsv")) if path.is_dir() else [path])]
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
            if "clock_s" not in stretch[0]:
                continue
            start_s = stretch[0]["clock_s"]
            end_s = stretch[-1]["clock_s"] + stretch[-1]["dur_ms"] / 1e3
            pid = path.name.split("-")[1] if path.name.startswith("steps-") else None
            for sender_path in sorted(path.parent.glob(f"sender-{pid}-*.tsv")) if pid else []:
                rounds = load(sender_path)
                figures = sender_summary(rounds, start_s, end_s)
                print(f"  {sender_path.name}: " + ", ".join(f"{key} {value:,.1f}" for key, value in figures.items()))
                if args.rounds:
                    print("  rounds (ms from the first step, wait ms, in flight, answered, responses, finals, send ms):")
                    for r in (r for r in rounds if r["clock_s"] >= start_s):
                        print(f"    {(r['clock_s'] - start_s) * 1e3:8.1f} {r['wait_ms']:7.1f} {r['in_flight']:5.0f} "
                              f"{r['answered']:7.0f} {r['responses']:5.0f} {r['finals']:5.0f} {r['send_ms']:7.1f}")


if __name__ == "__main__":
    main()
