"""Fault isolation, bounded queues, timeouts, cancellation before start, priority under
pressure and swap preemption, on the real Engine/Scheduler/BlockManager with a stub
model (tests/stub_model.py) or on the sampler alone. No wall-clock assertion: times are
given (arrival times in the past), and latency is counted in engine steps."""

from __future__ import annotations

import math
import subprocess
import sys
import time

import pytest
import torch

from inflightllm.block_manager import BlockManager, chain_hash
from inflightllm.engine import QueueFullError
from inflightllm.request import FinishReason, Request
from inflightllm.sampler import Sampler
from inflightllm.sampling_params import SamplingParams
from tests.stub_model import EOS, reference_output, stub_engine

PROMPT = [5, 6, 7, 8, 9, 10]


def run(engine, max_steps: int = 500, steps: int | None = None, outputs=None, first_token_step=None):
    """Step until idle (or `steps` times): {request id: [outputs]} and the step of each
    request's first token (counted from this call)."""
    outputs = {} if outputs is None else outputs
    first_token_step = {} if first_token_step is None else first_token_step
    for step in range(1, max_steps + 1):
        if not engine.has_unfinished() or (steps is not None and step > steps):
            return outputs, first_token_step
        for output in engine.step():
            outputs.setdefault(output.request_id, []).append(output)
            if output.new_token_ids and output.request_id not in first_token_step:
                first_token_step[output.request_id] = step
    raise AssertionError("the engine did not finish")


def tokens_of(outputs) -> list[int]:
    return [t for output in outputs for t in output.new_token_ids]


def assert_all_free(engine) -> None:
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting, stats.num_blocks_used) == (0, 0, 0)
    assert engine.requests == {} and engine.scheduler.num_free_swap_blocks == engine.scheduler.swap_space_blocks


# ---- the sampler: one row fails alone -------------------------------------------------

def test_a_tiny_temperature_is_greedy_and_leaves_the_batch_alone():
    """Issue 11, problem 1: temperature 1e-38 overflowed the logits to inf and multinomial
    raised on NaN, failing the whole batch."""
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.9], [3.0, 1.0, 2.0, 0.0]])
    requests = [Request(request_id="tiny", prompt_token_ids=[1], params=SamplingParams(temperature=1e-38)),
                Request(request_id="sampled", prompt_token_ids=[1], params=SamplingParams(temperature=1.0, top_k=1))]
    assert SamplingParams(temperature=1e-38).greedy and not SamplingParams(temperature=1e-4).greedy
    output = Sampler(seed=0)(logits, requests)
    assert output.token_ids == [1, 0] and output.errors == [None, None]


def test_a_row_whose_sampling_fails_fails_alone():
    logits = torch.tensor([[0.0, 1.0, 2.0], [float("nan"), 0.0, 1.0], [2.0, 1.0, 0.0], [0.0, 5.0, 1.0]])
    banned_all = SamplingParams(bad_words=((0,), (1,), (2,)))
    requests = [Request(request_id="a", prompt_token_ids=[1], params=SamplingParams()),
                Request(request_id="nan", prompt_token_ids=[1], params=SamplingParams(temperature=0.7)),
                Request(request_id="banned", prompt_token_ids=[1], params=banned_all),
                Request(request_id="d", prompt_token_ids=[1], params=SamplingParams(logprobs=True))]
    output = Sampler(seed=0)(logits, requests)
    assert [output.token_ids[0], output.token_ids[3]] == [2, 1]
    assert output.errors[0] is None and output.errors[3] is None
    assert output.errors[1] == "sampling failed: SamplingError: the model's logits hold NaN"
    assert output.errors[2] == "sampling failed: SamplingError: no token is left to sample (every logit is -inf or inf)"
    assert math.isclose(output.logprobs[3], float(torch.log_softmax(torch.tensor([0.0, 5.0, 1.0]), -1)[1]), rel_tol=1e-6)


# ---- the engine: a request fails alone ---------------------------------------------------

