"""Cascade decode's host side (inflightllm/attention/cuda/backend.py plan_cascade) and its
merge of partials (ops.merge_partials), on the CPU. The CUDA kernels' side is checked in
tests/gpu/test_cascade_decode.py: cascade outputs equal the plain decode's."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from inflightllm.attention.cuda import ops
from inflightllm.attention.cuda.backend import (
    CASCADE_MIN_DECODE_READ_BYTES,
    CASCADE_MIN_SAVED_BYTES,
    plan_cascade,
)


def tables_of(sequences, width):
    """[len, width] int32 block tables from lists of block ids (zero padded)."""
    table = np.zeros((len(sequences), width), np.int32)
    for row, blocks in enumerate(sequences):
        table[row, : len(blocks)] = blocks
    return table


def test_groups_share_their_prefix_and_keep_their_own_blocks():
    bs = 16
    prefix = list(range(100, 110))  # 10 shared blocks
    members = [prefix + [200 + i] for i in range(5)]  # 5 sequences of a request: own partial block
    other = [prefix[:4] + [300, 301]]  # a request that shares only 4 cached blocks
    lone = [[400, 401, 402]]
    sequences = members + other + lone
    context = np.array([10 * bs + 3] * 5 + [5 * bs + 7, 2 * bs + 9])
    plan = plan_cascade(tables_of(sequences, 12), context, bs, mode="always")
    assert plan is not None and plan.num_groups == 1 and plan.width == 6
    # the group is the six decodes whose first block is 100; their common prefix is 4 blocks
    assert sorted(plan.member_rows.tolist()) == [0, 1, 2, 3, 4, 5]
    assert plan.prefix_lens.tolist() == [4 * bs]
    assert plan.prefix_tables[0].tolist() == prefix[:4]
    suffix_lens = plan.suffix_lens.tolist()
    assert suffix_lens[:5] == [6 * bs + 3] * 5 and suffix_lens[5] == 1 * bs + 7 and suffix_lens[6] == 2 * bs + 9
    assert plan.suffix_tables[0, :7].tolist() == prefix[4:] + [200]
    assert plan.suffix_tables[6, :3].tolist() == [400, 401, 402]
    assert plan.saved_tokens == 5 * 4 * bs


def test_the_block_being_written_is_never_shared():
    bs = 16
    # Two sequences whose tables agree on every block (a fork before its copy-on-write): the
    # last block holds the new token, so only the blocks before it count.
    sequences = [[7, 8, 9], [7, 8, 9]]
    plan = plan_cascade(tables_of(sequences, 3), np.array([2 * bs + 5, 2 * bs + 5]), bs, mode="always")
    assert plan.prefix_lens.tolist() == [2 * bs]
    assert plan.suffix_lens.tolist() == [5, 5]
    # a context that ends on a block boundary: its last block is the one written
    plan = plan_cascade(tables_of(sequences, 3), np.array([bs, bs]), bs, mode="always")
    assert plan is None


def test_nothing_shared_or_too_little_saved_or_off():
    bs = 16
    distinct = [[i * 10, i * 10 + 1] for i in range(6)]
    assert plan_cascade(tables_of(distinct, 2), np.full(6, 20), bs, mode="always") is None
    pair = [[1, 2, 3], [1, 2, 4]]
    context = np.array([40, 40])
    assert plan_cascade(tables_of(pair, 3), context, bs, mode="always") is not None
    assert plan_cascade(tables_of(pair, 3), context, bs, mode="auto", bytes_per_token=2 << 20) is None  # 32 tokens
    assert plan_cascade(tables_of(pair, 3), context, bs, mode="off") is None
    # auto: n = 8 sequences over a 2,048-token prompt, Llama-3.1-8B's 128 KiB of K/V a token:
    # 1.75 GiB saved, not enough alone; 64 such requests save enough, but their 512 decodes
    # read 128 GiB without cascade: a step the host's eager launches would bound; over
    # 4,096-token prompts they read 256 GiB
    per_token = 128 << 10
    blocks = 2048 // bs
    eight = [list(range(blocks)) + [1000 + i] for i in range(8)]
    assert plan_cascade(tables_of(eight, blocks + 1), np.full(8, 2048 + 5), bs, "auto", per_token) is None
    for prompt, expected in ((2048, None), (4096, 64)):
        blocks = prompt // bs
        many = [[r * 10_000 + b for b in range(blocks)] + [10**7 + r * 8 + i] for r in range(64) for i in range(8)]
        context = np.full(512, prompt + 5)
        plan = plan_cascade(tables_of(many, blocks + 1), context, bs, "auto", per_token)
        assert (plan and plan.num_groups) == expected, prompt
        saved = 64 * 7 * prompt * per_token
        assert saved >= CASCADE_MIN_SAVED_BYTES
        assert (float(context.sum()) * per_token >= CASCADE_MIN_DECODE_READ_BYTES) == (expected is not None)


def test_large_sets_are_cut_into_groups_of_max_width():
    bs = 16
    sequences = [[1, 2, 3, 100 + i] for i in range(11)]
    context = np.full(11, 3 * bs + 1)
    plan = plan_cascade(tables_of(sequences, 4), context, bs, mode="always", max_width=4)
    assert plan.num_groups == 3 and plan.width == 4  # 4 + 4 + 3 (padded with a repeated member)
    assert sorted(plan.member_rows[plan.valid_index].tolist()) == list(range(11))
    # 9 = 4 + 4 + 1: the lone remainder attends its whole context itself
    plan = plan_cascade(tables_of(sequences[:9], 4), context[:9], bs, mode="always", max_width=4)
    assert plan.num_groups == 2
    assert 8 not in plan.member_rows[plan.valid_index].tolist()
    assert plan.suffix_lens.tolist() == [1] * 8 + [3 * bs + 1]
    assert plan.suffix_tables[8].tolist() == [1, 2, 3, 108]


def partials_of(q, k, v, scale_log2, splits):
    """The kernel's partials over `splits` chunks of the keys: unnormalised output, max and
    sum in log2 units (one query head)."""
    outs, ms, ls = [], [], []
    for chunk in splits:
        s = (k[chunk] @ q) * scale_log2
        m = s.max()
        p = torch.exp2(s - m)
        outs.append(p @ v[chunk])
        ms.append(m)
        ls.append(p.sum())
    return torch.stack(outs), torch.stack(ms), torch.stack(ls)


def test_merge_partials_is_softmax_attention():
    torch.manual_seed(0)
    d, n = 64, 300
    q, k, v = torch.randn(d, dtype=torch.float64), torch.randn(n, d, dtype=torch.float64), torch.randn(n, d, dtype=torch.float64)
    scale = d**-0.5
    expected = torch.softmax((k @ q) * scale, 0) @ v
    splits = [range(0, 17), range(17, 200), range(200, 300)]
    po, pm, pl = partials_of(q, k, v, scale / np.log(2), splits)
    # [n=1, H=1, Z, D] with an empty split (-inf, 0, 0) that must weigh nothing
    po = torch.cat([po, torch.zeros(1, d, dtype=torch.float64)]).view(1, 1, 4, d)
    pm = torch.cat([pm, torch.tensor([float("-inf")], dtype=torch.float64)]).view(1, 1, 4)
    pl = torch.cat([pl, torch.zeros(1, dtype=torch.float64)]).view(1, 1, 4)
    merged = ops.merge_partials(po, pm, pl, torch.float64)
    torch.testing.assert_close(merged[0, 0], expected, rtol=1e-12, atol=1e-12)
    # nothing at all: zeros, not NaN
    empty = ops.merge_partials(torch.zeros(1, 1, 2, d), torch.full((1, 1, 2), float("-inf")), torch.zeros(1, 1, 2),
                               torch.float32)
    assert torch.equal(empty, torch.zeros(1, 1, d))


@pytest.mark.parametrize("bad", ["sometimes", "ON"])
def test_cascade_mode_is_checked(monkeypatch, bad):
    from inflightllm.attention.cuda.backend import cascade_mode

    monkeypatch.setenv("INFLIGHTLLM_CASCADE_DECODE", bad)
    with pytest.raises(ValueError, match="INFLIGHTLLM_CASCADE_DECODE.*allowed: auto, always, off"):
        cascade_mode()


def test_auto_skips_short_prefixes():
    """256 x beam_width 4 over 128-token prompts: enough bytes saved in all, but each group's
    prefix is short (measured 2.2x slower with cascade on an H200): auto leaves it."""
    bs = 16
    tables = [[r * 100 + b for b in range(8)] + [10**6 + 4 * r + i] for r in range(256) for i in range(4)]
    context = np.full(len(tables), 128 + 5)
    per_token = 128 << 10
    assert plan_cascade(tables_of(tables, 9), context, bs, "auto", per_token) is None
    assert plan_cascade(tables_of(tables, 9), context, bs, "always", per_token) is not None
