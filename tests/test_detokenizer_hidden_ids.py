"""Streamed text equals the whole decode when the model generates ids the decode hides.

The bug these tests pin down (seen on an H200 with Llama-3-8B's shape, 128,256 ids, and
SmolLM2's tokenizer of 49,152): the decode shows nothing for a special token (skipped)
nor for an id beyond the tokenizer's vocabulary, and joins the bytes on either side of
them. An earlier piece that ended inside a multi-byte character held that character
back; when eight hidden ids followed, the engine's context window (eight generated
tokens) no longer reached the character's first bytes, and the piece that completed
(or broke) it lost them: `...ä¼` + 8 hidden + `ethics` streamed as "ethics", while the
whole decode is "\ufffdethics".

The engine now (1) never samples an id beyond the tokenizer's vocabulary (its logits are
-inf), and (2) sends as context the last CONTEXT_WINDOW tokens that the decode shows,
hidden ones left out (`inflightllm.detokenizer.context_window`).
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from inflightllm.config import EngineConfig
from inflightllm.detokenizer import CONTEXT_WINDOW, decode_pieces, decode_text
from inflightllm.engine import Engine, coalesce_outputs
from inflightllm.model_source import DEFAULT_MODEL, prepare
from inflightllm.sampling_params import SamplingParams
from tests.stub_model import StubRunner

TOKENIZER_VOCAB = 49152  # SmolLM2's tokenizer
MODEL_VOCAB = 128256  # Llama 3's
IM_START, IM_END = 1, 2
INCOMPLETE_CJK = 29836  # 'ä¼': the first two bytes (E4 BC) of a three-byte character
ETHICS = 40659  # 'ethics'
PROMPT = [28, 29, 30]


def scripted_engine(script: list[int]) -> Engine:
    """The real Engine over a stub model that generates `script`, with SmolLM2's
    tokenizer files in the model folder (the vocabulary the detokenizer uses)."""

    def model(tokens: list[int]) -> int:
        return script[len(tokens) - len(PROMPT)]

    loaded = SimpleNamespace(
        arch=SimpleNamespace(vocab_size=MODEL_VOCAB, max_position_embeddings=4096),
        eos_token_ids=frozenset(),
        folder=prepare(DEFAULT_MODEL),
    )
    return Engine(DEFAULT_MODEL, EngineConfig(num_kv_blocks=64, block_size=4, max_input_length=64),
                  loaded=loaded, runner=StubRunner(64, 4, model))


def streamed_outputs(engine: Engine, num_tokens: int) -> list:
    engine.add_request("r", PROMPT, SamplingParams(max_tokens=num_tokens, ignore_eos=True), streaming=True)
    outputs = []
    while engine.has_unfinished():
        outputs.extend(engine.step())
    return outputs


def coalesced(outputs: list, rng: random.Random) -> list:
    """Consecutive outputs merged as the response sender merges them when a stream has
    fallen behind (`coalesce_outputs`): groups of 1 to 6."""
    groups, index = [], 0
    while index < len(outputs):
        size = rng.choice([1, 1, 2, 3, 6])
        groups.append(coalesce_outputs(outputs[index : index + size]))
        index += size
    return groups


def streamed_text(tokenizer, outputs: list) -> str:
    pieces = [(o.context_ids, o.new_token_ids, o.finished) for o in outputs]
    return "".join(decode_pieces(tokenizer, pieces))


@pytest.mark.parametrize("hidden", [IM_END, 100000], ids=["special-token", "beyond-the-tokenizer"])
def test_a_character_held_back_across_a_window_of_hidden_ids_is_not_lost(smollm2_tokenizer, hidden):
    script = [INCOMPLETE_CJK, *[hidden] * CONTEXT_WINDOW, ETHICS]
    outputs = streamed_outputs(scripted_engine(script), len(script))
    ids = [t for o in outputs for t in o.new_token_ids]
    assert ids == script
    assert decode_text(smollm2_tokenizer, ids) == "\ufffdethics"
    assert streamed_text(smollm2_tokenizer, outputs) == "\ufffdethics"


@pytest.mark.parametrize("hidden", [IM_START, 100000], ids=["special-token", "beyond-the-tokenizer"])
def test_a_character_completed_across_hidden_ids_streams_whole(smollm2_tokenizer, hidden):
    """E4 BC | 12 hidden | a continuation byte: the whole decode joins the bytes."""
    third_byte = next(i for i in range(1000) if len(smollm2_tokenizer.convert_ids_to_tokens(i)) == 1
                      and len(decode_text(smollm2_tokenizer, [INCOMPLETE_CJK, i])) == 1
                      and "\ufffd" not in decode_text(smollm2_tokenizer, [INCOMPLETE_CJK, i]))
    script = [INCOMPLETE_CJK, *[hidden] * 12, third_byte, ETHICS]
    outputs = streamed_outputs(scripted_engine(script), len(script))
    whole = decode_text(smollm2_tokenizer, script)
    assert "\ufffd" not in whole  # the three bytes form one character
    assert streamed_text(smollm2_tokenizer, outputs) == whole


def random_hidden_heavy_ids(rng: random.Random, tokenizer, length: int) -> list[int]:
    """Byte tokens (characters split across tokens), ordinary tokens, and runs of hidden
    ids (special tokens, ids beyond the tokenizer) up to 12 long."""
    byte_ids = [i for i in range(1000) if len(tokenizer.convert_ids_to_tokens(i)) == 1]
    ids: list[int] = []
    while len(ids) < length:
        kind = rng.random()
        if kind < 0.35:
            ids.append(rng.choice(byte_ids))
        elif kind < 0.6:
            ids.append(rng.randrange(17, TOKENIZER_VOCAB))
        else:
            run = rng.randint(1, 12)
            ids.extend(rng.choice([rng.randrange(0, 17), rng.randrange(TOKENIZER_VOCAB, MODEL_VOCAB)])
                       for _ in range(run))
    return ids[:length]


def test_random_streams_with_hidden_ids_equal_the_whole_decode(smollm2_tokenizer):
    rng = random.Random(20240607)
    mismatches = []
    for trial in range(40):
        script = random_hidden_heavy_ids(rng, smollm2_tokenizer, 96)
        outputs = streamed_outputs(scripted_engine(script), len(script))
        whole = decode_text(smollm2_tokenizer, script)
        for merged in (outputs, coalesced(outputs, rng)):
            if streamed_text(smollm2_tokenizer, merged) != whole:
                mismatches.append(trial)
    assert mismatches == []


@pytest.fixture(scope="module")
def wide_vocab_engine():
    """A tiny random-weight Llama-3 shape with Llama 3's 128,256 ids and SmolLM2's
    tokenizer of 49,152: the H200 profile's mismatch in miniature, on CPU."""
    from inflightllm.model_source import ModelSpec
    from inflightllm.models import shapes

    config = shapes.shape_config("tiny-llama3")
    config.update(vocab_size=MODEL_VOCAB, hidden_size=64, intermediate_size=128, head_dim=16)
    patch = pytest.MonkeyPatch()
    patch.setitem(shapes.SHAPES, "test-tiny-llama3-wide-vocab", config)
    try:
        spec = ModelSpec(source="random", shape="test-tiny-llama3-wide-vocab", seed=3)
        yield Engine(spec, EngineConfig(num_kv_blocks=256, block_size=16, max_input_length=64), sampler_seed=0)
    finally:
        patch.undo()


