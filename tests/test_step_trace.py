"""The step trace (INFLIGHTLLM_STEP_TRACE): one line a step of the real CPU engine, with the
tokens each step ran and the requests added before it."""

from __future__ import annotations

import csv

from inflightllm.sampling_params import SamplingParams
from inflightllm.serving.engine_loop import EngineLoop
from inflightllm.step_trace import FIELDS, SENDER_FIELDS
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


def test_the_response_sender_writes_a_line_a_round_on_the_steps_clock(smollm2_loaded, tmp_path, monkeypatch, capsys):
    """Under the engine loop the sender's rounds go to sender-*.tsv: every response and every
    final counted once, each round begun on the same clock as the steps, after the first one."""
    from tests.test_engine_loop import RecordingSink, engine_request

    monkeypatch.setenv("INFLIGHTLLM_STEP_TRACE", str(tmp_path / "trace"))
    loop = EngineLoop(make_engine(smollm2_loaded), idle_wait_s=0.05).start()
    sinks = [RecordingSink(), RecordingSink()]
    try:
        loop.submit(engine_request(FOX, 4), sinks[0])
        loop.submit(engine_request(ROSES, 3), sinks[1])
        for sink in sinks:
            sink.wait()
    finally:
        loop.stop()

    def rows(pattern):
        (path,) = (tmp_path / "trace").glob(pattern)
        with path.open(encoding="utf-8") as file:
            reader = csv.DictReader(file, delimiter="\t")
            return reader.fieldnames, list(reader)

    fields, rounds = rows("sender-*.tsv")
    assert tuple(fields) == SENDER_FIELDS
    assert sum(int(r["responses"]) for r in rounds) == sum(len(sink.responses) for sink in sinks) >= 2
    assert sum(int(r["outputs"]) for r in rounds) == 4 + 3  # one output a token; coalesced ones counted apiece
    assert sum(int(r["finals"]) for r in rounds) == 2
    assert all(float(r["send_ms"]) >= 0 and float(r["wait_ms"]) >= 0 for r in rounds)
    _, steps = rows("steps-*.tsv")
    step_clocks = [float(r["clock_s"]) for r in steps]
    assert step_clocks == sorted(step_clocks)
    assert all(float(r["clock_s"]) > step_clocks[0] for r in rounds)

    # the report pairs the sender's rounds with the steps of its process
    from perf.step_trace_report import main as report

    report([str(tmp_path / "trace"), "--rounds"])
    printed = capsys.readouterr().out
    responses = sum(len(sink.responses) for sink in sinks)
    assert "sender-" in printed and "rounds (ms from the first step" in printed
    figures = dict(part.rsplit(" ", 1) for line in printed.splitlines() if "during_rounds" in line
                   for part in line.split(": ", 1)[1].split(", "))
    assert float(figures["during_responses"]) + float(figures["after_responses"]) == responses
