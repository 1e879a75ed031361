"""The step description the engine sends its runner: each request whole once, then only
deltas; preempted and finished ids once; and it survives pickling (a runner may live in
another process). Checked on a real Engine over a tiny random Llama-3 shape."""

from __future__ import annotations

import pickle

from inflightllm.config import EngineConfig
from inflightllm.engine import Engine
from inflightllm.model_source import ModelSpec
from inflightllm.sampling_params import SamplingParams
from inflightllm.step import NewRequestData, SampledTokens, StepDescription

SPEC = ModelSpec(source="random", shape="tiny-llama3", seed=0, dtype="float32")


class RecordingRunner:
    """Wraps the engine's real runner and keeps every step description it was given."""

    def __init__(self, runner):
        self.runner = runner
        self.steps: list[StepDescription] = []

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def execute(self, step: StepDescription) -> SampledTokens:
        self.steps.append(pickle.loads(pickle.dumps(step)))  # serializable, and a private copy
        return self.runner.execute(pickle.loads(pickle.dumps(step)))


def recording_engine(**overrides) -> tuple[Engine, RecordingRunner]:
    values = dict(max_num_tokens=64, max_batch_size=8, num_kv_blocks=64, block_size=16)
    values.update(overrides)
    engine = Engine(SPEC, EngineConfig(**values), sampler_seed=0)
    recorder = RecordingRunner(engine.runner)
    engine.runner = recorder
    return engine, recorder


def test_new_request_sent_whole_once_then_deltas():
    engine, recorder = recording_engine()
    prompt = list(range(100, 140))  # 40 tokens: 3 blocks of 16
    engine.add_request("a", prompt, SamplingParams(max_tokens=30, ignore_eos=True))
    engine.step()
    first = recorder.steps[0]
    assert first.new_requests == [
        NewRequestData(
            request_id="a", prompt_token_ids=prompt, output_token_ids=[], block_ids=[0, 1, 2],
            num_computed_tokens=0, params=SamplingParams(max_tokens=30, ignore_eos=True), eos_token_ids=(2,),
        )
    ]
    assert first.scheduled == [("a", 40)] and first.cached_requests == []
    for _ in range(9):  # tokens 41..49 decode; the 49th token needs a 4th block
        engine.step()
    deltas = [step.cached_requests[0] for step in recorder.steps[1:]]
    assert all(not step.new_requests for step in recorder.steps[1:])
    assert [d.num_computed_tokens for d in deltas] == list(range(40, 49))
    assert [d.new_block_ids for d in deltas] == [[]] * 8 + [[3]]


def test_finished_and_preempted_ids_are_sent_once():
    engine, recorder = recording_engine(num_kv_blocks=6, max_batch_size=4)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    engine.add_request("a", list(range(100, 132)), params)  # 2 blocks, grows to 5
    engine.add_request("b", list(range(200, 232)), params)
    while engine.has_unfinished():
        engine.step()
    preempted = [rid for step in recorder.steps for rid in step.preempted_request_ids]
    finished = [rid for step in recorder.steps for rid in step.finished_request_ids]
    assert preempted, "6 blocks cannot hold both requests to the end"
    assert finished == ["a"]  # b, preempted and resumed, finishes last: no step follows it
    for rid in preempted:
        resumed = [
            new for step in recorder.steps for new in step.new_requests if new.request_id == rid
        ]
        assert len(resumed) == 2 and resumed[1].output_token_ids, "resumed whole, with its generated tokens"


def test_aborted_while_waiting_after_preemption_is_forgotten_by_the_runner():
    engine, recorder = recording_engine(num_kv_blocks=6, max_batch_size=4)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    engine.add_request("a", list(range(100, 132)), params)
    engine.add_request("b", list(range(200, 232)), params)
    while not any(step.preempted_request_ids for step in recorder.steps):
        engine.step()
    victim = recorder.steps[-1].preempted_request_ids[0]
    engine.abort(victim)
    engine.step()
    assert victim in recorder.steps[-1].finished_request_ids
    assert victim not in engine.runner.runner.states.requests
