"""The int8 LM head (`model.int8_lm_head`, inflightllm.quantization.fp8.quantize_rows_int8): the
profile key and its refusals, the quantizer's layout, the CPU model's logits of steps of up to
4 rows from the int8 copy (weight-only) while larger steps keep the 16-bit head, with 16-bit or FP8 linears, and
greedy decoding through it. The GPU's small_gemv reads the same bytes (tests/gpu/test_fp8_gpu.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from inflightllm.model_source import ModelSourceError, ModelSpec
from inflightllm.models.loader import load_model
from inflightllm.quantization.fp8 import (
    INT8_LM_HEAD_MAX_ROWS,
    linear_weight_only,
    quantize_rows_int8,
)
from tests.test_fp8_lm_head import greedy_decoding_follows_the_head

SPEC = ModelSpec(source="random", shape="tiny-llama3", seed=0, dtype="bfloat16", int8_lm_head=True)


def test_profile_key(tmp_path):
    from inflightllm.profile import ProfileError, load_profile
    from tests.test_fp8_smoothing import model_profile

    def profile(model_lines: str):
        return model_profile(tmp_path, model_lines)

    spec = profile("  int8_lm_head: true\n").model  # any weights: 16-bit here
    assert spec.int8_lm_head is True and spec.lm_head_kind() == "int8"
    assert ModelSpec.from_parameters(spec.to_parameters()) == spec
    assert profile("  quantization: fp8\n  int8_lm_head: true\n").model.lm_head_kind() == "int8"
    assert profile("  int8_lm_head: false\n").model.int8_lm_head is None
    assert "model_int8_lm_head" not in profile("").model.to_parameters()
    with pytest.raises(ProfileError, match=r"model.int8_lm_head: not with model.fp8_lm_head"):
        profile("  quantization: fp8\n  fp8_lm_head: true\n  int8_lm_head: true\n")
    with pytest.raises(ProfileError, match=r"model.int8_lm_head: .*true or false"):
        profile("  int8_lm_head: yes please\n")
    path = tmp_path / "tp.yaml"
    path.write_text("name: t\nengine:\n  max_input_length: 512\n  max_output_len: 256\n"
                    "device:\n  tensor_parallel_size: 2\n"
                    "model:\n  source: random\n  shape: tiny-llama3\n  int8_lm_head: true\n")
    with pytest.raises(ProfileError, match=r"model.int8_lm_head: the 8-bit LM head runs on one rank for now; "
                                           r"device.tensor_parallel_size is 2"):
        load_profile(path)


def test_both_heads_are_refused_at_load():
    with pytest.raises(ModelSourceError, match=r"model.fp8_lm_head and model.int8_lm_head are both set"):
        load_model(dataclasses.replace(SPEC, quantization="fp8", fp8_lm_head=True))


def test_quantize_rows_int8():
    torch.manual_seed(0)
    weight = torch.randn(64, 96, dtype=torch.bfloat16)
    weight[3] = 0  # an all-zero row quantizes to zeros, no division by zero
    weight[5, 7] = 40.0  # an outlier sets its own row's scale only
    q, scale = quantize_rows_int8(weight)
    assert q.dtype == torch.int8 and q.shape == weight.shape and scale.dtype == torch.float32 and scale.shape == (64,)
    assert int(q.abs().max()) == 127 and int(q.min()) >= -127
    assert torch.equal(q[3], torch.zeros(96, dtype=torch.int8))
    assert float(scale[5]) == pytest.approx(40.0 / 127) and float(scale[4]) < 0.05
    # each value within half a step of its row's scale
    error = (q.float() * scale[:, None] - weight.float()).abs()
    assert bool((error <= scale[:, None] / 2 + 1e-6).all())


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_steps_of_up_to_4_rows_read_the_int8_head(quantization):
    loaded = load_model(dataclasses.replace(SPEC, quantization=quantization))
    model = loaded.model
    weight_q, scale = model.lm_head_q
    assert weight_q.dtype == torch.int8 and weight_q.shape == model.lm_head.weight.shape
    assert model.lm_head.weight.dtype == torch.bfloat16  # the 16-bit head stays for larger steps
    torch.manual_seed(1)
    assert INT8_LM_HEAD_MAX_ROWS == 4
    hidden = torch.randn(INT8_LM_HEAD_MAX_ROWS + 1, loaded.arch.hidden_size, dtype=torch.bfloat16)
    for rows in (1, 3, INT8_LM_HEAD_MAX_ROWS):
        logits = model.compute_logits(hidden[:rows])
        torch.testing.assert_close(logits, linear_weight_only(hidden[:rows], weight_q, scale).float(), rtol=0, atol=0)
    one = model.compute_logits(hidden[:1])
    larger = model.compute_logits(hidden)  # 5 rows: the 16-bit head
    torch.testing.assert_close(larger, model.lm_head(hidden).float(), rtol=0, atol=0)
    assert not torch.equal(one, larger[:1])
    # the int8 head's logits stay closer to the 16-bit head's than e4m3's would (3 more bits)
    assert float((one - larger[:1]).norm() / larger[:1].norm()) < 0.02


def test_greedy_decoding_through_the_int8_head_follows_its_logits():
    greedy_decoding_follows_the_head(SPEC, torch.int8)
