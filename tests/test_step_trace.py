"""The step trace (INFLIGHTLLM_STEP_TRACE): one line a step of the real CPU engine, with the
tokens each step ran and the requests added before it."""

from __future__ import annotations

import csv

from inflightllm.sampling_params import SamplingParams
from inflightllm.step_trace import FIELDS
from tests.test_engine import FOX, ROSES, make_engine, run


def test_each_step_writes_a_line_with_its_tokens_and_arrivals(smollm2_loaded, tmp_path, monkeypatch):
    monkeypatch.setenv("INFLIGHTLLM_STEP_TRACE", str(tmp_path / "trace"))
    engine = make_engine(smollm2_loaded)
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    engine.add_request("a", FOX, params)
    engine.add_request("b", ROSES, params)
    outputs = run(engine)
    assert sorted(outputs) == ["a", "b"]
    engine.add_request("c", FOX, SamplingParams(max_tokens=2, ignore_eos=True))
    run(engine)
    engine._trace.close()

    (path,) = (tmp_path / "trace").glob("steps-*.tsv")
    with path.open(encoding="utf-8") as file:
        rows = list(csv.DictReader(file, delimiter="\t"))
    assert tuple(rows[0]) == FIELDS
    assert [int(r["added"]) for r in rows if int(r["added"])] == [2, 1]
    assert int(rows[0]["tokens"]) == len(FOX) + len(ROSES)  # both prompts in the first step
    # the prompts, then a decode a row for each token after the first: a and b 2 more, c 1 more
    assert sum(int(r["tokens"]) for r in rows) == len(FOX) + len(ROSES) + 2 * 2 + len(FOX) + 1
    starts = [float(r["start_ms"]) for r in rows]
    assert starts == sorted(starts) and starts[0] == 0.0
    assert all(float(r["dur_ms"]) > 0 for r in rows)


def test_no_trace_without_the_variable(smollm2_loaded, monkeypatch):
    monkeypatch.delenv("INFLIGHTLLM_STEP_TRACE", raising=False)
    assert make_engine(smollm2_loaded)._trace is None
