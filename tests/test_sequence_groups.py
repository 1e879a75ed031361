"""Sequence groups (n, best_of): block sharing, copy-on-write, group scheduling, and the
outputs. The stub model (tests/stub_model.py) checks every attended slot, so a wrong
shared block or a missed copy is seen; SmolLM2 checks seeded outputs and the memory."""

from __future__ import annotations

import pytest

from inflightllm.config import EngineConfig
from inflightllm.engine import Engine
from inflightllm.model_source import DEFAULT_MODEL
from inflightllm.request import FinishReason
from inflightllm.sampling_params import InvalidRequestError, SamplingParams
from inflightllm.sequence_group import GroupParams
from tests.stub_model import reference_output, stub_engine


def run(engine, arrivals: dict[int, list[tuple]], max_steps: int = 2000) -> dict:
    """Drive the engine; `arrivals[step]` = [(request id, prompt, params, group)]. Returns
    request id -> {sequence index: token ids}, and the finals by request id."""
    received: dict[str, dict[int, list[int]]] = {}
    finals: dict[str, list] = {}
    step = 0
    while step < max_steps and (arrivals or engine.has_unfinished()):
        for request_id, prompt, params, group in arrivals.pop(step, []):
            engine.add_request(request_id, prompt, params, group=group, streaming=True)
        for output in engine.step():
            assert output.error is None, output.error
            received.setdefault(output.request_id, {}).setdefault(output.sequence_index, []).extend(
                output.new_token_ids)
            finals.setdefault(output.request_id, []).append(output)
            assert output.request_id not in engine.groups or not output.finished
        step += 1
    assert not engine.has_unfinished()
    return received, finals


def test_n_shares_the_prompt_and_copies_the_partial_block_on_write():
    engine = stub_engine(num_blocks=32, block_size=4)
    prompt = [5, 6, 7, 8, 9, 10, 11]  # 6 tokens shared before the fork: one full block, one partial
    engine.add_request("a", prompt, SamplingParams(max_tokens=3), group=GroupParams(n=3))
    engine.step()  # the first sequence computes the prompt but its last token, then the group forks
    manager = engine.block_manager
    assert [r.request_id for r in engine.scheduler.running] == ["a\x1f0", "a\x1f1", "a\x1f2"]
    tables = [r.block_table for r in engine.scheduler.running]
    assert tables[0] == tables[1] == tables[2] and len(tables[0]) == 2
    assert [manager.blocks[b].ref_count for b in tables[0]] == [3, 3]
    assert engine.stats().num_shared_blocks == 2
    engine.step()  # each computes the last prompt token: two copy the partial block, the last writes it
    tables = [r.block_table for r in engine.scheduler.running]
    assert tables[0][0] == tables[1][0] == tables[2][0]
    assert len({t[1] for t in tables}) == 3
    stats = engine.stats()
    assert (stats.num_cow_copies_total, stats.num_shared_blocks, stats.num_blocks_used) == (2, 1, 4)
    run(engine, {})
    assert engine.runner.violations == []
    assert engine.block_manager.num_free_blocks == 32


def test_n_outputs_stream_with_their_index_and_finish_once():
    engine = stub_engine(num_blocks=64, block_size=4)
    prompts = {"a": [3, 4, 5, 6, 7], "b": [9], "c": [1, 2, 3, 4, 5, 6, 7, 8, 9]}
    arrivals = {0: [("a", prompts["a"], SamplingParams(max_tokens=6), GroupParams(n=4))],
                2: [("b", prompts["b"], SamplingParams(max_tokens=5), GroupParams(n=2)),
                    ("c", prompts["c"], SamplingParams(max_tokens=4), None)]}
    received, finals = run(engine, arrivals)
    assert engine.runner.violations == []
    for request_id, count in (("a", 4), ("b", 2), ("c", 1)):
        expected = reference_output(prompts[request_id], {"a": 6, "b": 5, "c": 4}[request_id])
        assert received[request_id] == {i: expected for i in range(count)}
        finished = [o for o in finals[request_id] if o.finished]
        assert len(finished) == 1 and finished[0] is finals[request_id][-1]
        assert sorted(o.sequence_index for o in finals[request_id] if o.sequence_finished in (True, None)
                      and (o.sequence_finished or o.finished)) == list(range(count))
    assert engine.block_manager.num_free_blocks == 64 and not engine.groups


