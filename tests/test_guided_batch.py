"""Batched grammar advance (inflightllm.guided.matcher.advance_batch / fill_masks): the
engine accepts a step's tokens and fills the next masks of all constrained rows in one
call on xgrammar's threads; the result must equal advancing each row alone."""

from __future__ import annotations

import json

import numpy as np
import pytest

xgr = pytest.importorskip("xgrammar")

from inflightllm.guided.matcher import GuidedState, advance_batch, fill_masks  # noqa: E402
from tests.guided_cases import SCHEMAS, run_to_end  # noqa: E402

VOCAB = 49152


def allowed_ids(mask: np.ndarray) -> np.ndarray:
    return np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")[:VOCAB])


def test_batched_advance_equals_one_by_one(smollm2_tokenizer):
    info = xgr.TokenizerInfo.from_huggingface(smollm2_tokenizer, vocab_size=VOCAB, stop_token_ids=[2])
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    grammars = [compiler.compile_json_schema(json.dumps(schema), any_whitespace=False) for schema in SCHEMAS[:4]]
    batch = xgr.BatchGrammarMatcher(max_threads=2)
    batched = [GuidedState(grammar, VOCAB) for grammar in grammars for _ in range(2)]
    alone = [GuidedState(grammar, VOCAB) for grammar in grammars for _ in range(2)]
    rng = np.random.default_rng(0)
    fill_masks(batched, batch)
    for _ in range(24):
        live = [i for i, state in enumerate(alone) if not state.is_terminated]
        if not live:
            break
        tokens = []
        for i in live:
            mask = alone[i].next_mask()
            assert np.array_equal(batched[i].next_mask(), mask)
            tokens.append(int(rng.choice(allowed_ids(mask))))
        tokens[0] = 0 if 0 not in allowed_ids(alone[live[0]].next_mask()) else tokens[0]  # one refused token
        advance_batch([batched[i] for i in live], tokens, batch)
        for i, token in zip(live, tokens):
            assert batched[i].accept(token) == alone[i].accept(token)  # the kept answer, not a second accept
            assert batched[i].is_terminated == alone[i].is_terminated
            if not alone[i].is_terminated:
                assert batched[i].allows_only([2]) == alone[i].allows_only([2])
                assert np.array_equal(batched[i].next_mask(), alone[i].next_mask())


def test_engine_with_mask_threads_gives_the_same_outputs(smollm2_tokenizer):
    """The engine's batched path (mask_threads > 0: the step's tokens accepted and the next
    masks filled on xgrammar's threads) against rows one by one (mask_threads 0): the same
    tokens and finish reasons, sampled and greedy, on a tiny random model; outputs validate."""
    import jsonschema

    from inflightllm.config import EngineConfig
    from inflightllm.engine import Engine
    from inflightllm.guided import json_schema_spec
    from inflightllm.model_source import ModelSpec
    from inflightllm.request import FinishReason
    from inflightllm.sampling_params import SamplingParams

    spec = ModelSpec(source="random", shape="tiny-llama3", seed=0, dtype="float32")
    prompt = smollm2_tokenizer.encode("Reply in JSON:")
    results = {}
    for threads in (0, 2):
        engine = Engine(spec, EngineConfig(max_batch_size=16, max_num_tokens=256, num_kv_blocks=128), sampler_seed=0)
        engine.grammar_compiler(tokenizer=smollm2_tokenizer).mask_threads = threads
        for index, schema in enumerate(SCHEMAS[:4]):
            for copy in range(3):
                params = SamplingParams(max_tokens=64, guided=json_schema_spec(schema), temperature=float(copy > 0),
                                        seed=index * 10 + copy)
                engine.add_request(f"s{index}-{copy}", prompt, params)
        engine.add_request("free", prompt, SamplingParams(max_tokens=16, ignore_eos=True))
        tokens, finished = run_to_end(engine)
        assert (engine.grammar_compiler().batch_matcher() is None) == (threads == 0)
        results[threads] = (tokens, finished)
    assert results[2] == results[0]
    tokens, finished = results[2]
    # Every constrained output ends with its grammar (all seen ending so): each validates.
    for index, schema in enumerate(SCHEMAS[:4]):
        for copy in range(3):
            request_id = f"s{index}-{copy}"
            assert finished[request_id] == (FinishReason.STOP, None), finished[request_id]
            jsonschema.validate(json.loads(smollm2_tokenizer.decode(tokens[request_id])), schema)
    assert len(tokens["free"]) == 16


