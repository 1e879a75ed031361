"""The dummy runner (`engine.runner: dummy`): no model compute, deterministic tokens from
the real vocabulary, through the real scheduler and block manager."""

from __future__ import annotations

import pytest

from inflightllm.config import EngineConfig
from inflightllm.dummy_runner import (
    LOGPROBS_REFUSED,
    DummyRunner,
    describe_model,
    special_token_ids,
    token_pool,
)
from inflightllm.engine import Engine
from inflightllm.model_source import ModelSpec
from inflightllm.profile import REPO_ROOT, load_profile
from inflightllm.sampling_params import SamplingParams

SMOLLM2_SHAPE = ModelSpec(source="random", shape="smollm2-135m")


def dummy_engine(**changes) -> Engine:
    config = EngineConfig(runner="dummy", num_kv_blocks=changes.pop("num_kv_blocks", 64), **changes)
    return Engine(SMOLLM2_SHAPE, config)


def run(engine: Engine) -> dict[str, list]:
    outputs: dict[str, list] = {}
    while engine.has_unfinished():
        for output in engine.step():
            outputs.setdefault(output.request_id, []).append(output)
    return outputs


def tokens(outputs) -> list[int]:
    return [token for output in outputs for token in output.new_token_ids]


def test_the_shipped_profile_uses_the_dummy_runner():
    profile = load_profile(REPO_ROOT / "profiles" / "dummy-engine-cpu.yaml")
    assert profile.engine.runner == "dummy"
    assert load_profile(REPO_ROOT / "profiles" / "smollm2-cpu.yaml").engine.runner == "model"
    engine = Engine(profile.model, profile.engine)
    assert engine.loaded.model is None  # no weights loaded
    assert isinstance(engine.runner, DummyRunner)
    # 2 GiB at 46080 bytes per token, blocks of 16: counted, not allocated.
    assert engine.runner.num_blocks == 2147483648 // (16 * 46080) == 2912


def test_tokens_are_ordinary_vocabulary_ids_and_depend_only_on_the_prompt(smollm2_tokenizer):
    engine = dummy_engine()
    prompt = smollm2_tokenizer.encode("Once upon a time")
    other = smollm2_tokenizer.encode("Something else entirely")
    engine.add_request("a", prompt, SamplingParams(max_tokens=40))
    engine.add_request("b", other, SamplingParams(max_tokens=40, temperature=1.0, seed=3))
    first = run(engine)
    engine.add_request("c", prompt, SamplingParams(max_tokens=40, temperature=0.7))  # alone, later
    second = run(engine)
    assert tokens(first["a"]) == tokens(second["c"])  # same prompt, same tokens: whatever ran beside it
    assert tokens(first["a"]) != tokens(first["b"])
    assert [len(tokens(first["a"])), len(tokens(first["b"]))] == [40, 40]  # never EOS: ends by max_tokens
    assert first["a"][-1].finish_reason.name == "LENGTH"
    excluded = special_token_ids(engine.loaded.folder) | set(engine.loaded.eos_token_ids)
    assert 2 in excluded and 0 in excluded  # <|im_end|>, <|endoftext|>
    generated = tokens(first["a"]) + tokens(first["b"])
    assert not excluded & set(generated)
    assert len(set(generated)) > 70  # spread over the vocabulary
    text = smollm2_tokenizer.decode(generated, skip_special_tokens=True)
    assert len(text) > 200  # real text for the detokenizer to produce


def test_kv_blocks_are_handed_out_and_freed_by_the_block_manager():
    engine = dummy_engine(num_kv_blocks=64, block_size=16)
    engine.add_request("a", list(range(100, 140)), SamplingParams(max_tokens=30))  # 40 + 30 tokens: 5 blocks
    engine.step()  # prefill: 40 tokens -> 3 blocks
    assert engine.block_manager.num_free_blocks == 64 - 3
    outputs = run(engine)
    assert len(tokens(outputs["a"])) == 30  # not streaming: one output with every token
    assert engine.block_manager.num_free_blocks == 64  # all freed (cached ones are free too)


def test_chunked_prefill_samples_only_at_the_end_of_the_prompt():
    engine = dummy_engine(max_num_tokens=16, max_batch_size=4)
    engine.add_request("a", list(range(100, 150)), SamplingParams(max_tokens=3), streaming=True)  # 4 chunks
    steps = []
    while engine.has_unfinished():
        steps.append([len(output.new_token_ids) for output in engine.step()])
    assert steps == [[], [], [], [1], [1], [1]]


def test_log_probs_are_refused_and_the_request_fails_alone():
    engine = dummy_engine()
    engine.add_request("a", [100, 101], SamplingParams(max_tokens=3, logprobs=True))
    engine.add_request("b", [100, 101], SamplingParams(max_tokens=3))
    outputs = run(engine)
    assert [output.error for output in outputs["a"]] == [LOGPROBS_REFUSED]
    assert len(tokens(outputs["b"])) == 3


def test_the_pool_leaves_out_special_and_eos_ids():
    loaded = describe_model(SMOLLM2_SHAPE)
    pool = token_pool(loaded)
    excluded = special_token_ids(loaded.folder) | set(loaded.eos_token_ids)
    assert len(pool) == loaded.arch.vocab_size - len(excluded)
    assert not excluded & set(pool)


def test_the_engine_refuses_a_dummy_on_a_gpu_or_an_unknown_runner():
    with pytest.raises(ValueError, match="the dummy runner runs on the host alone"):
        Engine(SMOLLM2_SHAPE, EngineConfig(runner="dummy", device="gpu", gpu_ids=(0,)))
    with pytest.raises(ValueError, match="engine runner 'fast' is not one of model, dummy"):
        Engine(SMOLLM2_SHAPE, EngineConfig(runner="fast"))


def test_a_step_can_wait_as_a_device_would(monkeypatch):
    """INFLIGHTLLM_DUMMY_STEP_MS: each step waits that long (the GIL released), so that the
    response path sees a model's pace; a bad value is refused with the variable's range."""
    import time

    from inflightllm.dummy_runner import STEP_MS_ENV, step_seconds

    assert step_seconds() == 0.0
    monkeypatch.setenv(STEP_MS_ENV, "30")
    engine = dummy_engine()
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    assert time.perf_counter() - start >= 3 * 0.03
    monkeypatch.setenv(STEP_MS_ENV, "-1")
    with pytest.raises(ValueError, match="INFLIGHTLLM_DUMMY_STEP_MS='-1': give milliseconds a dummy step waits"):
        step_seconds()