def test_group_is_preempted_and_resumed_whole():
    # 24 blocks of 2 tokens: a group of 3 (20 blocks at its end) and another request compete.
    engine = stub_engine(num_blocks=24, block_size=2, max_num_tokens=16)
    prompt = [7, 8, 9, 10, 11]
    arrivals = {0: [("x", [1, 2, 3], SamplingParams(max_tokens=24), None)],
                1: [("y", [4, 5], SamplingParams(max_tokens=24), None)],
                2: [("g", prompt, SamplingParams(max_tokens=10), GroupParams(n=3))]}
    preempted_together = []
    preempt = engine.scheduler._preempt_group

    def record(victim, output):
        tokens = preempt(victim, output)
        preempted_together.append(sorted(r.request_id for r in output.preempted))
        return tokens

    engine.scheduler._preempt_group = record
    received, _ = run(engine, arrivals)
    assert engine.runner.violations == []
    assert engine.stats().num_preemptions_total > 0
    assert any(len(ids) == 3 and all(i.startswith("g") for i in ids) for ids in preempted_together)
    assert received["g"] == {i: reference_output(prompt, 10) for i in range(3)}
    assert received["x"] == {0: reference_output([1, 2, 3], 24)}
    assert received["y"] == {0: reference_output([4, 5], 24)}
    assert engine.block_manager.num_free_blocks == 24


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_groups_with_asynchronous_scheduling(mode):
    from inflightllm.model_runner import CompletedStep

    engine = stub_engine(num_blocks=24, block_size=2, max_num_tokens=16, async_scheduling=True, preemption_mode=mode)
    engine.runner.launch = lambda step: CompletedStep(engine.runner.execute(step))  # the stub runs at once
    requests = {"x": ([1, 2, 3], 24, None), "y": ([4, 5], 24, None),
                "g": ([7, 8, 9, 10, 11], 10, GroupParams(n=3)), "h": ([9], 5, GroupParams(n=2))}
    arrivals = {step: [(rid, requests[rid][0], SamplingParams(max_tokens=requests[rid][1]), requests[rid][2])
                       for rid in ids] for step, ids in {0: ["x"], 1: ["y"], 2: ["g", "h"]}.items()}
    received, _ = run(engine, arrivals)
    assert engine.runner.violations == [] and engine.stats().num_preemptions_total > 0
    for request_id, (prompt, max_tokens, group) in requests.items():
        expected = reference_output(prompt, max_tokens)
        assert received[request_id] == {i: expected for i in range(group.n if group else 1)}
    assert engine.block_manager.num_free_blocks == 24


def test_cancel_a_group_frees_every_block_and_sends_one_final():
    engine = stub_engine(num_blocks=32, block_size=4)
    engine.add_request("g", [4, 5, 6, 7, 8, 9], SamplingParams(max_tokens=10), group=GroupParams(n=3),
                       streaming=True)
    for _ in range(3):
        engine.step()
    assert engine.abort("g")
    outputs = engine.step()
    assert [o.finished for o in outputs] == [False, False, True]
    assert {o.finish_reason for o in outputs} == {FinishReason.CANCELLED}
    assert sorted(o.sequence_index for o in outputs) == [0, 1, 2]
    assert engine.block_manager.num_free_blocks == 32 and not engine.groups and not engine.requests


def test_group_settings_are_validated_by_name():
    engine = stub_engine(num_blocks=64, block_size=4, max_batch_size=6)
    cases = [
        (GroupParams(n=9), "n: 9 is out of range; allowed: 1 to 8 (engine.max_n)"),
        (GroupParams(n=2, best_of=1), "best_of: 1 is out of range; allowed: n (2) to 8"),
        (GroupParams(beam_width=9), "beam_width: 9 is out of range; allowed: 1 to 8 (engine.max_beam_width)"),
        (GroupParams(n=7), "n: 7 sequences exceed max_batch_size (6)"),
        (GroupParams(beam_width=2, early_stopping="sometimes"), "early_stopping: 'sometimes' is not allowed"),
        (GroupParams(n=2, beam_width=3), "n: 2 with beam_width 3"),
    ]
    for group, message in cases:
        with pytest.raises(InvalidRequestError, match=message.replace("(", r"\(").replace(")", r"\)")):
            engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=4), group=group)
    with pytest.raises(InvalidRequestError, match="cannot stream"):
        engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=4), group=GroupParams(n=1, best_of=3),
                           streaming=True)
    with pytest.raises(InvalidRequestError, match="sequences of prompt"):
        engine.add_request("r", [1] * 40, SamplingParams(max_tokens=40), group=GroupParams(n=6))
    assert not engine.requests and not engine.groups


# ---- SmolLM2 ----------------------------------------------------------------------------

def generate(engine: Engine, request_id: str, prompt, params, group=None) -> dict[int, list[int]]:
    engine.add_request(request_id, prompt, params, group=group)
    outputs: dict[int, list[int]] = {}
    logprobs: dict[int, float] = {}
    while engine.has_unfinished():
        for output in engine.step():
            if output.request_id == request_id:
                assert output.error is None, output.error
                outputs.setdefault(output.sequence_index, []).extend(output.new_token_ids)
                logprobs[output.sequence_index] = output.cum_logprob
    return outputs, logprobs


