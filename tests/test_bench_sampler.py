"""Smoke test of perf/bench_sampler.py at a tiny CPU size: every setting is timed for our
sampler and for a baseline file (here the same module, loaded from its path), and the
JSON it saves holds the figures it printed. No timing is asserted."""

from __future__ import annotations

import json

from inflightllm.gpu import sampler as gpu_sampler
from perf.bench_sampler import SETTINGS, main


def test_the_sampler_bench_times_every_setting_for_both_implementations(tmp_path, capsys):
    out = tmp_path / "sampler.json"
    report = main(["--device", "cpu", "--rows", "4", "--vocab", "300", "--steps", "1", "--warmup", "1",
                   "--baseline", gpu_sampler.__file__, "--out", str(out)])
    assert json.loads(out.read_text()) == report
    assert list(report["settings"]) == list(SETTINGS)
    for figures in report["settings"].values():
        assert set(figures) == {"new", "baseline"}
        assert all(figure["device_ms"] > 0 and figure["host_ms"] > 0 for figure in figures.values())
    assert report["settings"]["greedy"]["new"]["over_greedy"] == 1.0
    printed = capsys.readouterr().out
    assert all(name in printed for name in SETTINGS)