def test_min_tokens_holds_multi_token_stop_sequences():
    """Issue 11, problem 2: with min_tokens=5 and stop ids (7, 8) the request finished as
    `stop` after 0 tokens. A stop sequence now counts only once min_tokens tokens precede it."""
    engine = stub_engine(model=lambda tokens: 7 if tokens[-1] != 7 else 8)
    engine.add_request("min", PROMPT, SamplingParams(max_tokens=20, min_tokens=5, stop_sequences=((7, 8),)))
    engine.add_request("plain", PROMPT, SamplingParams(max_tokens=20, stop_sequences=((7, 8),)))
    outputs, _ = run(engine)
    assert tokens_of(outputs["min"]) == [7, 8, 7, 8, 7, 8]  # 6 >= 5 tokens, then the stop sequence
    assert outputs["min"][-1].finish_reason is FinishReason.STOP
    assert tokens_of(outputs["plain"]) == [] and outputs["plain"][-1].finish_reason is FinishReason.STOP


def test_a_sampling_failure_fails_only_its_request(monkeypatch):
    engine = stub_engine()
    execute = engine.runner.execute

    def fail_one(step):
        sampled = execute(step)
        if "bad" in sampled.request_ids:
            row = sampled.request_ids.index("bad")
            for column in (sampled.request_ids, sampled.token_ids, sampled.logprobs, sampled.top_ids,
                           sampled.top_logprobs):
                del column[row]
            sampled.failed["bad"] = "sampling failed: RuntimeError: boom"
        return sampled

    monkeypatch.setattr(engine.runner, "execute", fail_one)
    for name in ("a", "bad", "c"):
        engine.add_request(name, PROMPT, SamplingParams(max_tokens=5), streaming=True)
    outputs, _ = run(engine)
    assert [(o.finished, o.error) for o in outputs["bad"]] == [(True, "sampling failed: RuntimeError: boom")]
    for name in ("a", "c"):
        assert tokens_of(outputs[name]) == reference_output(PROMPT, 5) and outputs[name][-1].error is None
    assert engine.stats().num_failed_total == 1
    assert_all_free(engine)


def test_a_stop_handling_failure_fails_only_its_request(monkeypatch):
    engine = stub_engine()
    check_stop = engine._check_stop

    def fail_for_bad(request):
        if request.request_id == "bad" and request.num_output_tokens == 2:
            raise ValueError("broken stop list")
        return check_stop(request)

    monkeypatch.setattr(engine, "_check_stop", fail_for_bad)
    engine.add_request("bad", PROMPT, SamplingParams(max_tokens=5), streaming=True)
    engine.add_request("good", PROMPT, SamplingParams(max_tokens=5), streaming=True)
    outputs, _ = run(engine)
    assert outputs["bad"][-1].error == "stop handling failed: ValueError: broken stop list"
    assert tokens_of(outputs["good"]) == reference_output(PROMPT, 5)
    assert_all_free(engine)


def test_an_exception_in_a_step_fails_only_that_steps_requests():
    engine = stub_engine(max_batch_size=1)
    execute = engine.runner.execute
    calls = []

    def fail_second_step(step):
        calls.append([request_id for request_id, _ in step.scheduled])
        if len(calls) == 2:
            raise RuntimeError("device fault")
        return execute(step)

    engine.runner.execute = fail_second_step
    engine.add_request("first", PROMPT, SamplingParams(max_tokens=4))
    engine.add_request("waiting", PROMPT + [11], SamplingParams(max_tokens=4))
    outputs, _ = run(engine)
    assert calls[:2] == [["first"], ["first"]]  # "waiting" was not in the failed step
    assert [o.error for o in outputs["first"]] == ["engine step failed: RuntimeError: device fault"]
    assert tokens_of(outputs["waiting"]) == reference_output(PROMPT + [11], 4)
    assert engine.runner.violations == []
    # The runner holds only what the next step tells it to forget (the failed one already is).
    assert set(engine.runner.states.requests) == set(engine._runner_finished) == {"waiting"}
    assert_all_free(engine)


# ---- bounded queues, timeouts, cancellation before start ---------------------------------

def test_max_queue_size_refuses_at_once_with_a_clear_error():
    """Issue 11, problem 4: max_queue_size was validated but ignored."""
    engine = stub_engine(max_queue_size=2)
    engine.add_request("a", PROMPT, SamplingParams(max_tokens=2))
    engine.add_request("b", PROMPT, SamplingParams(max_tokens=2))
    with pytest.raises(QueueFullError) as error:
        engine.add_request("c", PROMPT, SamplingParams(max_tokens=2))
    assert str(error.value) == (
        "the engine's queue is full: 2 requests are waiting (max_queue_size 2); try again later"
    )
    assert list(engine.requests) == ["a", "b"] and engine.stats().num_rejected_total == 1
    run(engine)  # once they run, the queue has room again
    engine.add_request("c", PROMPT, SamplingParams(max_tokens=2))