def test_the_engine_never_samples_ids_beyond_the_tokenizer(wide_vocab_engine, smollm2_tokenizer):
    engine = wide_vocab_engine
    prompts = [smollm2_tokenizer.encode(text) for text in ("Hello", "The capital of France", "你好，世界", "😀")]
    for index, prompt in enumerate(prompts):
        greedy = SamplingParams(max_tokens=48, ignore_eos=True)
        sampled = SamplingParams(max_tokens=48, ignore_eos=True, temperature=1.0, seed=index)
        engine.add_request(f"g{index}", prompt, greedy, streaming=True)
        engine.add_request(f"s{index}", prompt, sampled, streaming=True)
    outputs: dict[str, list] = {}
    while engine.has_unfinished():
        for output in engine.step():
            outputs.setdefault(output.request_id, []).append(output)
    assert len(outputs) == 2 * len(prompts)
    rng = random.Random(0)
    for request_outputs in outputs.values():
        ids = [t for o in request_outputs for t in o.new_token_ids]
        assert len(ids) == 48
        assert max(ids) < TOKENIZER_VOCAB
        whole = decode_text(smollm2_tokenizer, ids)
        assert streamed_text(smollm2_tokenizer, request_outputs) == whole
        assert streamed_text(smollm2_tokenizer, coalesced(request_outputs, rng)) == whole


def test_logits_beyond_the_tokenizer_are_minus_infinity(wide_vocab_engine):
    import torch

    model = wide_vocab_engine.loaded.model
    logits = model.compute_logits(torch.randn(3, 64))  # [3, 128256]
    assert logits.shape == (3, MODEL_VOCAB)
    assert bool(torch.isfinite(logits[:, :TOKENIZER_VOCAB]).all())
    assert bool((logits[:, TOKENIZER_VOCAB:] == float("-inf")).all())