def test_accept_in_slices_on_workers_equals_one_call(smollm2_tokenizer, monkeypatch):
    """`accept_tokens` with an executor (the step's rows in slices, one per worker and one on
    the calling thread) gives each row the answer and the state of one serial batch accept,
    refused tokens included, and keeps the rows' order."""
    from concurrent.futures import ThreadPoolExecutor

    from inflightllm.guided import matcher

    monkeypatch.setattr(matcher, "MIN_ACCEPT_SLICE", 4)
    info = xgr.TokenizerInfo.from_huggingface(smollm2_tokenizer, vocab_size=VOCAB, stop_token_ids=[2])
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    grammars = [compiler.compile_json_schema(json.dumps(schema), any_whitespace=False) for schema in SCHEMAS[:6]]
    sliced = [GuidedState(grammar, VOCAB) for grammar in grammars for _ in range(5)]
    serial = [GuidedState(grammar, VOCAB) for grammar in grammars for _ in range(5)]
    rng = np.random.default_rng(1)
    refused = 0
    with ThreadPoolExecutor(max_workers=3) as executor:
        for step in range(16):
            live = [i for i, state in enumerate(serial) if not state.is_terminated]
            tokens = [int(rng.choice(allowed_ids(serial[i].next_mask()))) for i in live]
            if step % 4 == 0:  # a token the grammar refuses, in a different slice each time
                tokens[step % len(live)] = 0 if 0 not in allowed_ids(serial[live[step % len(live)]].next_mask()) \
                    else tokens[step % len(live)]
            got = matcher.accept_tokens([sliced[i].matcher for i in live], tokens, executor)
            want = [serial[i].accept(token) for i, token in zip(live, tokens)]
            assert got == want
            refused += want.count(False)
            for i in live:
                sliced[i]._filled = False
                assert sliced[i].is_terminated == serial[i].is_terminated
                if not serial[i].is_terminated:
                    assert np.array_equal(sliced[i].next_mask(), serial[i].next_mask())
    assert refused >= 1


def test_pool_remakes_its_batch_matcher_and_workers_when_mask_threads_changes(tmp_path):
    from inflightllm.guided.compiler import GrammarCompilerPool

    pool = GrammarCompilerPool(tmp_path, VOCAB, [2], compile_threads=1)
    try:
        pool.mask_threads = 0
        assert pool.batch_matcher() is None and pool.accept_executor() is None
        pool.mask_threads = 1
        assert pool.batch_matcher() is not None and pool.accept_executor() is None
        pool.mask_threads = 4
        first, executor = pool.batch_matcher(), pool.accept_executor()
        assert executor._max_workers == 3 and pool.batch_matcher() is first and pool.accept_executor() is executor
        pool.mask_threads = 2
        assert pool.batch_matcher() is not first and pool.accept_executor()._max_workers == 1
    finally:
        pool.close()


def test_masks_filled_in_a_reused_ring_stay_each_rows_own(smollm2_tokenizer):
    """`fill_masks` with a `BitmaskRing` of depth 2 (its arrays reused every other fill):
    rows that sit out several steps (not sampled, e.g. preempted) keep their own masks when
    the array they were filled in is reused, and every row equals a row advanced alone."""
    from inflightllm.guided.matcher import BitmaskRing

    info = xgr.TokenizerInfo.from_huggingface(smollm2_tokenizer, vocab_size=VOCAB, stop_token_ids=[2])
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    grammars = [compiler.compile_json_schema(json.dumps(schema), any_whitespace=False) for schema in SCHEMAS[:4]]
    batch = xgr.BatchGrammarMatcher(max_threads=2)
    ring = BitmaskRing(depth=2)
    ringed = [GuidedState(grammar, VOCAB) for grammar in grammars for _ in range(3)]
    alone = [GuidedState(grammar, VOCAB) for grammar in grammars for _ in range(3)]
    rng = np.random.default_rng(2)
    fill_masks(ringed, batch, ring)
    detached = 0
    for step in range(20):
        live = [i for i, state in enumerate(alone) if not state.is_terminated]
        if not live:
            break
        moving = [i for i in live if rng.random() < 0.6] or live[:1]  # the others sit this step out
        tokens = [int(rng.choice(allowed_ids(alone[i].next_mask()))) for i in moving]
        advance_batch([ringed[i] for i in moving], tokens, batch, ring=ring)
        for i, token in zip(moving, tokens):
            assert ringed[i].accept(token) == alone[i].accept(token)
        detached += sum(ringed[i]._rows.shape[0] == 1 for i in live)
        for i in live:
            if not alone[i].is_terminated:
                assert np.array_equal(ringed[i].next_mask(), alone[i].next_mask()), (step, i)
    assert detached >= 1  # some row's array was reused while it sat out
