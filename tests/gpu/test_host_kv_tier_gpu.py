"""The host KV tier on a GPU: the CUDA backend's offload / onload copies round-trip block
contents exactly (bf16 and FP8 caches, runs of slots and scattered ones, more blocks than a
staging chunk), and multi-turn chats through a small GPU cache give the same greedy ids with
the tier on as off (and as transformers, fp32), with prefix hits from host."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

from inflightllm.sampling_params import SamplingParams  # noqa: E402
from tests.gpu.test_gpu_engine import (  # noqa: E402
    Reference,
    fresh_engine,
    gpu_config,
    model_spec,
)


def _backend(dtype: torch.dtype, kv_cache_dtype: str = "auto", num_blocks: int = 200):
    from inflightllm.attention.cuda.backend import CudaPagedAttention

    attention = CudaPagedAttention(8, 2, 64, kv_cache_dtype=kv_cache_dtype, max_model_len=4096)
    attention.allocate_kv_cache(num_blocks, 16, 3, 2, 64, dtype, torch.device("cuda", 0))
    return attention


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_offload_then_onload_round_trips_blocks(kv_cache_dtype):
    from inflightllm.attention.cuda.backend import HOST_TIER_CHUNK

    attention = _backend(torch.bfloat16, kv_cache_dtype)
    per_block = attention.allocate_host_tier(150)
    element = 1 if kv_cache_dtype == "fp8" else 2
    assert per_block == 3 * 2 * 16 * 2 * 64 * element
    assert attention.host_kv.is_pinned()  # registered (or torch-pinned): asynchronous copies
    cache = attention.kv_cache  # [layers, 2, blocks, 16, 2, 64]
    generator = torch.Generator(device="cuda").manual_seed(0)
    cache.view(torch.uint8).copy_(torch.randint(0, 120, cache.view(torch.uint8).shape, generator=generator,
                                                device="cuda", dtype=torch.uint8))
    before = cache.clone()
    # More pairs than a staging chunk; consecutive slots (runs) and scattered ones.
    count = HOST_TIER_CHUNK + 20
    blocks = torch.randperm(200, generator=torch.Generator().manual_seed(1))[:count].tolist()
    slots = list(range(10, 10 + count // 2)) + [149 - 2 * i for i in range(count - count // 2)]
    attention.offload_blocks(list(zip(blocks, slots)))
    cache.zero_()  # ordered after the offload on the compute stream (it waits for the copies)
    targets = torch.randperm(200, generator=torch.Generator().manual_seed(2))[:count].tolist()
    attention.onload_blocks(list(zip(slots, targets)))
    torch.cuda.synchronize()
    for block, target in zip(blocks, targets):
        assert torch.equal(cache[:, :, target], before[:, :, block]), (block, target)
    untouched = sorted(set(range(200)) - set(targets))
    assert not cache[:, :, untouched].view(torch.uint8).any()
    # The host copy holds each block's every layer contiguously, in the cache's layout.
    host = attention.host_kv
    assert torch.equal(host[slots[0]].to("cuda"), before[:, :, blocks[0]])


@pytest.fixture(scope="module")
def engine_fp32():
    from inflightllm.engine import Engine

    return Engine(model_spec("float32"), gpu_config(), sampler_seed=0)


def conversations(vocab: int, count: int = 6, turns: int = 3, user: int = 96):
    """A shared system prompt and, per conversation, its user messages (random tokens)."""
    generator = torch.Generator().manual_seed(5)
    system = torch.randint(10, vocab, (40,), generator=generator).tolist()
    messages = [[torch.randint(10, vocab, (user,), generator=generator).tolist() for _ in range(turns)]
                for _ in range(count)]
    return system, messages


def run_chats(engine, system, messages, out: int) -> tuple[list[list[list[int]]], list[list[int]]]:
    """All conversations' turn t, then turn t + 1 (each prompt = the whole history so far
    plus the next message); returns the outputs and the prompts, by conversation."""
    from inflightllm.llm import LLM

    llm = LLM(engine.model_spec, engine=engine, load_tokenizer_too=False)
    histories = [list(system) for _ in messages]
    outputs = [[] for _ in messages]
    prompts = [[] for _ in messages]
    for turn in range(len(messages[0])):
        batch = [history + conversation[turn] for history, conversation in zip(histories, messages)]
        results = llm.generate(batch, [SamplingParams(max_tokens=out, ignore_eos=True)] * len(batch))
        for index, (prompt, result) in enumerate(zip(batch, results)):
            prompts[index].append(prompt)
            outputs[index].append(result.token_ids)
            histories[index] = prompt + result.token_ids
    return outputs, prompts


def test_multiturn_greedy_equal_with_the_tier_on_and_off(engine_fp32):
    system, messages = conversations(engine_fp32.vocab_size)
    # The working set: 6 conversations of up to 40 + 3 * (96 + 12) tokens = 23 blocks each;
    # a GPU cache of a third of it.
    num_blocks = 6 * 23 // 3
    per_block = engine_fp32.runner._bytes_per_block()
    off = fresh_engine(engine_fp32, num_kv_blocks=num_blocks, max_batch_size=8)
    on = fresh_engine(engine_fp32, num_kv_blocks=num_blocks, max_batch_size=8, host_kv_cache_bytes=200 * per_block)
    outputs_off, prompts = run_chats(off, system, messages, 12)
    outputs_on, _ = run_chats(on, system, messages, 12)
    assert outputs_on == outputs_off
    stats = on.stats()
    assert stats.host_kv_blocks_total == 200 and stats.host_kv_onloaded_blocks_total > 0
    assert stats.prefix_cache_host_hits > 0
    assert stats.prefix_cache_hits > off.stats().prefix_cache_hits
    reference = Reference(engine_fp32)
    for conversation_prompts, conversation_outputs in zip(prompts, outputs_on):
        for prompt, output in zip(conversation_prompts, conversation_outputs):
            assert output == reference.greedy(prompt, 12)
