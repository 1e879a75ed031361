"""EngineLoop with the real SmolLM2 engine and a recording sink: response order and the
final flag, errors for invalid requests, client cancellation, stop(), and recovery from
an exception inside a step."""

from __future__ import annotations

import threading

import pytest
import torch

from inflightllm.config import EngineConfig
from inflightllm.engine import Engine
from inflightllm.model_source import DEFAULT_MODEL
from inflightllm.sampling_params import InvalidRequestError
from inflightllm.serving.engine_io import EngineRequest, parse_engine_request
from inflightllm.serving.engine_loop import EngineLoop

pytestmark = pytest.mark.slow

FOX = [504, 2365, 6354, 16438]  # "The quick brown fox"
FOX_GREEDY = [351, 253, 2365, 6354, 7012, 30]  # " with a quick brown bear."
WAIT_S = 120.0


class RecordingSink:
    """Records what the loop sends; `cancel_after` responses later it reports cancelled."""

    def __init__(self, cancel_after: int | None = None, cancel_raises: bool = False):
        self.events: list[tuple] = []  # ("response", tensors, final) or ("error", message)
        self.done = threading.Event()  # set by a final response or an error
        self.first = threading.Event()
        self.cancel_after = cancel_after
        self.cancel_raises = cancel_raises

    @property
    def responses(self) -> list[tuple[dict[str, torch.Tensor], bool]]:
        return [(event[1], event[2]) for event in self.events if event[0] == "response"]

    @property
    def errors(self) -> list[str]:
        return [event[1] for event in self.events if event[0] == "error"]

    def send(self, tensors, final):
        self.events.append(("response", tensors, final))
        self.first.set()
        if final:
            self.done.set()

    def send_error(self, message):
        self.events.append(("error", message))
        self.done.set()

    def is_cancelled(self):
        if self.cancel_after is None or len(self.responses) < self.cancel_after:
            return False
        if self.cancel_raises:
            raise ConnectionError("client went away")
        return True

    def wait(self) -> None:
        """Wait for the final response or the error; check it is the one and last event."""
        assert self.done.wait(WAIT_S), f"no final response; got {self.events}"
        self.check_terminated_once()

    def check_terminated_once(self) -> None:
        terminal = [event[0] == "error" or event[2] for event in self.events]
        assert terminal and terminal[-1] and terminal.count(True) == 1, self.events


def engine_request(prompt: list[int], max_tokens: int, streaming: bool = True, **overrides) -> EngineRequest:
    """The engine model's input tensors for one request, parsed as Triton's execute does."""
    inputs = {
        "input_ids": torch.tensor([prompt], dtype=torch.int32).reshape(1, len(prompt)),
        "input_length": [len(prompt)],
        "max_tokens": [max_tokens],
        "min_tokens": [0],
        "streaming": [streaming],
        "temperature": [0.0],
        "top_p": [1.0],
        "min_p": [0.0],
        "repetition_penalty": [1.0],
        "presence_penalty": [0.0],
        "frequency_penalty": [0.0],
        "top_k": [0],
        "seed": [-1],
        "end_id": [-1],
        "ignore_eos": [False],
        "stop_words": torch.zeros((1, 0), dtype=torch.int32),
        "bad_words": torch.zeros((1, 0), dtype=torch.int32),
        "return_log_probs": [False],
        "num_top_logprobs": [0],
        "priority": [0],
        "exclude_input_in_output": [True],
        "timeout_ms": [0],
        "n": [1],
        "best_of": [0],
        "beam_width": [1],
        "length_penalty": [1.0],
        "early_stopping": [0],
    }
    for name, value in overrides.items():
        inputs[name] = [value]
    tensors = {name: value if isinstance(value, torch.Tensor) else torch.tensor([value]) for name, value in
               inputs.items()}
    return parse_engine_request(tensors)


def ids(tensors) -> list[int]:
    return tensors["output_ids"].reshape(-1).tolist()


def scalar(tensors, name: str):
    return tensors[name].reshape(-1)[0].item()


@pytest.fixture
def engine(smollm2_loaded) -> Engine:
    return Engine(DEFAULT_MODEL, EngineConfig(num_kv_blocks=64, block_size=16), sampler_seed=0, loaded=smollm2_loaded)


@pytest.fixture
def loop(engine):
    loop = EngineLoop(engine, idle_wait_s=0.05).start()
    yield loop
    loop.stop()