@pytest.fixture(scope="module")
def chat_prompt(smollm2_tokenizer) -> list[int]:
    text = smollm2_tokenizer.apply_chat_template(
        [{"role": "user", "content": "Tell me a short story about a robot."}], add_generation_prompt=True,
        tokenize=False)
    return smollm2_tokenizer.encode(text)


def test_n4_seeded_outputs_equal_each_alone(smollm2_loaded, chat_prompt):
    config = EngineConfig(num_kv_blocks=128, block_size=16)
    engine = Engine(DEFAULT_MODEL, config, sampler_seed=0, loaded=smollm2_loaded)
    params = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.95, seed=1234)
    together, _ = generate(engine, "group", chat_prompt, params, GroupParams(n=4))
    assert sorted(together) == [0, 1, 2, 3]
    assert engine.stats().num_cow_copies_total == 3  # the partial prompt block, copied by 3 of 4
    for index in range(4):
        alone, _ = generate(engine, f"alone-{index}", chat_prompt,
                            SamplingParams(max_tokens=10, temperature=1.0, top_p=0.95, seed=1234 + index))
        assert together[index] == alone[0], index
    assert len({tuple(tokens) for tokens in together.values()}) > 1  # they are different samples
    assert engine.block_manager.num_used_blocks == 0


def test_best_of_returns_the_n_highest_cumulative_logprobs(smollm2_loaded, chat_prompt):
    config = EngineConfig(num_kv_blocks=128, block_size=16)
    engine = Engine(DEFAULT_MODEL, config, sampler_seed=0, loaded=smollm2_loaded)
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=77)
    best, cum = generate(engine, "best", chat_prompt, params, GroupParams(n=2, best_of=5))
    assert sorted(best) == [0, 1]
    every, every_cum = generate(engine, "every", chat_prompt, SamplingParams(max_tokens=6, temperature=1.0, seed=77,
                                                                             logprobs=True), GroupParams(n=5))
    ranked = sorted(range(5), key=lambda i: -every_cum[i])[:2]
    assert [best[0], best[1]] == [every[ranked[0]], every[ranked[1]]]
    # (the second run computes the prompt from the prefix cache: float sums differ in the 6th digit)
    assert cum[0] == pytest.approx(every_cum[ranked[0]], abs=1e-3) and cum[0] >= cum[1]


def test_n8_over_a_long_prompt_holds_the_prompt_once(smollm2_loaded):
    prompt = [(7 * i) % 4000 + 100 for i in range(1000)]
    config = EngineConfig(num_kv_blocks=512, block_size=16, max_num_tokens=1024)
    engine = Engine(DEFAULT_MODEL, config, sampler_seed=0, loaded=smollm2_loaded)
    engine.add_request("long", prompt, SamplingParams(max_tokens=2, temperature=1.0, seed=3), group=GroupParams(n=8))
    engine.step()  # 999 prompt tokens, then the fork
    stats = engine.stats()
    assert (stats.num_blocks_used, stats.num_shared_blocks, stats.num_running) == (63, 63, 8)
    engine.step()  # every sequence computes token 1000 into its own copy of the partial block
    stats = engine.stats()
    full = 999 // 16  # 62 full blocks, shared by all 8
    assert stats.num_shared_blocks == full
    assert stats.num_cow_copies_total == 7  # the eighth writes the original
    assert stats.num_blocks_used == full + 8  # the prompt once, one partial block per sequence
    while engine.has_unfinished():
        engine.step()
    assert engine.stats().num_blocks_used == 0


def test_metrics_show_shared_blocks_and_copies():
    from inflightllm.metrics import EngineMetrics
    from tests.test_metrics import _Family, _PbUtils, _value

    _Family.created = {}
    metrics = EngineMetrics(_PbUtils, model_name="engine")
    engine = stub_engine(num_blocks=32, block_size=4)
    engine.add_request("a", [5, 6, 7, 8, 9, 10, 11], SamplingParams(max_tokens=3), group=GroupParams(n=3))
    outputs = engine.step()  # forked: the prompt's two blocks shared by three
    metrics.update(engine.stats(), outputs)
    assert _value("inflightllm_kv_cache_shared_blocks") == 2
    outputs = engine.step()  # two sequences copied the partial block
    metrics.update(engine.stats(), outputs)
    assert _value("inflightllm_kv_cache_shared_blocks") == 1
    assert _value("inflightllm_kv_cache_cow_copies_total") == 2
    while engine.has_unfinished():
        outputs = engine.step()
        metrics.update(engine.stats(), outputs)
    assert _value("inflightllm_kv_cache_shared_blocks") == 0
    assert _value("inflightllm_kv_cache_cow_copies_total") == 2
