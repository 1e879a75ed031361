"""The CPU-checkable parts of the GPU micro-benchmarks: perf/bench_overlap.py's half-batch
metadata and perf/bench_gemm.py's refusal of unknown variants (the GPU runs themselves are
recorded in docs/PERFORMANCE.md)."""

from __future__ import annotations

import subprocess
import sys

import torch

from inflightllm.attention.base import SequenceSlice
from inflightllm.attention.cuda.backend import CudaPagedAttention
from inflightllm.profile import REPO_ROOT
from perf.bench_overlap import rows_of


def test_rows_of_gives_each_half_its_own_decode_metadata():
    backend = CudaPagedAttention(num_heads=4, num_kv_heads=2, head_dim=64)
    backend.block_size = 16
    sequences = [SequenceSlice(query_start=i, query_len=1, context_len=10 + 7 * i,
                               block_table=(3 * i, 3 * i + 1, 3 * i + 2)) for i in range(6)]
    whole = backend.build_metadata(sequences, "cpu")
    second = rows_of(whole, 2, 6)
    assert (second.num_decodes, second.num_prefills, second.num_decode_tokens) == (4, 0, 4)
    assert second.num_tokens == 4 and second.num_seqs == 4
    # the same rows, as if the four sequences had been packed on their own
    alone = backend.build_metadata(
        [SequenceSlice(i, 1, s.context_len, s.block_table) for i, s in enumerate(sequences[2:])], "cpu"
    )
    for name in ("slot_mapping", "positions", "block_tables", "context_lens", "query_start_loc"):
        assert torch.equal(getattr(second, name), getattr(alone, name)), name
    first = rows_of(whole, 0, 2)
    assert first.query_start_loc.tolist() == [0, 1, 2]
    assert first.context_lens.tolist() == [10, 17]


def test_bench_gemm_names_its_variants_when_given_an_unknown_one():
    result = subprocess.run(
        [sys.executable, "-m", "perf.bench_gemm", "--variants", "lt,fp8"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2
    assert "--variants: unknown ['fp8']; allowed: lt, wt" in result.stderr


def test_bench_fp8_gemm_transposed_recipe_computes_the_same_product():
    # row-t is `row` as out^T = W x^T: the same e4m3 operands and scales, so the same numbers.
    from perf.bench_fp8_gemm import _one_gemm, gemm_fn

    torch.manual_seed(3)
    row = _one_gemm("row", 48, 80, 96, "cpu")()
    torch.manual_seed(3)
    transposed = _one_gemm("row-t", 48, 80, 96, "cpu")()
    assert transposed.shape == (80, 48)
    assert torch.equal(row, transposed.t())
    assert row.abs().max() > 0
    # --copies: each call takes the next set of operands, round and round.
    torch.manual_seed(4)
    rotating = gemm_fn("row", 16, 32, 64, "cpu", copies=3)
    outs = [rotating() for _ in range(4)]
    assert not torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[3])


def test_bench_fp8_gemm_split_k_recipes_sum_the_slices_to_the_same_product():
    # row-k2/row-k4 split K into slices whose bf16 partial products are summed: `row` within the
    # rounding of the partials (on the CPU one _scaled_mm a slice; on the GPU one grouped GEMM).
    from inflightllm.gpu.fp8_split_k import weight_slices
    from perf.bench_fp8_gemm import _one_gemm, packed_slices

    torch.manual_seed(3)
    row = _one_gemm("row", 48, 80, 128, "cpu")().float()
    for recipe in ("row-k2", "row-k4"):
        torch.manual_seed(3)
        split = _one_gemm(recipe, 48, 80, 128, "cpu")().float()
        assert split.shape == (48, 80)
        assert (split - row).abs().max() <= row.abs().max() / 64, recipe
    # The `copies` layout: slice i of the weights is their columns i*k/p.., a contiguous
    # column-major block of its own.
    w = torch.arange(6 * 64, dtype=torch.float32).reshape(6, 64)
    views, _ = weight_slices(w, torch.ones(1, 6), 4)
    packed = packed_slices(views)
    assert packed.shape == (4, 16, 6) and packed.stride() == (96, 1, 16)
    assert torch.equal(packed[2], w[:, 32:48].t()) and torch.equal(packed, views)
    assert packed.data_ptr() != w.data_ptr()
