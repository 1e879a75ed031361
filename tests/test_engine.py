"""Engine with the real SmolLM2 weights: request validation, stop conditions and
hold-back, streaming cadence, abort, counters, log probs, seeds and static batching.

Greedy continuations of the prompts used here (SmolLM2-135M-Instruct, fp32 CPU):
- "The quick brown fox" -> " with a quick brown bear. \\n\\nThe ..."
  = [351, 253, 2365, 6354, 7012, 30, 198, 198, 504, 2798, ...]
- chat "Reply with one word: yes or no?" -> "Yes." EOS ... = [10539, 30, 2, 198, 2, ...]
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from inflightllm.config import EngineConfig
from inflightllm.engine import Engine, RequestOutput
from inflightllm.llm import LLM
from inflightllm.model_source import DEFAULT_MODEL
from inflightllm.request import FinishReason
from inflightllm.sampling_params import InvalidRequestError, SamplingParams

pytestmark = pytest.mark.slow

FOX = [504, 2365, 6354, 16438]  # "The quick brown fox"
FOX_GREEDY = [351, 253, 2365, 6354, 7012, 30, 198, 198, 504, 2798]
ROSES = [66, 4243, 359, 2382, 28]  # "Roses are red,"
COUNT = [33, 28, 216, 34, 28, 216, 35, 28, 216, 36, 28]  # "1, 2, 3, 4,"
EOS = 2


@pytest.fixture(scope="module")
def yes_no_prompt(smollm2_tokenizer) -> list[int]:
    text = smollm2_tokenizer.apply_chat_template(
        [{"role": "user", "content": "Reply with one word: yes or no?"}], add_generation_prompt=True, tokenize=False
    )
    return smollm2_tokenizer.encode(text)


def make_engine(loaded, sampler_seed: int = 0, model_spec=DEFAULT_MODEL, **config) -> Engine:
    config.setdefault("num_kv_blocks", 64)
    return Engine(model_spec, EngineConfig(**config), sampler_seed=sampler_seed, loaded=loaded)


def run(engine: Engine, max_steps: int = 200) -> dict[str, list[tuple[int, RequestOutput]]]:
    """Step until idle; every output with the (1-based) step that returned it, per request."""
    outputs: dict[str, list[tuple[int, RequestOutput]]] = {}
    step = 0
    while engine.has_unfinished():
        step += 1
        assert step <= max_steps, "the engine did not finish"
        for output in engine.step():
            outputs.setdefault(output.request_id, []).append((step, output))
    return outputs


def tokens(outputs: list[tuple[int, RequestOutput]]) -> list[int]:
    return [t for _, output in outputs for t in output.new_token_ids]


def final(outputs: list[tuple[int, RequestOutput]]) -> RequestOutput:
    assert [output.finished for _, output in outputs] == [False] * (len(outputs) - 1) + [True]
    return outputs[-1][1]


def test_the_expected_ids_here_are_transformers_greedy_outputs(smollm2_reference, yes_no_prompt):
    """The token ids the tests below expect are checked against `transformers`' greedy
    `generate` on the same weights, not trusted as pasted."""
    assert smollm2_reference.greedy(FOX, len(FOX_GREEDY)) == FOX_GREEDY
    assert smollm2_reference.greedy(yes_no_prompt, 8) == [10539, 30]  # "Yes." then EOS


# ---- validation -------------------------------------------------------------------

def test_add_request_validation_messages(smollm2_loaded):
    spec = dataclasses.replace(DEFAULT_MODEL, max_model_len=48)
    engine = make_engine(smollm2_loaded, model_spec=spec, num_kv_blocks=2, block_size=16, max_input_length=32,
                         max_output_len=100, priority_levels=3)
    ten = list(range(100, 110))
    cases = [
        ([], SamplingParams(), 0, "input_ids: the prompt is empty; at least 1 token is required"),
        (list(range(33)), SamplingParams(), 0,
         "input_ids: the prompt has 33 tokens; allowed: up to 32 (max_input_length)"),
        ([1, 49152, 3], SamplingParams(), 0, "input_ids: token id 49152 is out of range; allowed: 0 to 49151"),
        ([1, -1], SamplingParams(), 0, "input_ids: token id -1 is out of range; allowed: 0 to 49151"),
        (ten, SamplingParams(max_tokens=101), 0, "max_tokens: 101 is out of range; allowed: 1 to 100"),
        (ten, SamplingParams(top_p=0.0), 0,
         "top_p: 0.0 is out of range; allowed: greater than 0, up to 1 (1 = off)"),
        (ten, SamplingParams(max_tokens=4), 3, "priority: 3 is out of range; allowed: 0 to 2"),
        (ten, SamplingParams(max_tokens=4), -1, "priority: -1 is out of range; allowed: 0 to 2"),
        (ten, SamplingParams(max_tokens=39), 0,
         "max_tokens: prompt (10 tokens) + max_tokens (39) = 49 exceeds the model context of 48 tokens"),
        (ten, SamplingParams(max_tokens=23), 0,
         "max_tokens: prompt + max_tokens = 33 tokens exceeds the KV cache of 32 tokens"),
    ]
    for index, (prompt, params, priority, message) in enumerate(cases):
        with pytest.raises(InvalidRequestError) as error:
            engine.add_request(f"bad-{index}", prompt, params, priority=priority)
        assert str(error.value) == message

    engine.add_request("a", ten, SamplingParams(max_tokens=22), priority=2)  # 32 tokens: exactly fits
    with pytest.raises(InvalidRequestError) as error:
        engine.add_request("a", ten, SamplingParams(max_tokens=1))
    assert str(error.value) == "request id 'a' is already in use"
    stats = engine.stats()  # the rejected requests left no trace
    assert (stats.num_waiting, stats.num_running, stats.prompt_tokens_total) == (1, 0, 10)
    assert list(engine.requests) == ["a"]


# ---- stop conditions --------------------------------------------------------------

@pytest.fixture(scope="module")
def stop_run(smollm2_loaded, yes_no_prompt):
    """One batch of requests, each exercising a stop condition; their outputs by id."""
    engine = make_engine(smollm2_loaded)
    seqs = ((253, 6354), (6354, 7012))  # " a brown" (never completes), " brown bear" (completes)
    engine.add_request("reference", FOX, SamplingParams(max_tokens=6))
    engine.add_request("seq-streaming", FOX, SamplingParams(max_tokens=8, stop_sequences=seqs), streaming=True)
    engine.add_request("seq", FOX, SamplingParams(max_tokens=8, stop_sequences=seqs))
    engine.add_request("stop-token", FOX, SamplingParams(max_tokens=8, stop_sequences=((2365,),)), streaming=True)
    engine.add_request("end-id", FOX, SamplingParams(max_tokens=8, end_id=2365))
    engine.add_request("eos", yes_no_prompt, SamplingParams(max_tokens=8))
    engine.add_request("ignore-eos", yes_no_prompt, SamplingParams(max_tokens=5, ignore_eos=True))
    engine.add_request("min-tokens", yes_no_prompt, SamplingParams(max_tokens=5, min_tokens=4))
    engine.add_request("bad-words", FOX, SamplingParams(max_tokens=4, bad_words=((351,), (253, 2365))))
    outputs = run(engine)
    assert engine.stats().num_blocks_used == 0
    return outputs


def test_reference_greedy_output(stop_run):
    assert tokens(stop_run["reference"]) == FOX_GREEDY[:6]
    assert final(stop_run["reference"]).finish_reason is FinishReason.LENGTH


def test_multi_token_stop_sequence_ends_the_request_without_its_tokens(stop_run):
    for name in ("seq", "seq-streaming"):
        last = final(stop_run[name])
        assert last.finish_reason is FinishReason.STOP
        assert tokens(stop_run[name]) == [351, 253, 2365]  # what came before " brown bear"
        assert last.num_output_tokens == 3
    assert [(step, output.new_token_ids) for step, output in stop_run["seq"]] == [(5, [351, 253, 2365])]


def test_streaming_holds_back_tokens_that_may_start_a_stop_sequence(stop_run):
    streamed = [(step, output.new_token_ids, output.context_ids) for step, output in stop_run["seq-streaming"]]
    assert streamed == [
        (1, [351], []),
        # step 2: " a" could start " a brown": held back; step 3: " quick" releases it
        (3, [253, 2365], [351]),
        # step 4: " brown" could start " brown bear": held back; step 5: " bear" completes it
        (5, [], [351, 253, 2365]),
    ]
    assert all(6354 not in new and 7012 not in new for _, new, _ in streamed)


def test_stop_token_id_and_end_id_end_the_request_without_the_token(stop_run):
    assert [(step, output.new_token_ids) for step, output in stop_run["stop-token"]] == [
        (1, [351]), (2, [253]), (3, []),
    ]
    for name in ("stop-token", "end-id"):
        assert tokens(stop_run[name]) == [351, 253]
        assert final(stop_run[name]).finish_reason is FinishReason.STOP


def test_eos_stops_and_ignore_eos_generates_past_it(stop_run):
    assert tokens(stop_run["eos"]) == [10539, 30]  # "Yes." then EOS (not in the output)
    assert final(stop_run["eos"]).finish_reason is FinishReason.STOP
    assert tokens(stop_run["ignore-eos"]) == [10539, 30, EOS, 198, EOS]
    assert final(stop_run["ignore-eos"]).finish_reason is FinishReason.LENGTH


def test_min_tokens_keeps_generating_past_eos(stop_run):
    # EOS would come third; it is banned until 4 tokens are out.
    assert tokens(stop_run["min-tokens"]) == [10539, 30, 339, 416, 15482]  # "Yes. I can reply"
    assert final(stop_run["min-tokens"]).finish_reason is FinishReason.LENGTH


def test_bad_words_steer_greedy_decoding_with_real_logits(stop_run):
    # " with" is banned; " quick" is banned after " a": " and a rabbit is" instead.
    assert tokens(stop_run["bad-words"]) == [284, 253, 16024, 314]


# ---- streaming cadence ------------------------------------------------------------

def test_stream_interval_sends_first_token_then_every_n_then_the_rest(smollm2_loaded):
    engine = make_engine(smollm2_loaded, stream_interval=4)
    engine.add_request("s", FOX, SamplingParams(max_tokens=10), streaming=True)
    outputs = run(engine)["s"]
    out = tokens(outputs)
    assert out == FOX_GREEDY
    assert [(step, o.new_token_ids, o.context_ids, o.num_output_tokens, o.finished) for step, o in outputs] == [
        (1, out[0:1], [], 1, False),
        (5, out[1:5], out[0:1], 5, False),
        (9, out[5:9], out[0:5], 9, False),
        (10, out[9:10], out[1:9], 10, True),  # up to 8 context tokens
    ]
    assert outputs[-1][1].finish_reason is FinishReason.LENGTH


# ---- abort --------------------------------------------------------------------------

def test_abort_running_and_waiting_requests_frees_their_blocks_at_once(smollm2_loaded):
    engine = make_engine(smollm2_loaded, block_size=4, num_kv_blocks=32, max_batch_size=2)
    engine.add_request("a", FOX, SamplingParams(max_tokens=50))
    engine.add_request("b", ROSES, SamplingParams(max_tokens=50))
    engine.add_request("c", COUNT, SamplingParams(max_tokens=50))
    assert engine.step() == [] and engine.step() == []
    stats = engine.stats()
    # a: 5 tokens computed (2 blocks), b: 6 (2 blocks); c waits (max_batch_size=2).
    assert (stats.num_running, stats.num_waiting, stats.num_blocks_used) == (2, 1, 4)

    assert engine.abort("a") is True  # running
    assert engine.abort("c") is True  # waiting
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting, stats.num_blocks_used) == (1, 0, 2)  # b's blocks only
    assert engine.abort("a") is False  # already aborted
    assert engine.abort("nope") is False

    outputs = engine.step()
    assert [(o.request_id, o.finished, o.finish_reason, o.new_token_ids, o.num_output_tokens) for o in outputs] == [
        ("a", True, FinishReason.CANCELLED, FOX_GREEDY[:2], 2),
        ("c", True, FinishReason.CANCELLED, [], 0),
    ]
    assert engine.abort("b") is True
    assert engine.stats().num_blocks_used == 0
    outputs = engine.step()
    assert [(o.request_id, o.finish_reason, o.num_output_tokens) for o in outputs] == [
        ("b", FinishReason.CANCELLED, 3)
    ]
    assert not engine.has_unfinished()
    assert engine.step() == []


# ---- stats --------------------------------------------------------------------------

def test_stats_counters_of_a_small_run(smollm2_loaded):
    engine = make_engine(smollm2_loaded, block_size=4, num_kv_blocks=16, max_batch_size=1)
    engine.add_request("a", FOX, SamplingParams(max_tokens=3))
    engine.add_request("b", FOX + [351], SamplingParams(max_tokens=2))  # shares a's first block

    def snapshot():
        s = engine.stats()
        return (s.num_running, s.num_waiting, s.num_blocks_used, s.num_blocks_cached, s.num_tokens_last_step,
                s.prompt_tokens_total, s.generation_tokens_total, s.num_steps_total,
                s.prefix_cache_queries, s.prefix_cache_hits)

    #                  run wait used cached last prompt gen steps queries hits
    assert snapshot() == (0, 2, 0, 0, 0, 9, 0, 0, 0, 0)
    engine.step()  # a: prefill of 4 tokens (1 block, now cached content)
    assert snapshot() == (1, 1, 1, 0, 4, 9, 1, 1, 4, 0)
    engine.step()  # a: decode, a second block
    assert snapshot() == (1, 1, 2, 0, 1, 9, 2, 2, 4, 0)
    [output_a] = engine.step()  # a finishes: both blocks freed, the full one stays cached
    assert snapshot() == (0, 1, 0, 1, 1, 9, 3, 3, 4, 0)
    engine.step()  # b: its first 4 tokens hit the cache; prefill of 1 token
    assert snapshot() == (1, 0, 2, 0, 1, 9, 4, 4, 9, 4)
    [output_b] = engine.step()
    assert snapshot() == (0, 0, 0, 1, 1, 9, 5, 5, 9, 4)
    stats = engine.stats()
    assert (stats.num_blocks_total, stats.num_blocks_free, stats.num_preemptions_total) == (16, 16, 0)
    assert stats.prefix_cache_hit_rate == pytest.approx(4 / 9)
    assert engine.step() == [] and engine.stats().num_steps_total == 5  # an idle step is not counted

    assert (output_a.new_token_ids, output_a.num_cached_tokens) == (FOX_GREEDY[:3], 0)
    assert (output_b.new_token_ids, output_b.num_cached_tokens) == (FOX_GREEDY[1:3], 4)
    assert (output_b.num_prompt_tokens, output_b.num_output_tokens) == (5, 2)
    assert output_b.time_to_first_token <= output_b.e2e_latency and output_b.time_per_output_token >= 0


# ---- log probs ----------------------------------------------------------------------

def test_logprobs_equal_transformers_log_softmax(smollm2_loaded, smollm2_hf):
    engine = make_engine(smollm2_loaded)
    engine.add_request("greedy", FOX, SamplingParams(max_tokens=4, logprobs=True, top_logprobs=3))
    # Sampled with a penalty and a temperature: log probs are still of the model's own distribution.
    engine.add_request("sampled", FOX, SamplingParams(max_tokens=4, temperature=0.8, seed=5, repetition_penalty=1.3,
                                                       logprobs=True), streaming=True)
    outputs = run(engine)
    for name in ("greedy", "sampled"):
        out = tokens(outputs[name])
        with torch.no_grad():
            logits = smollm2_hf(torch.tensor([FOX + out[:-1]])).logits[0, len(FOX) - 1 :]  # [4, vocab]
        expected = torch.log_softmax(logits.float(), dim=-1)
        reported = [lp for _, o in outputs[name] for lp in o.new_logprobs]
        assert len(reported) == 4
        for position, token in enumerate(out):
            assert reported[position] == pytest.approx(float(expected[position, token]), abs=1e-4)
        last = final(outputs[name])
        assert last.cum_logprob == pytest.approx(sum(reported), abs=1e-5)
        if name == "greedy":
            assert out == FOX_GREEDY[:4]
            top_ids = [ids for _, o in outputs[name] for ids in o.new_top_ids]
            top_values = [values for _, o in outputs[name] for values in o.new_top_logprobs]
            assert top_ids == torch.topk(expected, 3).indices.tolist()
            assert [ids[0] for ids in top_ids] == out
            for position in range(4):
                assert top_values[position] == pytest.approx(torch.topk(expected[position], 3).values.tolist(),
                                                             abs=1e-4)
        else:
            assert all(o.new_top_ids == [] and o.new_top_logprobs == [] for _, o in outputs[name])
            # Streamed: each output's cum_logprob is the running sum so far.
            running = 0.0
            for _, o in outputs[name]:
                running += sum(o.new_logprobs)
                assert o.cum_logprob == pytest.approx(running, abs=1e-5)


# ---- seeds ------------------------------------------------------------------------

def test_seeded_sampling_is_the_same_alone_and_in_a_batch(smollm2_loaded):
    seeded = SamplingParams(max_tokens=4, temperature=1.5, seed=1234)
    alone = make_engine(smollm2_loaded, sampler_seed=0)
    alone.add_request("seeded", ROSES, seeded)
    alone_tokens = tokens(run(alone)["seeded"])

    batch = make_engine(smollm2_loaded, sampler_seed=1)
    batch.add_request("unseeded", FOX, SamplingParams(max_tokens=5, temperature=1.0))
    batch.add_request("greedy", COUNT, SamplingParams(max_tokens=3))
    batch.step()  # the seeded request joins a running batch
    batch.add_request("other-seed", ROSES, SamplingParams(max_tokens=4, temperature=1.5, seed=4321))
    batch.add_request("seeded", ROSES, seeded)
    outputs = run(batch)
    assert tokens(outputs["seeded"]) == alone_tokens
    assert alone_tokens == [702, 24281, 2040, 30]  # " like gnomes."
    assert alone_tokens != [351, 253, 2537, 8739]  # the greedy continuation " with a white rose"
    assert tokens(outputs["other-seed"]) != alone_tokens


# ---- static batching ----------------------------------------------------------------

def test_static_batching_gives_the_same_greedy_outputs_as_inflight(smollm2_loaded):
    prompts = [FOX, ROSES, COUNT]
    params = [SamplingParams(max_tokens=n) for n in (2, 4, 2)]
    results = {}
    steps = {}
    for strategy in ("inflight", "static"):
        engine = make_engine(smollm2_loaded, batching_strategy=strategy, max_batch_size=2)
        llm = LLM(DEFAULT_MODEL, engine=engine, load_tokenizer_too=False)
        results[strategy] = [(r.token_ids, r.finish_reason) for r in llm.generate(prompts, params)]
        steps[strategy] = engine.stats().num_steps_total
    assert results["static"] == results["inflight"]
    assert results["inflight"][0] == (FOX_GREEDY[:2], FinishReason.LENGTH)
    assert [len(token_ids) for token_ids, _ in results["static"]] == [2, 4, 2]
    # In-flight: the third request starts when the first finishes (step 3, done at 4).
    # Static: it waits for the whole first batch (4 steps), then runs 2 more.
    assert steps == {"inflight": 4, "static": 6}


def test_the_engine_sets_the_gc_thresholds_unless_told_not_to(monkeypatch):
    """engine.tune_gc: a new engine raises Python's GC thresholds (GC_THRESHOLDS: young
    collections took a quarter of the host time of 1,024-sequence steps); INFLIGHTLLM_GC=default
    leaves them; any other value is refused, naming the allowed ones."""
    import gc

    from inflightllm import engine as engine_module

    saved = gc.get_threshold()
    try:
        gc.set_threshold(700, 10, 10)
        monkeypatch.setenv("INFLIGHTLLM_GC", "default")
        assert engine_module.tune_gc() == (700, 10, 10)
        monkeypatch.delenv("INFLIGHTLLM_GC")
        assert engine_module.tune_gc() == engine_module.GC_THRESHOLDS
        gc.set_threshold(700, 10, 10)
        from tests.stub_model import stub_engine

        stub_engine(num_blocks=8, block_size=4)  # what a new engine does
        assert gc.get_threshold() == engine_module.GC_THRESHOLDS
        monkeypatch.setenv("INFLIGHTLLM_GC", "off")
        with pytest.raises(ValueError, match="INFLIGHTLLM_GC='off'; allowed: tuned, default"):
            engine_module.tune_gc()
    finally:
        gc.set_threshold(*saved)