def test_the_expected_ids_here_are_transformers_greedy_outputs(smollm2_reference):
    assert smollm2_reference.greedy(FOX, len(FOX_GREEDY)) == FOX_GREEDY


def test_responses_arrive_in_order_with_the_final_flag_last(loop, engine):
    steps = []
    loop.on_step = lambda stats, outputs: steps.append((stats.num_running, [o.request_id for o in outputs]))
    streaming, whole = RecordingSink(), RecordingSink()
    loop.submit(engine_request(FOX, 4, streaming=True), streaming)
    loop.submit(engine_request(FOX, 3, streaming=False, exclude_input_in_output=False), whole)
    streaming.wait()
    whole.wait()

    assert streaming.errors == [] and whole.errors == []
    responses = streaming.responses
    # One response per token unless the sender fell behind (then tokens come coalesced).
    pieces = [ids(t) for t, _ in responses]
    assert [t for piece in pieces for t in piece] == FOX_GREEDY[:4]
    assert [final for _, final in responses] == [False] * (len(responses) - 1) + [True]
    assert [scalar(t, "finish_reason") for t, _ in responses] == [0] * (len(responses) - 1) + [2]
    sent_before = [sum(len(p) for p in pieces[:i]) for i in range(len(pieces))]
    assert [scalar(t, "num_output_tokens") for t, _ in responses] == [n + len(p) for n, p in zip(sent_before, pieces)]
    assert [t["context_ids"].reshape(-1).tolist() for t, _ in responses] == [FOX_GREEDY[:n] for n in sent_before]
    # Non-streaming with the input echoed: one final response, prompt + output.
    [(tensors, final)] = whole.responses
    assert final and ids(tensors) == FOX + FOX_GREEDY[:3]
    assert scalar(tensors, "finish_reason") == 2 and scalar(tensors, "num_output_tokens") == 3
    assert engine.stats().num_blocks_used == 0
    assert loop.num_active == 0
    assert steps and all(isinstance(running, int) for running, _ in steps)


def test_an_invalid_request_gets_exactly_one_error(loop, engine):
    bad_prompt, too_long, good = RecordingSink(), RecordingSink(), RecordingSink()
    loop.submit(engine_request([], 4), bad_prompt)
    loop.submit(engine_request(FOX, 5000), too_long)
    loop.submit(engine_request(FOX, 2), good)
    for sink in (bad_prompt, too_long, good):
        sink.wait()
    assert bad_prompt.events == [("error", "input_ids: the prompt is empty; at least 1 token is required")]
    assert too_long.events == [("error", "max_tokens: 5000 is out of range; allowed: 1 to 1024")]
    assert [ids(t) for t, _ in good.responses] == [[351], [253]]
    assert good.errors == []
    # loop.validate (Triton's execute thread) refuses the same request up front.
    with pytest.raises(InvalidRequestError, match="^max_tokens: 5000 is out of range"):
        loop.validate(engine_request(FOX, 5000))


@pytest.mark.parametrize("cancel_raises", [False, True], ids=["cancelled", "is_cancelled-raises"])
def test_a_cancelled_request_gets_a_final_cancelled_response_and_frees_its_blocks(loop, engine, cancel_raises):
    sink = RecordingSink(cancel_after=2, cancel_raises=cancel_raises)
    loop.submit(engine_request(FOX, 500), sink)
    sink.wait()
    assert sink.errors == []
    responses = sink.responses
    received = [t for tensors, _ in responses for t in ids(tensors)]
    assert len(received) >= 2 and received == FOX_GREEDY[: len(received)]
    *partial, (last, final) = responses
    assert final and scalar(last, "finish_reason") == 3  # cancelled
    assert all(not flag and scalar(t, "finish_reason") == 0 for t, flag in partial)
    assert scalar(last, "num_output_tokens") == len(received)
    stats = engine.stats()
    assert (stats.num_blocks_used, stats.num_running, stats.num_waiting) == (0, 0, 0)
    assert loop.num_active == 0


