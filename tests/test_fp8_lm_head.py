"""The FP8 LM head (`model.fp8_lm_head`, inflightllm.quantization.fp8): the profile key and its
refusals, the CPU model's one-token logits from the e4m3 copy (weight-only) while larger
steps keep the 16-bit head, a tied embedding left as it was, and generation through it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from inflightllm.config import EngineConfig
from inflightllm.engine import Engine
from inflightllm.llm import LLM
from inflightllm.model_source import ModelSpec
from inflightllm.models.loader import load_model
from inflightllm.quantization.fp8 import FP8_DTYPE, FP8_LM_HEAD_MAX_ROWS, linear_weight_only
from inflightllm.sampling_params import SamplingParams

SPEC = ModelSpec(source="random", shape="tiny-llama3", seed=0, dtype="bfloat16", quantization="fp8", fp8_lm_head=True)


def test_profile_key(tmp_path):
    from inflightllm.profile import ProfileError
    from tests.test_fp8_smoothing import model_profile

    def profile(model_lines: str):
        return model_profile(tmp_path, model_lines)

    spec = profile("  quantization: fp8\n  fp8_lm_head: true\n").model
    assert spec.fp8_lm_head is True
    assert ModelSpec.from_parameters(spec.to_parameters()) == spec
    assert profile("  quantization: fp8\n  fp8_lm_head: false\n").model.fp8_lm_head is None
    assert "model_fp8_lm_head" not in profile("  quantization: fp8\n").model.to_parameters()
    with pytest.raises(ProfileError, match=r"model.fp8_lm_head: only with FP8 weights"):
        profile("  fp8_lm_head: true\n")
    with pytest.raises(ProfileError, match=r"model.fp8_lm_head: .*true or false"):
        profile("  quantization: fp8\n  fp8_lm_head: 1\n")


def test_one_token_steps_read_the_e4m3_head():
    loaded = load_model(SPEC)
    model = loaded.model
    weight_q, scale = model.lm_head_q
    assert weight_q.dtype == FP8_DTYPE and weight_q.shape == model.lm_head.weight.shape
    assert model.lm_head.weight.dtype == torch.bfloat16  # the 16-bit head stays for larger steps
    torch.manual_seed(1)
    hidden = torch.randn(FP8_LM_HEAD_MAX_ROWS + 1, loaded.arch.hidden_size, dtype=torch.bfloat16)
    one = model.compute_logits(hidden[:1])
    torch.testing.assert_close(one, linear_weight_only(hidden[:1], weight_q, scale).float(), rtol=0, atol=0)
    both = model.compute_logits(hidden)
    torch.testing.assert_close(both, model.lm_head(hidden).float(), rtol=0, atol=0)
    assert not torch.equal(one, both[:1])
    # the e4m3 head's logits stay close to the 16-bit head's
    assert float((one - both[:1]).norm() / both[:1].norm()) < 0.05


def test_a_tied_embedding_keeps_its_16_bit_rows():
    spec = dataclasses.replace(SPEC, shape="smollm2-135m")
    model = load_model(spec).model
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert model.lm_head_q[0].dtype == FP8_DTYPE


def test_a_16_bit_model_refuses_the_key():
    with pytest.raises(ValueError, match=r"model.fp8_lm_head: random:tiny-llama3 is not served with FP8 weights"):
        load_model(dataclasses.replace(SPEC, quantization=None))


def greedy_decoding_follows_the_head(spec: ModelSpec, head_dtype: torch.dtype) -> None:
    """A batch-1 request's decode steps take the 8-bit head of `spec`: each generated id is the
    argmax of the weight-only logits of the step before it (recomputed here without the cache)."""
    from inflightllm.attention import SequenceSlice

    engine = Engine(spec, EngineConfig(max_num_tokens=64, num_kv_blocks=16), sampler_seed=0)
    prompt = [11, 400, 900, 33, 7]
    result = LLM(spec, engine=engine, load_tokenizer_too=False).generate(
        [prompt], [SamplingParams(max_tokens=6, ignore_eos=True)])[0]
    assert len(result.token_ids) == 6
    model = engine.loaded.model
    assert model.lm_head_q[0].dtype == head_dtype
    runner = engine.runner
    ids = prompt + result.token_ids
    for position in range(len(prompt), len(ids)):
        table = tuple(range(-(-position // runner.attention.block_size)))
        metadata = runner.attention.build_metadata(
            [SequenceSlice(query_start=0, query_len=position, context_len=position, block_table=table)], runner.device)
        hidden = model(torch.tensor(ids[:position]), runner.attention, metadata)
        logits = model.compute_logits(hidden[-1:])
        assert torch.equal(logits, linear_weight_only(hidden[-1:], *model.lm_head_q).float())
        assert int(logits.argmax()) == ids[position], position


def test_greedy_decoding_through_the_fp8_head_follows_its_logits():
    greedy_decoding_follows_the_head(SPEC, FP8_DTYPE)
