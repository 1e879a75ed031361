"""Asynchronous scheduling (step N+1 scheduled and launched before step N's tokens are
emitted) gives the same tokens, stops and finish reasons as synchronous steps: staggered
arrivals, preemptions, prefix hits, stop sequences, EOS, penalties and aborts. Real
Engine, Scheduler and BlockManager over a tiny random Llama-3 on the CPU."""

from __future__ import annotations

import pytest

from inflightllm.config import EngineConfig
from inflightllm.engine import Engine
from inflightllm.llm import LLM
from inflightllm.model_source import ModelSpec
from inflightllm.models.loader import load_model
from inflightllm.request import FinishReason
from inflightllm.sampling_params import SamplingParams

SPEC = ModelSpec(source="random", shape="tiny-llama3", seed=0, dtype="float32")


@pytest.fixture(scope="module")
def loaded():
    return load_model(SPEC)


def engines(loaded, **overrides):
    values = dict(max_num_tokens=64, max_batch_size=6, num_kv_blocks=64, block_size=16)
    values.update(overrides)
    sync = Engine(SPEC, EngineConfig(**values), sampler_seed=0, loaded=loaded)
    asynchronous = Engine(SPEC, EngineConfig(**values, async_scheduling=True), sampler_seed=0, loaded=loaded)
    return sync, asynchronous


def generate(engine, prompts, params, arrivals=None):
    results = LLM(SPEC, engine=engine, load_tokenizer_too=False).generate(prompts, params, arrival_steps=arrivals)
    return [(r.token_ids, r.finish_reason) for r in results]


def prompts(count: int, length: int = 20) -> list[list[int]]:
    return [[(7 * i + 13 * j) % 40000 + 100 for j in range(length + 3 * i)] for i in range(count)]


def test_staggered_requests_with_preemption_give_the_same_tokens(loaded):
    sync, asynchronous = engines(loaded, num_kv_blocks=14)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (30, 12, 25, 40, 7, 33, 18, 22)]
    arrivals = [0, 0, 1, 3, 3, 4, 9, 10]
    expected = generate(sync, prompts(8), params, arrivals)
    assert generate(asynchronous, prompts(8), params, arrivals) == expected
    assert asynchronous.stats().num_preemptions_total > 0 and sync.stats().num_preemptions_total > 0
    assert asynchronous.stats().num_blocks_used == 0 and not asynchronous.has_unfinished()


def test_stop_sequences_eos_and_penalties_give_the_same_outputs(loaded):
    sync, asynchronous = engines(loaded)
    reference = generate(sync, prompts(3), [SamplingParams(max_tokens=24, ignore_eos=True)] * 3)
    first = reference[0][0]
    params = [
        SamplingParams(max_tokens=24, stop_sequences=(tuple(first[5:7]),), ignore_eos=True),  # multi-token stop
        SamplingParams(max_tokens=24, end_id=reference[1][0][3]),  # stops at its 4th token
        SamplingParams(max_tokens=24, repetition_penalty=1.4, presence_penalty=0.5, ignore_eos=True),
        SamplingParams(max_tokens=24, min_tokens=6, end_id=reference[1][0][3], ignore_eos=True),
    ]
    batch = prompts(3) + prompts(1)
    expected = generate(sync, batch, params)
    got = generate(asynchronous, batch, params)
    assert got == expected
    assert got[0] == (first[:5], FinishReason.STOP)
    assert got[1][1] is FinishReason.STOP and len(got[1][0]) == 3


def test_prefix_hits_and_aborts_leave_nothing_behind(loaded):
    _, asynchronous = engines(loaded)
    shared = prompts(1, length=40)[0]
    llm = LLM(SPEC, engine=asynchronous, load_tokenizer_too=False)
    llm.generate([shared + [5]], SamplingParams(max_tokens=4, ignore_eos=True))
    asynchronous.add_request("long", shared + [6], SamplingParams(max_tokens=200, ignore_eos=True))
    asynchronous.add_request("short", shared + [7], SamplingParams(max_tokens=3, ignore_eos=True))
    seen: dict[str, list[int]] = {"long": [], "short": []}
    for _ in range(6):
        for output in asynchronous.step():
            seen[output.request_id].extend(output.new_token_ids)
    assert asynchronous.abort("long")
    while asynchronous.has_unfinished():
        for output in asynchronous.step():
            seen[output.request_id].extend(output.new_token_ids)
            if output.request_id == "long":
                assert output.finished and output.finish_reason is FinishReason.CANCELLED
    assert len(seen["short"]) == 3
    stats = asynchronous.stats()
    assert stats.prefix_cache_hits >= 32 and stats.num_blocks_used == 0
    # The runner learns of finished requests with the next step, and forgets them then.
    llm.generate([[9, 9, 9]], SamplingParams(max_tokens=2, ignore_eos=True))
    assert not {"long", "short"} & set(asynchronous.runner.states.requests)


@pytest.mark.slow
def test_smollm2_async_equals_transformers(smollm2_loaded, smollm2_reference, smollm2_tokenizer):
    from inflightllm.model_source import DEFAULT_MODEL

    texts = ["The quick brown fox", "Once upon a time, in a land far away,", "def fibonacci(n):\n    ",
             "In 1969, the first humans", "Paris is", "Roses are red,"]
    token_prompts = [smollm2_tokenizer.encode(text) for text in texts]
    max_tokens = [20, 12, 24, 8, 16, 10]
    engine = Engine(DEFAULT_MODEL, EngineConfig(num_kv_blocks=256, async_scheduling=True), sampler_seed=0,
                    loaded=smollm2_loaded)
    results = LLM(DEFAULT_MODEL, engine=engine, load_tokenizer_too=False).generate(
        token_prompts, [SamplingParams(max_tokens=n) for n in max_tokens], arrival_steps=[0, 0, 2, 3, 5, 6]
    )
    for prompt, n, result in zip(token_prompts, max_tokens, results):
        assert result.token_ids == smollm2_reference.greedy(prompt, n)
