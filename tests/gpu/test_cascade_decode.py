"""Cascade decode on a GPU (attention/cuda/backend.py `_cascade_decode`): decodes that share
prefix blocks attend the prefix once per group (as one sequence of width x heads query heads)
and their own blocks apart, the partials merged. Checked against the plain decode of the
same backend, which tests/gpu/test_cuda_attention.py and test_fp8_kv_cache.py check against
the reference: every output row's relative error ||cascade - plain|| / ||plain|| below
1e-5 (fp32) or 1e-2 (bf16, whose outputs round differently after the other summation
order); then through the engine: n = 4 seeded sequences and beam search with cascade
forced on give the tokens of the same requests with it off (fp32).

    PYTHONUNBUFFERED=1 python3 -m pytest -m gpu tests/gpu/test_cascade_decode.py -x -q
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from inflightllm.attention.base import SequenceSlice
from inflightllm.attention.cuda import CudaPagedAttention
from inflightllm.attention.cuda.backend import plan_cascade

pytestmark = pytest.mark.gpu

DEV = "cuda"
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def upload(array):
    return torch.from_numpy(np.ascontiguousarray(array)).to(DEV)


@pytest.mark.parametrize("dtype,kv_dtype", [(torch.float32, "auto"), (torch.bfloat16, "auto"),
                                             (torch.bfloat16, "fp8")])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [(32, 8, 128, 16), (32, 4, 64, 32),
                                                                (8, 8, 128, 16)])
def test_cascade_equals_the_plain_decode(dtype, kv_dtype, heads, kv_heads, head_dim, block_size):
    torch.manual_seed(0)
    rng = np.random.default_rng(1)
    num_blocks = 600
    backend = CudaPagedAttention(heads, kv_heads, head_dim, max_model_len=8192, kv_cache_dtype=kv_dtype)
    backend.allocate_kv_cache(num_blocks, block_size, 1, kv_heads, head_dim, dtype, DEV)
    if kv_dtype == "fp8":
        from inflightllm.quantization.fp8 import quantize_with_scale

        values = torch.randn(backend.kv_cache.shape)
        backend.kv_cache.copy_(quantize_with_scale(values, 1.0).view(torch.uint8).to(DEV))
    else:
        backend.kv_cache.copy_(torch.randn(backend.kv_cache.shape, device=DEV))
    free = list(rng.permutation(num_blocks))
    # (members, shared prefix blocks): a wide group, two small ones, two lone decodes (0 shared)
    groups = [(8, 20), (3, 5), (2, 1), (1, 0), (1, 0)]
    sequences, tables, contexts = [], [], []
    for members, prefix_blocks in groups:
        prefix = [int(free.pop()) for _ in range(prefix_blocks)]
        for _ in range(members):
            own = int(rng.integers(1, 70))
            blocks = prefix + [int(free.pop()) for _ in range(-(-own // block_size))]
            context = prefix_blocks * block_size + own
            sequences.append(SequenceSlice(len(sequences), 1, context, tuple(blocks)))
            tables.append(blocks)
            contexts.append(context)
    nd = len(sequences)
    width = max(len(t) for t in tables)
    table = np.zeros((nd, width), np.int32)
    for row, blocks in enumerate(tables):
        table[row, : len(blocks)] = blocks
    metadata = backend.build_metadata(sequences, DEV)
    q = torch.randn(nd, heads, head_dim, device=DEV, dtype=dtype)
    k = torch.randn(nd, kv_heads, head_dim, device=DEV, dtype=dtype)
    v = torch.randn(nd, kv_heads, head_dim, device=DEV, dtype=dtype)
    plain = backend.forward(0, q, k, v, metadata).float()
    plan = plan_cascade(table, np.array(contexts), block_size, mode="always")
    assert plan is not None and plan.num_groups == 3 and plan.width == 8
    metadata.cascade = plan.upload(upload)
    cascade = backend.forward(0, q, k, v, metadata, out=torch.full_like(q, float("nan"))).float()
    torch.cuda.synchronize()
    error = (cascade - plain).flatten(1).norm(dim=1) / plain.flatten(1).norm(dim=1)
    assert torch.isfinite(cascade).all()
    assert error.max().item() < TOL[dtype], error.tolist()

    # As the runner replays it: a CUDA graph captured over static buffers laid out for more
    # groups and a wider group than the plan's (gpu/runner.py `_cascade_graph`), then
    # replayed with the plan's values in them, equals the plain decode too.
    from inflightllm.attention.cuda.backend import CascadeDecode
    from inflightllm.gpu.ops import torch_stream

    groups, width = plan.num_groups + 2, 16
    rows, slot, tables, lens = plan.padded(groups, width)
    static = CascadeDecode(groups, width, upload(np.zeros_like(rows)), upload(np.full_like(slot, groups * width)),
                           upload(np.zeros_like(tables)), upload(np.zeros_like(lens)),
                           upload(np.zeros_like(plan.suffix_tables)), upload(np.ones_like(plan.suffix_lens)))
    metadata.cascade = static
    graphed = torch.full_like(q, float("nan"))
    with torch_stream():
        backend.forward(0, q, k, v, metadata, out=graphed)  # warm-up, outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        with torch_stream():
            backend.forward(0, q, k, v, metadata, out=graphed)
    for tensor, values in ((static.member_rows, rows), (static.prefix_slot, slot), (static.prefix_tables, tables),
                           (static.prefix_lens, lens), (static.suffix_tables, plan.suffix_tables),
                           (static.suffix_lens, plan.suffix_lens)):
        tensor.copy_(upload(values))
    graphed.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    error = (graphed.float() - plain).flatten(1).norm(dim=1) / plain.flatten(1).norm(dim=1)
    assert torch.isfinite(graphed).all()
    assert error.max().item() < TOL[dtype], error.tolist()


@pytest.fixture(scope="module")
def engine():
    from inflightllm.engine import Engine
    from tests.gpu.test_gpu_engine import gpu_config, model_spec

    return Engine(model_spec("float32"), gpu_config(), sampler_seed=0)


def run(engine, request_id, prompt, params, group=None):
    engine.add_request(request_id, prompt, params, group=group)
    outputs: dict[int, list[int]] = {}
    while engine.has_unfinished():
        for output in engine.step():
            assert output.error is None, output.error
            outputs.setdefault(output.sequence_index, []).extend(output.new_token_ids)
    return outputs


def test_groups_with_cascade_forced_on_give_the_same_tokens(engine):
    from inflightllm.sampling_params import SamplingParams
    from inflightllm.sequence_group import GroupParams
    from tests.gpu.test_gpu_engine import make_prompts

    runner = engine.runner
    prompt = make_prompts(2, engine.vocab_size, seed=5)[1] * 8  # 136 tokens: several whole blocks shared
    assert len(prompt) > 3 * engine.config.block_size
    cases = [
        ("n4", SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True), GroupParams(n=4)),
        ("beam4", SamplingParams(max_tokens=10, ignore_eos=True), GroupParams(beam_width=4)),
    ]
    saved_mode = runner.cascade_mode
    try:
        for name, params, group in cases:
            runner.cascade_mode = "off"
            plain = run(engine, f"{name}-off", prompt, params, group)
            runner.cascade_mode = "always"
            steps, graph_steps = runner.cascade_steps, runner.cascade_graph_steps
            cascade = run(engine, f"{name}-on", prompt, params, group)
            assert runner.cascade_steps > steps, name  # the cascade really ran
            assert runner.cascade_graph_steps > graph_steps, name  # and replayed as a CUDA graph
            assert cascade == plain, name
    finally:
        runner.cascade_mode = saved_mode
    assert engine.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("layout", ["mma", "decode"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cascade_merge_equals_the_reference(layout, dtype):
    """ops.cascade_merge (one kernel) against ops.merge_partials (torch ops) over the same
    partials: prefix partials in either layout (normalised with log-sum-exp, or the decode
    kernel's sums), empty splits among them, a decode in no group, a padded slot."""
    from inflightllm.attention.cuda import ops
    from inflightllm.gpu.ops import torch_stream

    torch.manual_seed(3)
    G, width, kvh, grp, D, S, Z = 3, 4, 2, 4, 128, 3, 2
    H, R = kvh * grp, width * grp
    nd = G * width + 2
    slot = np.arange(nd, dtype=np.int64)
    slot[-2:] = G * width  # in no group
    np.random.default_rng(0).shuffle(slot[:-2])
    if layout == "mma":
        p_o = torch.randn(G, kvh, S, R, D, device=DEV)
        p_m = torch.randn(G, kvh, S, R, device=DEV) * 4
        p_m[0, :, 1] = float("-inf")  # an empty split of the first group
        p_o[0, :, 1] = 0
        p_l = None
        # to [G * width, H, S, D]: member j's head h = kv * grp + q is row j * grp + q of kv
        ref_o = p_o.view(G, kvh, S, width, grp, D).permute(0, 3, 1, 4, 2, 5).reshape(G * width, H, S, D)
        ref_m = p_m.view(G, kvh, S, width, grp).permute(0, 3, 1, 4, 2).reshape(G * width, H, S)
        ref_l = torch.ones_like(ref_m)
    else:
        p_o = torch.randn(G, kvh * R, S, D, device=DEV)
        p_m = torch.randn(G, kvh * R, S, device=DEV) * 4
        p_l = torch.rand(G, kvh * R, S, device=DEV) + 0.5
        p_m[1, :, 0], p_l[1, :, 0], p_o[1, :, 0] = float("-inf"), 0, 0
        ref_o = p_o.view(G, kvh, width, grp, S, D).transpose(1, 2).reshape(G * width, H, S, D)
        ref_m = p_m.view(G, kvh, width, grp, S).transpose(1, 2).reshape(G * width, H, S)
        ref_l = p_l.view(G, kvh, width, grp, S).transpose(1, 2).reshape(G * width, H, S)
    s_o = torch.randn(nd, H, Z, D, device=DEV)
    s_m = torch.randn(nd, H, Z, device=DEV) * 4
    s_l = torch.rand(nd, H, Z, device=DEV) + 0.5
    s_m[2, :, 1], s_l[2, :, 1], s_o[2, :, 1] = float("-inf"), 0, 0
    # the reference: each decode's member partials (or empty ones) beside its own
    index = torch.from_numpy(np.minimum(slot, G * width - 1)).to(DEV)
    none = torch.from_numpy(slot == G * width).to(DEV)[:, None, None]
    po = torch.cat([torch.where(none[..., None], 0.0, ref_o.index_select(0, index)), s_o], dim=2)
    pm = torch.cat([torch.where(none, float("-inf"), ref_m.index_select(0, index)), s_m], dim=2)
    pl = torch.cat([torch.where(none, 0.0, ref_l.index_select(0, index)), s_l], dim=2)
    expected = ops.merge_partials(po, pm, pl, torch.float32)
    out = torch.full((nd, H, D), float("nan"), device=DEV, dtype=dtype)
    with torch_stream():
        ops.cascade_merge((p_o, p_m, p_l), layout, upload(slot), G * width, width, grp, kvh, (s_o, s_m, s_l), out,
                          ops.current_stream())
    torch.cuda.synchronize()
    torch.testing.assert_close(out.float(), expected, rtol=1e-5 if dtype == torch.float32 else 1e-2,
                               atol=1e-5 if dtype == torch.float32 else 1e-2)
