"""Structured output in the engine's batch (inflightllm.guided) on SmolLM2-135M, CPU.

One engine run holds every case of tests/guided_cases.py twice (greedy, and sampled with
a seed) beside unconstrained requests: each constrained output must parse and validate
(`jsonschema`, `re.fullmatch`), and the unconstrained outputs must equal a run without the
constrained rows. Smaller runs check the queue while compiling, errors, min_tokens, stop
words, preemption and asynchronous scheduling."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from inflightllm.config import EngineConfig
from inflightllm.engine import Engine
from inflightllm.guided import GuidedSpec, choice_spec, json_schema_spec
from inflightllm.guided.matcher import apply_token_bitmask
from inflightllm.model_source import DEFAULT_MODEL
from inflightllm.request import FinishReason
from inflightllm.sampling_params import InvalidRequestError, SamplingParams
from tests.guided_cases import GRAMMARS, REGEXES, SCHEMAS

pytestmark = pytest.mark.slow
MAX_TOKENS = 64


def make_engine(loaded, tokenizer, **overrides) -> Engine:
    values = dict(max_batch_size=160, max_num_tokens=2048, kv_cache_bytes=512 << 20)
    values.update(overrides)
    engine = Engine(DEFAULT_MODEL, EngineConfig(**values), sampler_seed=0, loaded=loaded)
    engine.grammar_compiler(tokenizer=tokenizer)
    return engine


def run(engine: Engine, requests: list[tuple[str, list[int], SamplingParams]]) -> dict[str, tuple[list[int], FinishReason, str | None]]:
    """Add every request, step to the end; request id -> (tokens, finish reason, error)."""
    for request_id, prompt, params in requests:
        engine.add_request(request_id, prompt, params)
    results = {}
    while engine.has_unfinished():
        for output in engine.step():
            tokens, _, _ = results.setdefault(output.request_id, ([], FinishReason.NONE, None))
            tokens.extend(output.new_token_ids)
            if output.finished:
                results[output.request_id] = (tokens, output.finish_reason, output.error)
    return results


def prompt_ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text)


def cases():
    """(name, spec, check(text) -> None raising on a bad output, prompt)."""
    out = []
    for index, schema in enumerate(SCHEMAS):
        def check(text, schema=schema):
            jsonschema.validate(json.loads(text), schema)
        out.append((f"schema{index}", json_schema_spec(schema), check, "Reply in JSON:"))
    for index, regex in enumerate(REGEXES):
        def check(text, regex=regex):
            assert re.fullmatch(regex, text), f"{text!r} does not match {regex!r}"
        out.append((f"regex{index}", GuidedSpec("regex", regex), check, "Answer:"))
    for index, (grammar, regex) in enumerate(GRAMMARS):
        def check(text, regex=regex):
            assert re.fullmatch(regex, text), f"{text!r} does not match {regex!r}"
        out.append((f"grammar{index}", GuidedSpec("grammar", grammar), check, "Write it:"))
    return out


UNCONSTRAINED = [
    ("free-greedy", "The capital of France is", SamplingParams(max_tokens=24)),
    ("free-sampled", "Once upon a time", SamplingParams(max_tokens=24, temperature=0.9, seed=7)),
]


@pytest.fixture(scope="module")
def batch_results(smollm2_loaded, smollm2_tokenizer):
    """The big batch: every case greedy and sampled, plus the unconstrained rows."""
    requests = []
    for name, spec, _, text in cases():
        ids = prompt_ids(smollm2_tokenizer, text)
        requests.append((f"{name}-greedy", ids, SamplingParams(max_tokens=MAX_TOKENS, guided=spec)))
        requests.append((f"{name}-sampled", ids, SamplingParams(
            max_tokens=MAX_TOKENS, temperature=0.8, top_p=0.95, seed=11, guided=spec)))
    for request_id, text, params in UNCONSTRAINED:
        requests.append((request_id, prompt_ids(smollm2_tokenizer, text), params))
    engine = make_engine(smollm2_loaded, smollm2_tokenizer)
    results = run(engine, requests)
    return results, engine


def test_every_constrained_output_parses_and_validates(batch_results, smollm2_tokenizer):
    results, engine = batch_results
    assert engine.grammar_compiler().num_compiled == len(cases())  # one compile per distinct grammar
    failures = []
    for name, _, check, _ in cases():
        for mode in ("greedy", "sampled"):
            tokens, reason, error = results[f"{name}-{mode}"]
            text = smollm2_tokenizer.decode(tokens)
            try:
                assert error is None, error
                assert reason is FinishReason.STOP, f"finished by {reason.name} after {len(tokens)} tokens"
                check(text)
            except Exception as failure:  # collect them all: one report names every bad case
                failures.append(f"{name}-{mode}: {text!r}: {failure}")
    assert not failures, "\n".join(failures)


def test_unconstrained_neighbours_are_unchanged(batch_results, smollm2_loaded, smollm2_tokenizer):
    results, _ = batch_results
    alone = run(make_engine(smollm2_loaded, smollm2_tokenizer),
                [(rid, prompt_ids(smollm2_tokenizer, text), params) for rid, text, params in UNCONSTRAINED])
    for request_id, _, _ in UNCONSTRAINED:
        assert results[request_id][0] == alone[request_id][0], request_id
        assert results[request_id][1] == alone[request_id][1]
        assert len(alone[request_id][0]) == 24


def test_request_waits_in_queue_while_compiling(smollm2_loaded, smollm2_tokenizer):
    engine = make_engine(smollm2_loaded, smollm2_tokenizer)
    params = SamplingParams(max_tokens=8, guided=choice_spec(["alpha", "beta"]))
    request = engine.add_request("c", prompt_ids(smollm2_tokenizer, "Pick:"), params)
    assert request not in engine.scheduler.waiting and request not in engine.scheduler.running
    assert engine.num_waiting == 1 and engine.has_unfinished()
    results = {}
    while engine.has_unfinished():
        for output in engine.step():
            results.setdefault(output.request_id, []).extend(output.new_token_ids)
    assert smollm2_tokenizer.decode(results["c"]) in ("alpha", "beta")


@pytest.mark.parametrize(
    "spec, field",
    [
        (GuidedSpec("json_schema", '{"type": "objec"}'), "guided_json"),
        (json_schema_spec({"type": "object", "properties": {"a": {"type": "string", "format": "bogus"}}}), "guided_json"),
        (json_schema_spec({"type": "integer", "multipleOf": 3}), "guided_json"),
        (GuidedSpec("regex", "(ab"), "guided_regex"),
        (GuidedSpec("grammar", "root ::= missing"), "guided_grammar"),
        (GuidedSpec("choice", "[]"), "guided_choice"),
    ],
)
def test_bad_constraint_is_refused_naming_the_field(smollm2_loaded, smollm2_tokenizer, spec, field):
    engine = make_engine(smollm2_loaded, smollm2_tokenizer)
    with pytest.raises(InvalidRequestError, match=f"^{field}: "):
        engine.add_request("bad", [1, 2, 3], SamplingParams(guided=spec))
    assert not engine.has_unfinished()


def test_bad_schema_in_a_burst_fails_alone(smollm2_loaded, smollm2_tokenizer):
    engine = make_engine(smollm2_loaded, smollm2_tokenizer)
    ids = prompt_ids(smollm2_tokenizer, "Answer:")
    engine.add_request("a", ids, SamplingParams(max_tokens=8, guided=GuidedSpec("regex", r"(yes|no)")))
    with pytest.raises(InvalidRequestError, match="^guided_json: the schema is not valid JSON|^guided_json: "):
        engine.add_request("b", ids, SamplingParams(guided=GuidedSpec("json_schema", "{not json")))
    engine.add_request("c", ids, SamplingParams(max_tokens=8, guided=json_schema_spec({"type": "boolean"})))
    results = run(engine, [("d", ids, SamplingParams(max_tokens=4))])
    assert sorted(results) == ["a", "c", "d"]
    assert smollm2_tokenizer.decode(results["a"][0]) in ("yes", "no")
    assert smollm2_tokenizer.decode(results["c"][0]) in ("true", "false")
    assert results["d"][1] is FinishReason.LENGTH and len(results["d"][0]) == 4


def test_schema_only_the_meta_schema_refuses_fails_its_request_alone(smollm2_loaded, smollm2_tokenizer):
    """A schema that parses and compiles but is not a valid JSON Schema (a boolean property
    whose description is a number, which xgrammar would take) passes add_request (its step-thread check skips `jsonschema`'s
    meta-schema check) and fails alone from the compile worker, naming the field and the
    place; the requests beside it finish, and a second request with it fails the same way."""
    engine = make_engine(smollm2_loaded, smollm2_tokenizer)
    ids = prompt_ids(smollm2_tokenizer, "Answer:")
    bad = json_schema_spec({"type": "object", "properties": {"a": {"type": "boolean", "description": 5}},
                            "required": ["a"]})
    results = run(engine, [("bad", ids, SamplingParams(max_tokens=8, guided=bad)),
                           ("good", ids, SamplingParams(max_tokens=8, guided=json_schema_spec({"type": "boolean"}))),
                           ("free", ids, SamplingParams(max_tokens=4)),
                           ("bad-again", ids, SamplingParams(max_tokens=8, guided=bad))])
    for request_id in ("bad", "bad-again"):
        tokens, reason, error = results[request_id]
        assert reason is FinishReason.ERROR and tokens == []
        assert error.startswith("guided_json: not a valid JSON Schema at #/properties/a/description"), error
    assert smollm2_tokenizer.decode(results["good"][0]) in ("true", "false")
    assert results["free"][1] is FinishReason.LENGTH and len(results["free"][0]) == 4


def test_compile_error_fails_only_its_request(smollm2_loaded, smollm2_tokenizer):
    engine = make_engine(smollm2_loaded, smollm2_tokenizer)
    ids = prompt_ids(smollm2_tokenizer, "Answer:")
    pool = engine.grammar_compiler()
    broken = GuidedSpec("regex", r"(no)")
    original = pool._compile

    def failing(spec):
        if spec == broken:
            raise RuntimeError("compile blew up")
        return original(spec)

    pool._compile = failing
    results = run(engine, [
        ("ok", ids, SamplingParams(max_tokens=8, guided=GuidedSpec("regex", r"(yes|maybe)"))),
        ("broken", ids, SamplingParams(max_tokens=8, guided=broken)),
        ("free", ids, SamplingParams(max_tokens=4)),
    ])
    assert results["broken"][1] is FinishReason.ERROR
    assert results["broken"][2].startswith("guided_regex: the grammar did not compile: RuntimeError: compile blew up")
    assert results["ok"][1] is FinishReason.STOP and smollm2_tokenizer.decode(results["ok"][0]) in ("yes", "maybe")
    assert results["free"][1] is FinishReason.LENGTH and len(results["free"][0]) == 4


def test_min_tokens_yields_to_a_finished_grammar(smollm2_loaded, smollm2_tokenizer):
    """min_tokens bans stop tokens; a grammar that allows nothing else ends the request
    (STOP) instead of leaving the row nothing to sample."""
    engine = make_engine(smollm2_loaded, smollm2_tokenizer)
    results = run(engine, [("m", prompt_ids(smollm2_tokenizer, "Pick:"),
                            SamplingParams(max_tokens=16, min_tokens=10, guided=choice_spec(["yes", "no"])))])
    tokens, reason, error = results["m"]
    assert error is None and reason is FinishReason.STOP
    assert smollm2_tokenizer.decode(tokens) in ("yes", "no")


def test_stop_word_inside_a_constrained_output(smollm2_loaded, smollm2_tokenizer):
    engine = make_engine(smollm2_loaded, smollm2_tokenizer)
    comma = smollm2_tokenizer.encode(",")
    spec = GuidedSpec("regex", r"[0-9]{1,2}(,[0-9]{1,2}){3}")
    results = run(engine, [("s", prompt_ids(smollm2_tokenizer, "Numbers:"),
                            SamplingParams(max_tokens=32, stop_sequences=(tuple(comma),), guided=spec))])
    tokens, reason, _ = results["s"]
    assert reason is FinishReason.STOP
    assert re.fullmatch(r"[0-9]{1,2}", smollm2_tokenizer.decode(tokens))


def constrained_batch(tokenizer, max_tokens: int = MAX_TOKENS):
    texts = ["Reply in JSON:", "Answer:", "Write it:"]
    specs = [json_schema_spec(SCHEMAS[25]), GuidedSpec("regex", REGEXES[3]), GuidedSpec("grammar", GRAMMARS[3][0])]
    requests = []
    for index, (text, spec) in enumerate(zip(texts * 2, specs * 2)):
        sampled = index >= 3
        params = SamplingParams(max_tokens=max_tokens, guided=spec, temperature=0.8 if sampled else 0.0,
                                seed=5 if sampled else None)
        requests.append((f"r{index}", tokenizer.encode(text), params))
    return requests


def test_preemption_keeps_the_grammar_state(smollm2_loaded, smollm2_tokenizer):
    requests = constrained_batch(smollm2_tokenizer, max_tokens=40)
    plenty = run(make_engine(smollm2_loaded, smollm2_tokenizer), requests)
    tight = make_engine(smollm2_loaded, smollm2_tokenizer, num_kv_blocks=6, block_size=8)
    preempted = run(tight, requests)
    assert tight.stats().num_preemptions_total > 0
    assert preempted == plenty


def async_requests(tokenizer):
    return constrained_batch(tokenizer, max_tokens=40) + [
        ("free", tokenizer.encode("Hello"), SamplingParams(max_tokens=12))]


@pytest.fixture(scope="module")
def sync_results(smollm2_loaded, smollm2_tokenizer):
    return run(make_engine(smollm2_loaded, smollm2_tokenizer), async_requests(smollm2_tokenizer))


@pytest.mark.parametrize("deferred", [True, False], ids=["masks-after-launch", "masks-in-step"])
def test_async_scheduling_gives_the_same_outputs(smollm2_loaded, smollm2_tokenizer, sync_results, deferred):
    """Asynchronous scheduling: masks filled after the launch, from the previous step's
    tokens emitted meanwhile (the CPU and GPU runners), or, for a runner that cannot wait
    for them (tensor parallel), in the step after the step in flight is resolved."""
    requests = async_requests(smollm2_tokenizer)
    sync = sync_results
    engine = make_engine(smollm2_loaded, smollm2_tokenizer, async_scheduling=True)
    assert engine._defer_masks
    engine._defer_masks = deferred
    asynchronous = run(engine, requests)
    assert asynchronous == sync
    assert all(reason is FinishReason.STOP for _, reason, _ in (sync[f"r{i}"] for i in range(6)))


def test_bitmask_application_matches_xgrammar():
    """The batched torch mask equals xgrammar's own CPU kernel, rows chosen by index, a
    vocabulary wider than the mask (padded logits) masked past its words."""
    import torch
    import xgrammar as xgr

    generator = torch.Generator().manual_seed(0)
    vocab = 128
    logits = torch.randn(5, vocab + 22, generator=generator)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (2, (vocab + 31) // 32), dtype=torch.int32, generator=generator)
    rows = torch.tensor([3, 1])
    expected = logits.clone()
    by_row = torch.full((5, bitmask.shape[1]), -1, dtype=torch.int32)  # xgrammar's layout: a mask per logits row
    by_row[3], by_row[1] = bitmask[0], bitmask[1]
    xgr.apply_token_bitmask_inplace(expected, by_row, indices=[3, 1], vocab_size=vocab)
    expected[[3, 1], 4 * 32:] = float("-inf")  # past the mask's words: not a token the grammar knows
    ours = logits.clone()
    apply_token_bitmask(ours, bitmask, rows)
    assert torch.equal(ours, expected)
    assert torch.equal(ours[[0, 2, 4]], logits[[0, 2, 4]])


def test_tensor_parallel_gets_the_masks_in_its_step(smollm2_tokenizer):
    """TP=2 on the CPU (rank 1 a worker process): every rank applies the masks sent in the
    step message; outputs equal TP=1 and follow their constraints. Random tiny weights with
    SmolLM2's vocabulary (the bounded constraints end whatever the model prefers)."""
    from inflightllm.model_source import ModelSpec

    spec = ModelSpec(source="random", shape="tiny-llama3", seed=0, dtype="float32")
    cases = [GuidedSpec("regex", REGEXES[0]), GuidedSpec("regex", REGEXES[4]), json_schema_spec(SCHEMAS[12]),
             GuidedSpec("grammar", GRAMMARS[3][0])]
    requests = [(f"t{index}", [100 + index, 200, 300], SamplingParams(max_tokens=40, guided=guided))
                for index, guided in enumerate(cases)]
    requests.append(("free", [5, 6, 7], SamplingParams(max_tokens=8, ignore_eos=True)))
    results = []
    for size in (1, 2):
        config = EngineConfig(max_batch_size=8, max_num_tokens=64, num_kv_blocks=64, tensor_parallel_size=size,
                              async_scheduling=True)
        engine = Engine(spec, config, sampler_seed=0)
        try:
            engine.grammar_compiler(tokenizer=smollm2_tokenizer)
            assert engine._defer_masks is (size == 1)
            results.append(run(engine, requests))
        finally:
            shutdown = getattr(engine.runner, "shutdown", None)
            if shutdown:
                shutdown()
    assert results[0] == results[1]
    text = {rid: smollm2_tokenizer.decode(tokens) for rid, (tokens, _, _) in results[1].items()}
    assert re.fullmatch(REGEXES[0], text["t0"]) and re.fullmatch(REGEXES[4], text["t1"])
    jsonschema.validate(json.loads(text["t2"]), SCHEMAS[12])
    assert re.fullmatch(GRAMMARS[3][1], text["t3"])
    assert all(reason is FinishReason.STOP for rid, (_, reason, _) in results[1].items() if rid != "free")