def test_a_request_that_waited_past_its_timeout_fails_and_frees_everything():
    engine = stub_engine(max_batch_size=1, default_timeout_microseconds=5_000_000)
    past = time.monotonic() - 60.0  # it arrived a minute ago: no race with the clock
    engine.add_request("running", PROMPT, SamplingParams(max_tokens=3))
    engine.add_request("late", PROMPT + [1], SamplingParams(max_tokens=3), arrival_time=past, timeout_s=0.25)
    engine.add_request("default", PROMPT + [2], SamplingParams(max_tokens=3), arrival_time=past)
    engine.add_request("patient", PROMPT + [3], SamplingParams(max_tokens=3), arrival_time=past, timeout_s=1e6)
    outputs, _ = run(engine)
    late, default = outputs["late"][-1], outputs["default"][-1]
    assert late.error.startswith("the request waited ") and late.error.endswith(
        "ms in the queue, more than its timeout of 250 ms; it was not started")
    assert default.error.endswith("more than its timeout of 5000 ms; it was not started")
    assert tokens_of(outputs["patient"]) == reference_output(PROMPT + [3], 3)
    assert {"late", "default"}.isdisjoint(engine.runner.seen_request_ids)
    assert engine.stats().num_timed_out_total == 2
    assert_all_free(engine)


def test_a_request_cancelled_while_waiting_never_reaches_the_model():
    engine = stub_engine(max_batch_size=1)
    engine.add_request("running", PROMPT, SamplingParams(max_tokens=4))
    engine.add_request("cancelled", PROMPT + [1], SamplingParams(max_tokens=4))
    engine.step()
    assert engine.abort("cancelled")
    outputs, _ = run(engine)
    assert outputs["cancelled"][-1].finish_reason is FinishReason.CANCELLED
    assert "cancelled" not in engine.runner.seen_request_ids
    assert all("cancelled" not in step.finished_request_ids for step in engine.runner.steps)
    assert_all_free(engine)


# ---- priority under pressure, swap preemption ------------------------------------------

@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_high_priority_request_is_not_delayed_by_a_low_priority_flood(mode):
    """A flood of low-priority requests fills the batch and the KV cache; a high-priority
    arrival gets its first token in as many steps as on an idle engine."""
    def first_token_steps(flood: int) -> int:
        engine = stub_engine(num_blocks=24, block_size=4, max_batch_size=4, max_num_tokens=64,
                             preemption_mode=mode, priority_levels=3)
        for index in range(flood):
            engine.add_request(f"low-{index}", [index + 1] * 12, SamplingParams(max_tokens=30, ignore_eos=True),
                               priority=0, streaming=True)
        outputs, _ = run(engine, steps=3 if flood else 0)
        if flood:
            assert engine.stats().num_running == 4 and engine.stats().num_waiting == flood - 4
        engine.add_request("high", PROMPT * 3, SamplingParams(max_tokens=4, ignore_eos=True), priority=2,
                           streaming=True)
        outputs, first = run(engine, max_steps=2000, outputs=outputs)
        assert tokens_of(outputs["high"]) == reference_output(PROMPT * 3, 4, eos=None)
        for index in range(flood):  # the flood completes correctly, preempted or not
            assert tokens_of(outputs[f"low-{index}"]) == reference_output([index + 1] * 12, 30, eos=None)
        assert engine.runner.violations == []
        assert_all_free(engine)
        if flood:
            assert engine.stats().num_preemptions_total >= 1
            if mode == "swap":
                assert engine.stats().num_swapped_out_total >= 1
                assert any(step.swap_in for step in engine.runner.steps)
        return first["high"]

    assert first_token_steps(flood=12) == first_token_steps(flood=0)


