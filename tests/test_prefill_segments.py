"""The prefill attention's split of a step into calls (no GPU): runs of whole prompts of one
length, from backend.PREFILL_CUDNN_MIN_LEN tokens and a multiple of PREFILL_CUDNN_ALIGN, go to
cuDNN as one dense batch, everything else (later chunks, prefix-cache hits, short or unaligned
prompts) to flash varlen; the setting that moves the threshold, and the host lengths the
metadata carries for it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from inflightllm.attention.base import SequenceSlice
from inflightllm.attention.cuda import backend
from inflightllm.attention.cuda.backend import CudaPagedAttention, plan_prefill_segments


def test_runs_of_equal_whole_prompts_are_dense():
    q = [2048, 2048, 2048, 1948]  # the last prompt cut by the token budget: a first chunk
    c = [2048, 2048, 2048, 2048]
    assert plan_prefill_segments(q, c, 512) == [(0, 3, 2048), (3, 1, 0)]


def test_a_length_change_starts_a_new_dense_run():
    q = [1024, 1024, 2048, 2048, 2048, 768]
    assert plan_prefill_segments(q, q, 512) == [(0, 2, 1024), (2, 3, 2048), (5, 1, 768)]


def test_lengths_off_the_alignment_stay_varlen():
    assert backend.PREFILL_CUDNN_ALIGN == 128
    q = [2048, 2048, 2100, 700, 640]
    assert plan_prefill_segments(q, q, 512) == [(0, 2, 2048), (2, 2, 0), (4, 1, 640)]
    assert plan_prefill_segments(q, q, 512, align=1) == [(0, 2, 2048), (2, 1, 2100), (3, 1, 700), (4, 1, 640)]


def test_unaligned_whole_prompts_are_padded_alone_when_asked():
    q = [2048, 2048, 1920, 1900, 700, 640, 640, 333, 400]
    c = [2048, 2048, 1920, 1900, 700, 640, 640, 900, 400]
    assert plan_prefill_segments(q, c, 512, pad=128) == [
        (0, 2, 2048), (2, 1, 1920), (3, 1, 1920), (4, 1, 768), (5, 2, 640), (7, 2, 0)]
    # padded runs of one never merge, not even with an equal neighbour or with each other
    assert plan_prefill_segments([1900, 1920, 1910], [1900, 1920, 1910], 512, pad=512) == [
        (0, 1, 2048), (1, 1, 1920), (2, 1, 2048)]
    # off (pad 0): unaligned prompts stay varlen, as before
    assert plan_prefill_segments(q, c, 512) == [(0, 2, 2048), (2, 1, 1920), (3, 2, 0), (5, 2, 640), (7, 2, 0)]


def test_chunks_prefix_hits_and_short_prompts_stay_varlen_together():
    q = [100, 200, 333, 640, 640, 7]
    c = [100, 1200, 900, 640, 640, 7]
    # 100: a whole prompt under the threshold; 200 of 1200: a later chunk; 333 of 900: a prefix hit
    assert plan_prefill_segments(q, c, 512) == [(0, 3, 0), (3, 2, 640), (5, 1, 0)]


def test_every_prefill_falls_in_exactly_one_segment():
    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(1, 12))
        q = rng.choice([1, 7, 512, 600, 2048], size=n)
        c = q + rng.choice([0, 0, 0, 64], size=n)
        segments = plan_prefill_segments(q, c, 512, align=1)
        padded_segments = plan_prefill_segments(q, c, 512, align=128, pad=256)
        assert [i for first, count, _ in padded_segments for i in range(first, first + count)] == list(range(n))
        for first, count, length in padded_segments:
            if length and q[first] != length:  # padded: one whole unaligned prompt, rounded up
                assert count == 1 and q[first] == c[first] >= 512 and q[first] % 128 and length % 256 == 0
                assert length - 256 < q[first] < length
        covered = [i for first, count, _ in segments for i in range(first, first + count)]
        assert covered == list(range(n))
        for first, count, length in segments:
            if length:
                assert all(q[i] == c[i] == length >= 512 for i in range(first, first + count))
            else:
                assert not any(q[i] == c[i] >= 512 for i in range(first, first + count))
        # neighbours of one kind and length merge: no two adjacent segments alike
        assert all(a[2] != b[2] for a, b in zip(segments, segments[1:]))


def test_threshold_zero_or_nothing_to_plan():
    assert plan_prefill_segments([2048, 2048], [2048, 2048], 0) == [(0, 2, 0)]
    assert plan_prefill_segments([], [], 512) == []


@pytest.mark.parametrize("name, attribute, default, value, bad, refusal", [
    ("INFLIGHTLLM_PREFILL_CUDNN_MIN_LEN", "prefill_cudnn_min_len", 512, 0, "many",
     r"INFLIGHTLLM_PREFILL_CUDNN_MIN_LEN='many': give the shortest whole prompt"),
    ("INFLIGHTLLM_PREFILL_CUDNN_PAD", "prefill_cudnn_pad", 0, 256, "100",
     r"INFLIGHTLLM_PREFILL_CUDNN_PAD=100: give 0 \(off\) or a multiple of 128"),
], ids=["threshold", "padding"])
def test_settings_from_the_environment(monkeypatch, name, attribute, default, value, bad, refusal):
    assert (backend.PREFILL_CUDNN_MIN_LEN, backend.PREFILL_CUDNN_PAD) == (512, 0)
    monkeypatch.delenv(name, raising=False)
    assert getattr(CudaPagedAttention(32, 8, 128), attribute) == default
    monkeypatch.setenv(name, str(value))
    assert getattr(CudaPagedAttention(32, 8, 128), attribute) == value
    monkeypatch.setenv(name, bad)
    with pytest.raises(ValueError, match=refusal):
        CudaPagedAttention(32, 8, 128)


def test_build_metadata_carries_the_prefills_host_lengths():
    attention = CudaPagedAttention(4, 2, 64)
    attention.block_size = 16
    sequences = [SequenceSlice(0, 1, 40, (0, 1, 2)), SequenceSlice(1, 600, 600, tuple(range(3, 41))),
                 SequenceSlice(601, 20, 70, (41, 42, 43, 44, 45))]
    md = attention.build_metadata(sequences, "cpu")
    assert md.num_decodes == 1 and md.num_prefills == 2
    assert md.prefill_query_lens.tolist() == [600, 20]
    assert md.prefill_context_lens.tolist() == [600, 70]


def test_padded_plans_are_warmed_only_when_padding_can_run(monkeypatch):
    monkeypatch.setenv("INFLIGHTLLM_PREFILL_CUDNN_PAD", "256")
    attention = CudaPagedAttention(32, 8, 128)
    assert attention.prefill_cudnn_pad == 256
    # no cache allocated, no cuDNN (CPU): nothing to warm, and padding is left as set
    assert attention.warm_padded_prefill(16384, torch.bfloat16) == 0
    assert attention.prefill_cudnn_pad == 256


def _causal_attention(q, k, v, prompts: int, length: int, out) -> None:
    """What backend._dense computes, by torch's SDPA on the CPU: `prompts` packed prompts of
    `length` tokens each, causal, kv heads shared by their query heads."""
    h, kvh, d = q.shape[1], k.shape[1], q.shape[2]

    def heads(x, n):
        return x.reshape(prompts, length, n, d).transpose(1, 2).repeat_interleave(h // n, dim=1)

    result = torch.nn.functional.scaled_dot_product_attention(heads(q, h), heads(k, kvh), heads(v, kvh),
                                                              is_causal=True, scale=d ** -0.5)
    out.view(prompts, length, h, d).copy_(result.transpose(1, 2))


@pytest.mark.parametrize("rows, length", [(600, 640), (600, 768), (1900, 2048)])
def test_a_padded_prompt_attends_as_it_would_unpadded(rows, length):
    # _dense_padded around the dense call (cuDNN on a GPU; here the same math by SDPA): the rows
    # past the prompt, whatever the memory held, change none of its outputs.
    torch.manual_seed(rows)
    attention = CudaPagedAttention(8, 2, 64)
    seen = []

    def dense(q, k, v, prompts, length, out):
        seen.append((prompts, length, q, k, v))
        _causal_attention(q, k, v, prompts, length, out)

    attention._dense = dense
    qkv = torch.randn(rows, (8 + 2 * 2) * 64, dtype=torch.float64)  # a fused projection: strided views
    q = qkv[:, : 8 * 64].view(rows, 8, 64)
    k = qkv[:, 8 * 64 : 10 * 64].view(rows, 2, 64)
    v = qkv[:, 10 * 64 :].view(rows, 2, 64)
    out = torch.full((rows, 8, 64), float("nan"), dtype=torch.float64)
    attention._dense_padded(q, k, v, length, out)
    expected = torch.empty(rows, 8, 64, dtype=torch.float64)
    _causal_attention(q.contiguous(), k.contiguous(), v.contiguous(), 1, rows, expected)
    assert not out.isnan().any()
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    [(prompts, padded_length, pq, pk, pv)] = seen
    assert (prompts, padded_length) == (1, length)
    for padded, original in ((pq, q), (pk, k), (pv, v)):  # the prompt's rows, then zeros (finite under the mask)
        assert padded.shape[0] == length and padded.is_contiguous()
        assert torch.equal(padded[:rows], original) and not padded[rows:].any()
