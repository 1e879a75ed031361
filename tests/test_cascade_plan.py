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
    assert sorted(plan.member_rows[plan.prefix_slot].tolist()) == list(range(11))
    # 9 = 4 + 4 + 1: the lone remainder attends its whole context itself
    plan = plan_cascade(tables_of(sequences[:9], 4), context[:9], bs, mode="always", max_width=4)
    assert plan.num_groups == 2
    assert plan.prefix_slot[8] == 2 * 4  # in no group: the slot past the members
    assert 8 not in plan.member_rows.tolist()
    assert plan.suffix_lens.tolist() == [1] * 8 + [3 * bs + 1]
    assert plan.suffix_tables[8].tolist() == [1, 2, 3, 108]


def test_every_member_has_its_slot_and_the_rest_none():
    bs = 16
    prefix = [1, 2, 3]
    sequences = [prefix + [10 + i] for i in range(3)] + [[50, 51]] + [prefix + [20 + i] for i in range(2)]
    context = np.array([3 * bs + 2] * 3 + [bs + 4] + [3 * bs + 2] * 2)
    plan = plan_cascade(tables_of(sequences, 4), context, bs, mode="always")
    assert plan.num_groups == 1 and plan.width == 5
    slots = plan.prefix_slot.tolist()
    assert slots[3] == 5  # the lone decode: groups * width
    assert [plan.member_rows[slots[r]] for r in (0, 1, 2, 4, 5)] == [0, 1, 2, 4, 5]


def test_padded_layout_keeps_each_decode_on_its_member():
    """A CUDA graph's shape (more groups, wider): padded members repeat their group's first,
    padded groups have empty prefixes, each decode's slot still names its own row, and a
    decode in no group gets the new layout's empty slot."""
    bs = 16
    sequences = ([[1, 2, 3, 10 + i] for i in range(3)] + [[5, 6, 7, 20 + i] for i in range(2)]
                 + [[90, 91, 92, 93]])
    context = np.full(6, 3 * bs + 9)
    plan = plan_cascade(tables_of(sequences, 4), context, bs, mode="always")
    assert plan.num_groups == 2 and plan.width == 3
    rows, slot, tables, lens = plan.padded(4, 8)
    assert rows.shape == (32,) and tables.shape == (4, 3) and lens.tolist() == [3 * bs, 3 * bs, 0, 0]
    for decode in range(5):
        assert rows[slot[decode]] == decode
    assert slot[5] == 4 * 8
    group_of = {decode: int(slot[decode]) // 8 for decode in range(5)}
    for decode, group in group_of.items():
        assert tables[group].tolist() == sequences[decode][:3]
        assert set(rows[group * 8 : (group + 1) * 8].tolist()) <= {d for d, g in group_of.items() if g == group}
    assert (tables[2:] == 0).all()
    with pytest.raises(AssertionError):
        plan.padded(1, 8)


def test_auto_with_graphs_does_not_weigh_eager_launches():
    """With cascade steps replayed as CUDA graphs, auto drops the eager-launch condition:
    n = 8 over 64 prompts of 2,048 tokens (128 GiB of decode reads) uses cascade."""
    bs, per_token = 16, 128 << 10
    blocks = 2048 // bs
    many = [[r * 10_000 + b for b in range(blocks)] + [10**7 + r * 8 + i] for r in range(64) for i in range(8)]
    context = np.full(512, 2048 + 5)
    assert plan_cascade(tables_of(many, blocks + 1), context, bs, "auto", per_token) is None
    plan = plan_cascade(tables_of(many, blocks + 1), context, bs, "auto", per_token, graphs=True)
    assert plan is not None and plan.num_groups == 64 and plan.width == 8


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


def test_a_cascade_shape_gets_its_graph_the_second_time(monkeypatch):
    """gpu/runner.py `_cascade_graph_key`: groups and width rounded up to buckets; a shape's
    first step runs eagerly, its second gets the graph key; past CASCADE_GRAPHS_MAX captured
    shapes, new ones stay eager; no graphs (cuda_graphs off) or no bucket: eager."""
    from types import SimpleNamespace

    from inflightllm.gpu import runner as gpu_runner

    runner = object.__new__(gpu_runner.GpuModelRunner)
    runner.max_rows, runner.graph_pool = 1024, object()
    runner.cascade_graphs, runner._cascade_shapes_seen = {}, set()
    plan = SimpleNamespace(num_groups=60, width=7)
    assert runner._cascade_graph_key(512, plan) is None
    key = runner._cascade_graph_key(512, plan)
    assert key == (512, 64, 8)
    runner.cascade_graphs[key] = None
    assert runner._cascade_graph_key(512, SimpleNamespace(num_groups=49, width=5)) == key
    assert runner._cascade_graph_key(None, plan) is None and runner._cascade_graph_key(512, None) is None
    monkeypatch.setattr(gpu_runner, "CASCADE_GRAPHS_MAX", 1)
    other = SimpleNamespace(num_groups=3, width=2)
    assert runner._cascade_graph_key(64, other) is None and runner._cascade_graph_key(64, other) is None
    runner.graph_pool = None
    assert runner._cascade_graph_key(512, plan) is None
    assert gpu_runner.cascade_group_buckets(1024)[-1] == 512


def test_prefix_splits_fill_the_waves():
    """ops.cascade_prefix_splits: n = 8 over 64 prompts (512 blocks without splits on 132
    SMs, 1.3 waves) gets 3 splits (3.9 waves); a few groups get the most; a grid of many
    waves gets none; always 1..most."""
    assert ops.cascade_prefix_splits(512, 132) == 3
    assert ops.cascade_prefix_splits(24, 132) == ops.CASCADE_PREFIX_MAX_SPLITS
    assert ops.cascade_prefix_splits(4096, 132) == 1
    # blocks of 64 threads (32 query rows: 8 sequences x 4 heads): twice as many fit a SM
    assert ops.cascade_prefix_threads(32) == 64 and ops.cascade_prefix_threads(33) == 128
    assert ops.cascade_prefix_splits(512, 132, threads=64) == 3  # 1.9 waves of 792 slots
    for blocks in range(1, 3000, 37):
        assert 1 <= ops.cascade_prefix_splits(blocks, 132) <= ops.CASCADE_PREFIX_MAX_SPLITS