def test_swap_preemption_moves_blocks_to_host_and_back_without_recomputing():
    def run_mode(mode: str):
        engine = stub_engine(num_blocks=10, block_size=4, max_batch_size=4, max_num_tokens=64, preemption_mode=mode)
        prompts = [[i + 1] * 9 for i in range(3)]
        for index, prompt in enumerate(prompts):
            engine.add_request(f"r{index}", prompt, SamplingParams(max_tokens=10, ignore_eos=True))
        outputs, _ = run(engine)
        for index, prompt in enumerate(prompts):
            assert tokens_of(outputs[f"r{index}"]) == reference_output(prompt, 10, eos=None)
        assert engine.runner.violations == []
        assert_all_free(engine)
        computed = sum(count for step in engine.runner.steps for _, count in step.scheduled)
        return engine, computed

    swap, swap_computed = run_mode("swap")
    recompute, recompute_computed = run_mode("recompute")
    assert swap.stats().num_swapped_out_total >= 1 and swap.runner.swapped == {}
    assert sum(len(step.swap_out) for step in swap.runner.steps) == swap.stats().num_swapped_out_total
    assert recompute.stats().num_preemptions_total >= 1 and recompute.stats().num_swapped_out_total == 0
    assert swap_computed < recompute_computed  # swapped tokens were not computed again


def test_cpu_attention_backend_swaps_blocks_out_and_back():
    from inflightllm.attention import TorchReferenceAttention

    backend = TorchReferenceAttention(num_heads=2, num_kv_heads=1, head_dim=4)
    backend.allocate_kv_cache(6, 2, 2, 1, 4, torch.float32, torch.device("cpu"))
    for layer in range(2):
        backend.key_cache[layer].copy_(torch.randn_like(backend.key_cache[layer]))
        backend.value_cache[layer].copy_(torch.randn_like(backend.value_cache[layer]))
    before = [(k.clone(), v.clone()) for k, v in zip(backend.key_cache, backend.value_cache)]
    handle = backend.swap_out([1, 4])
    for layer in range(2):
        backend.key_cache[layer].zero_()
        backend.value_cache[layer].zero_()
    backend.swap_in(handle, [5, 0])
    for (key, value), new_key, new_value in zip(before, backend.key_cache, backend.value_cache):
        assert torch.equal(new_key[10:12], key[2:4]) and torch.equal(new_key[0:2], key[8:10])
        assert torch.equal(new_value[10:12], value[2:4]) and torch.equal(new_value[0:2], value[8:10])
        assert torch.count_nonzero(new_key[2:10]) == 0


# ---- prefix-cache keys, identity ---------------------------------------------------------

def test_prefix_keys_are_sha256_chains_equal_across_processes():
    """Issue 11, problem 3: keys were Python's hash(), and hash(None) differs per process."""
    here = chain_hash(chain_hash(None, (1, 2, 3, 4)), (5, 6, 7, 8)).hex()
    code = ("from inflightllm.block_manager import chain_hash; "
            "print(chain_hash(chain_hash(None, (1, 2, 3, 4)), (5, 6, 7, 8)).hex())")
    there = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert here == there and len(bytes.fromhex(here)) == 32
    assert chain_hash(None, (1, 2)) != chain_hash(None, (1, 2), extra_key=b"lora-1")


def test_a_forged_key_collision_with_another_parent_is_not_a_hit(monkeypatch):
    """Issue 11, problem 3: two prefixes ending in the same block shared it when the keys
    collided, because only the block's own tokens were compared. Forge the collision: a
    key function that ignores the parent."""
    import inflightllm.block_manager as block_manager

    monkeypatch.setattr(block_manager, "chain_hash", lambda parent, tokens, extra_key=b"": hash(tokens).to_bytes(
        8, "little", signed=True))
    manager = BlockManager(num_blocks=8, block_size=2)
    params = SamplingParams(max_tokens=1)

    def admit_and_compute(request_id, tokens):
        request = Request(request_id=request_id, prompt_token_ids=tokens, params=params)
        computed = manager.get_computed_blocks(request)
        manager.allocate(request, computed, request.num_tokens - len(computed) * 2)
        request.num_computed_tokens = request.num_tokens
        manager.cache_full_blocks(request)
        return request, computed

    admit_and_compute("x-s", [1, 1, 5, 5, 0])  # blocks (1, 1), (5, 5): (5, 5) computed after (1, 1)
    admit_and_compute("y-t", [2, 2, 6, 6, 0])  # block (2, 2) cached too
    _, computed = admit_and_compute("y-s", [2, 2, 5, 5, 0])  # (5, 5) after (2, 2): same forged key
    assert len(computed) == 1  # (2, 2) is shared; the (5, 5) computed after (1, 1) is not