def test_stop_cancels_requests_in_flight_and_joins_the_thread(engine):
    loop = EngineLoop(engine, idle_wait_s=0.05).start()
    running, queued = RecordingSink(), RecordingSink()
    loop.submit(engine_request(FOX, 500), running)
    assert running.first.wait(WAIT_S)
    loop.submit(engine_request(FOX, 500, streaming=False), queued)
    loop.stop()
    assert not loop._thread.is_alive()

    for sink in (running, queued):
        assert sink.done.is_set() and sink.errors == []
        sink.check_terminated_once()
        *partial, (last, final) = sink.responses
        assert final and scalar(last, "finish_reason") == 3
        assert all(not flag for _, flag in partial)
    assert [ids(t) for t, _ in running.responses][0] == [351]
    assert engine.stats().num_blocks_used == 0 and not engine.has_unfinished()

    late = RecordingSink()
    loop.submit(engine_request(FOX, 2), late)
    assert late.events == [("error", "the engine is shutting down; request not accepted")]


def test_an_exception_in_a_step_fails_the_requests_in_flight_and_the_loop_keeps_serving(loop, engine,
                                                                                        monkeypatch):
    execute = engine.runner.execute
    calls = []

    def fail_once(scheduled):
        calls.append(len(scheduled.scheduled))
        if len(calls) == 1:
            raise RuntimeError("boom in the model runner")
        return execute(scheduled)

    monkeypatch.setattr(engine.runner, "execute", fail_once)
    first, second = RecordingSink(), RecordingSink()
    with loop._wakeup:  # both arrive in the same loop iteration, so both are in the failing step
        loop.submit(engine_request(FOX, 3), first)
        loop.submit(engine_request(FOX, 3, streaming=False), second)
    first.wait()
    second.wait()
    for sink in (first, second):
        assert sink.events == [("error", "engine step failed: RuntimeError: boom in the model runner")]
    assert engine.stats().num_blocks_used == 0 and not engine.has_unfinished()

    after = RecordingSink()
    loop.submit(engine_request(FOX, 3), after)
    after.wait()
    assert after.errors == []
    assert [(ids(t), final) for t, final in after.responses] == [([351], False), ([253], False), ([2365], True)]
    assert calls[0] == 2  # the failed step held both requests


def test_a_stream_that_falls_behind_gets_its_tokens_coalesced(loop, engine):
    """The first send blocks until the engine has run several more steps; the tokens made
    meanwhile go out in one response, not one each, and nothing is lost."""
    steps = threading.Semaphore(0)
    loop.on_step = lambda stats, outputs: steps.release()

    class SlowFirstSend(RecordingSink):
        def send(self, tensors, final):
            if not self.events:
                for _ in range(4):  # four more engine steps happen while this send is stuck
                    assert steps.acquire(timeout=WAIT_S)
            super().send(tensors, final)

    sink = SlowFirstSend()
    loop.submit(engine_request(FOX, 6), sink)
    sink.wait()
    pieces = [ids(t) for t, _ in sink.responses]
    assert [t for piece in pieces for t in piece] == FOX_GREEDY[:6]
    assert pieces[0] == FOX_GREEDY[:1] and len(pieces) < 6 and max(len(p) for p in pieces) >= 2
    assert loop._sender.outputs_coalesced >= 1


# ---- several outputs per request (docs/SEQUENCE-GROUPS.md) --------------------------------

def offline(engine: Engine, prompt, params, group) -> list:
    """The engine's outputs of one request run alone, offline."""
    engine.add_request("offline", prompt, params, group=group)
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    return outputs


def test_n_outputs_stream_each_with_its_index(loop, engine):
    from inflightllm.sampling_params import SamplingParams
    from inflightllm.sequence_group import GroupParams

    sink = RecordingSink()
    loop.submit(engine_request(FOX, 6, streaming=True, n=3, temperature=1.0, seed=11), sink)
    sink.wait()
    assert sink.errors == []
    streamed: dict[int, list[int]] = {}
    for tensors, _ in sink.responses:
        streamed.setdefault(scalar(tensors, "sequence_index"), []).extend(ids(tensors))
    loop.stop()
    expected: dict[int, list[int]] = {}
    for output in offline(engine, FOX, SamplingParams(max_tokens=6, temperature=1.0, seed=11), GroupParams(n=3)):
        expected.setdefault(output.sequence_index, []).extend(output.new_token_ids)
    assert streamed == expected and sorted(streamed) == [0, 1, 2]
    # Each output's last response has its finish reason; only the request's last is final.
    last = {scalar(t, "sequence_index"): scalar(t, "finish_reason") for t, _ in sink.responses}
    assert set(last.values()) == {2}
    assert engine.stats().num_blocks_used == 0


