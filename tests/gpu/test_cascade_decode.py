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
            steps = runner.cascade_steps
            cascade = run(engine, f"{name}-on", prompt, params, group)
            assert runner.cascade_steps > steps, name  # the cascade really ran
            assert cascade == plain, name
    finally:
        runner.cascade_mode = saved_mode
    assert engine.block_manager.num_used_blocks == 0