def test_requests_compare_by_identity():
    """Issue 11, problem 5: Request compared field by field, so `in`/`remove` on a deep
    queue compared every field of every request."""
    params = SamplingParams()
    first, second = (Request(request_id="same", prompt_token_ids=[1, 2], params=params) for _ in range(2))
    assert first != second and first == first and len({first, second}) == 2


def test_waiting_queue_is_ordered_by_priority_then_arrival_with_o1_removal():
    engine = stub_engine(max_batch_size=1, priority_levels=3)
    for index, priority in enumerate([0, 2, 1, 2, 0]):
        engine.add_request(f"r{index}", PROMPT, SamplingParams(max_tokens=2), priority=priority)
    waiting = engine.scheduler.waiting
    assert [r.request_id for r in waiting] == ["r1", "r3", "r2", "r0", "r4"]
    assert engine.abort("r3") and [r.request_id for r in waiting] == ["r1", "r2", "r0", "r4"]
    assert waiting.peek().request_id == "r1" and len(waiting) == 4
    assert EOS not in PROMPT


def test_the_serving_loop_drops_a_request_cancelled_before_it_reached_the_engine():
    from inflightllm.serving.engine_io import EngineRequest
    from inflightllm.serving.engine_loop import EngineLoop

    class Sink:
        def __init__(self, cancelled):
            self.cancelled, self.events, self.done = cancelled, [], __import__("threading").Event()

        def send(self, tensors, final):
            self.events.append(("response", final))
            if final:
                self.done.set()

        def send_error(self, message):
            self.events.append(("error", message))
            self.done.set()

        def is_cancelled(self):
            return self.cancelled

    engine = stub_engine()
    loop = EngineLoop(engine)
    gone, kept = Sink(cancelled=True), Sink(cancelled=False)
    request = EngineRequest(prompt_token_ids=PROMPT, params=SamplingParams(max_tokens=3), priority=0,
                            streaming=False, echo_prompt=False)
    with loop._wakeup:  # both arrive in the same loop iteration
        loop.start()
        gone_id = loop.submit(request, gone)
        loop.submit(request, kept)
    assert gone.done.wait(60) and kept.done.wait(60)
    loop.stop()
    assert gone.events == [("error", "the request was cancelled before it started")]
    assert kept.events == [("response", True)]
    assert gone_id not in engine.runner.seen_request_ids


def test_preprocessing_and_the_engine_apply_the_same_rules(monkeypatch):
    """The request rules are written once (inflightllm/request_rules.py): narrowing one
    range changes what preprocessing and the engine both accept."""
    import numpy as np

    from inflightllm import request_rules as rules
    from inflightllm.sampling_params import InvalidRequestError
    from inflightllm.text.preprocess import RequestError, RequestLimits, build_engine_request

    class Tokenizer:
        def encode(self, text, add_special_tokens=True):
            return [ord(c) % 50 + 1 for c in text]

    monkeypatch.setitem(rules.SAMPLING_RANGES, "temperature", rules.Range(0.0, 2.0, "0 to 2"))
    limits = RequestLimits(max_input_length=100, max_output_len=50, max_model_len=150, priority_levels=3,
                           vocab_size=100)
    inputs = {"text_input": np.array([[b"hi"]], dtype=object), "max_tokens": np.array([[5]], dtype=np.int32),
              "temperature": np.array([[3.0]], dtype=np.float32)}
    with pytest.raises(RequestError) as error:
        build_engine_request(inputs, Tokenizer(), limits)
    assert str(error.value) == "input 'temperature': 3.0 is out of range; allowed: 0 to 2"
    with pytest.raises(InvalidRequestError) as error:
        SamplingParams(temperature=3.0).validate(100)
    assert str(error.value) == "temperature: 3.0 is out of range; allowed: 0 to 2"
    inputs["temperature"] = np.array([[1.5]], dtype=np.float32)
    assert float(build_engine_request(inputs, Tokenizer(), limits)["temperature"][0, 0]) == 1.5
    SamplingParams(temperature=1.5).validate(100)