def beams_of(tensors) -> list[list[int]]:
    """The beams of a beam search response: each row of output_ids [1, beams, longest] cut
    at its sequence_length."""
    rows, lengths = tensors["output_ids"][0].tolist(), tensors["sequence_length"].reshape(-1).tolist()
    return [row[:length] for row, length in zip(rows, lengths, strict=True)]


def test_beam_search_sends_every_beam_in_every_response_and_ends_with_them_best_first(loop, engine):
    from inflightllm.sampling_params import SamplingParams
    from inflightllm.sequence_group import GroupParams

    sink = RecordingSink()
    loop.submit(engine_request(FOX, 5, streaming=True, beam_width=4, length_penalty=0.5, early_stopping=1), sink)
    sink.wait()
    assert sink.errors == []
    loop.stop()
    group = GroupParams(beam_width=4, length_penalty=0.5, early_stopping=True)
    engine.add_request("offline", FOX, SamplingParams(max_tokens=5), streaming=True, group=group)
    steps = []
    while engine.has_unfinished():
        steps += engine.step()
    final = steps[-1]
    assert final.finished and len(final.beam_token_ids) == 4
    # Every response carries the four beams (TensorRT-LLM's beam dimension): the running
    # beams of a step (a stream that fell behind gets the latest step's), then the final
    # beams best first; never one response per beam.
    shapes = [(list(t["output_ids"].shape[:2]), list(t["sequence_length"].shape), list(t["cum_log_probs"].shape))
              for t, _ in sink.responses]
    assert shapes == [([1, 4], [1, 4], [1, 4])] * len(sink.responses)
    assert [final for _, final in sink.responses].count(True) == 1 and sink.responses[-1][1]
    streamed = [(beams_of(t), t["cum_log_probs"].reshape(-1).tolist()) for t, _ in sink.responses]
    offline_steps = [(o.beam_token_ids, o.beam_cum_logprobs) for o in steps]
    at = 0
    for beams, cums in streamed:  # the responses follow the offline steps in order, some skipped
        while offline_steps[at][0] != beams:
            at += 1
        assert cums == pytest.approx(offline_steps[at][1], abs=1e-5)
    assert streamed[-1][0] == final.beam_token_ids
    assert [scalar(t, "sequence_index") for t, _ in sink.responses] == [0] * len(sink.responses)
    # Padding: the end id after a beam's ids.
    tensors = sink.responses[-1][0]
    for row, length in zip(tensors["output_ids"][0].tolist(), tensors["sequence_length"].reshape(-1).tolist(),
                           strict=True):
        assert set(row[length:]) <= set(engine.loaded.eos_token_ids)
    assert engine.stats().num_blocks_used == 0


def test_beam_search_without_streaming_echoes_the_prompt_and_returns_each_beams_log_probs(loop, engine):
    from inflightllm.sampling_params import SamplingParams
    from inflightllm.sequence_group import GroupParams

    sink = RecordingSink()
    loop.submit(engine_request(FOX, 6, streaming=False, beam_width=3, exclude_input_in_output=False,
                               return_log_probs=True), sink)
    sink.wait()
    loop.stop()
    [(tensors, final_flag)] = sink.responses
    assert final_flag
    [final] = [o for o in offline(engine, FOX, SamplingParams(max_tokens=6, logprobs=True),
                                  GroupParams(beam_width=3)) if o.finished]
    assert beams_of(tensors) == [FOX + beam for beam in final.beam_token_ids]
    assert tensors["cum_log_probs"].reshape(-1).tolist() == pytest.approx(final.beam_cum_logprobs, abs=1e-5)
    log_probs = tensors["output_log_probs"][0].tolist()
    assert list(tensors["output_log_probs"].shape) == [1, 3, max(len(b) for b in final.beam_token_ids)]
    for row, beam, cum, expected in zip(log_probs, final.beam_token_ids, final.beam_cum_logprobs,
                                        final.beam_logprobs, strict=True):
        assert row[:len(beam)] == pytest.approx(expected, abs=1e-5) and len(expected) == len(beam)
        assert all(value <= 0.0 for value in expected)
        if len(beam) == 6:  # ended by length: its log probs add up to its cumulative log prob
            assert sum(expected) == pytest.approx(cum, abs=1e-4)
