"""Structured output on the GPU engine: the masks applied to the device logits (after a
CUDA graph's replay, on 16-bit logits when every row is greedy), with asynchronous
scheduling (masks filled after the launch) and without. Every constrained output must
parse and validate; unconstrained rows in the batch still finish normally."""

from __future__ import annotations

import json
import re

import pytest

pytestmark = pytest.mark.gpu
# The air-gapped GPU host gets these from the bundle's part 2 (tools/bundle.py, component "guided").
jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is not installed (the GPU bundle's part 2 carries it)")
pytest.importorskip("xgrammar", reason="xgrammar is not installed (the GPU bundle's part 2 carries it)")

from inflightllm.engine import Engine  # noqa: E402
from inflightllm.guided import GuidedSpec, json_schema_spec  # noqa: E402
from inflightllm.model_source import DEFAULT_MODEL, load_tokenizer  # noqa: E402
from inflightllm.request import FinishReason  # noqa: E402
from inflightllm.sampling_params import SamplingParams  # noqa: E402
from tests.gpu.test_gpu_engine import gpu_config, model_spec  # noqa: E402
from tests.guided_cases import GRAMMARS, REGEXES, SCHEMAS, run_to_end  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer():
    try:
        return load_tokenizer(DEFAULT_MODEL)
    except Exception as error:  # noqa: BLE001 - no prepared SmolLM2: no vocabulary to compile for
        pytest.skip(f"SmolLM2's tokenizer is not available: {error}")


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_constrained_rows_validate_on_the_gpu(tokenizer, async_scheduling, dtype):
    spec = model_spec(dtype)
    engine = Engine(spec, gpu_config(async_scheduling=async_scheduling), sampler_seed=0)
    engine.grammar_compiler(tokenizer=tokenizer)
    assert engine._defer_masks is async_scheduling
    prompt = tokenizer.encode("Reply:")
    checks = {}
    for index, schema in enumerate(SCHEMAS):
        checks[f"s{index}"] = (json_schema_spec(schema), lambda text, schema=schema: jsonschema.validate(
            json.loads(text), schema))
    for index, regex in enumerate(REGEXES):
        checks[f"r{index}"] = (GuidedSpec("regex", regex), lambda text, regex=regex: re.fullmatch(regex, text) or 1 / 0)
    for index, (grammar, regex) in enumerate(GRAMMARS):
        checks[f"g{index}"] = (GuidedSpec("grammar", grammar),
                               lambda text, regex=regex: re.fullmatch(regex, text) or 1 / 0)
    for name, (guided, _) in checks.items():
        engine.add_request(name, prompt, SamplingParams(max_tokens=128, guided=guided))
        engine.add_request(name + "-t", prompt, SamplingParams(max_tokens=128, guided=guided, temperature=1.0, seed=1))
    for index in range(4):
        engine.add_request(f"free{index}", prompt, SamplingParams(max_tokens=16, temperature=index * 0.5, seed=index))
    tokens, finished = run_to_end(engine)
    failures = []
    for name, (_, check) in checks.items():
        for request_id in (name, name + "-t"):
            text = tokenizer.decode(tokens.get(request_id, []))
            reason, error = finished[request_id]
            try:
                assert error is None and reason is FinishReason.STOP, (reason, error)
                check(text)
            except Exception as failure:  # noqa: BLE001 - report every bad case at once
                failures.append(f"{request_id}: {text!r}: {failure!r}")
    assert not failures, "\n".join(failures)
    for index in range(4):
        assert finished[f"free{index}"] == (FinishReason.LENGTH, None) or finished[f"free{index}"][0] is FinishReason.STOP
