"""Exactness: greedy token ids equal `transformers`' `generate` on the same weights,
for requests run concurrently in one engine (in-flight), with chunked prefill, after
preemptions, and with prefix-cache hits. SmolLM2 fp32 on CPU, and tiny random-weight
Llama-3, Mistral and Qwen2 shapes."""

from __future__ import annotations

import pytest

from inflightllm.config import EngineConfig
from inflightllm.engine import Engine
from inflightllm.llm import LLM
from inflightllm.model_source import DEFAULT_MODEL
from inflightllm.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis to a child in two sentences.",
    "List three prime numbers.",
    "Translate 'good morning' into Spanish.",
    "Who wrote Pride and Prejudice?",
    "What is 12 times 13?",
    "Give me a tip for learning to cook.",
]
TEXTS = [
    "The quick brown fox",
    "Once upon a time, in a land far away, there lived a",
    "def fibonacci(n):\n    ",
    "In 1969, the first humans",
    "Paris is",
    "The three laws of thermodynamics are",
    "Roses are red,",
    "A long time ago " * 12 + "the end of the story was",
]
MAX_TOKENS = [24, 8, 40, 16, 12, 32, 20, 28, 10, 36, 14, 22, 30, 18, 26, 34]
SYSTEM = (
    "You are a meticulous assistant for a public library. You answer questions about books, "
    "authors, opening hours and membership. Keep every answer short, friendly and factual. "
    "If you do not know something, say so plainly and suggest asking a librarian at the desk."
)


@pytest.fixture(scope="module")
def prompts(smollm2_tokenizer) -> list[list[int]]:
    """16 prompts of different lengths: 8 chat-formatted questions and 8 plain texts."""
    chats = [
        smollm2_tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                              tokenize=False)
        for q in QUESTIONS
    ]
    return [smollm2_tokenizer.encode(text) for text in chats + TEXTS]


class Events:
    """What happened in a run, recorded from the engine's step descriptions and its
    scheduler: prefill steps per request, and preemptions mid-prefill / mid-decode."""

    def __init__(self, engine: Engine):
        self.prefill_steps: dict[str, int] = {}  # request id -> steps it spent in prefill
        self.preempted_mid_prefill = 0
        self.preempted_mid_decode = 0
        self.swapped_out = 0
        execute, preempt = engine.runner.execute, engine.scheduler._preempt

        def record_step(step):
            for request_id, _ in step.scheduled:
                request = engine.requests[request_id]
                if request.num_output_tokens == 0 and request.num_computed_tokens < request.num_prompt_tokens:
                    self.prefill_steps[request_id] = self.prefill_steps.get(request_id, 0) + 1
            self.swapped_out += len(step.swap_out)
            return execute(step)

        def record_preempt(request, output):
            # Mid-prefill: its prompt (or, resumed, its recompute) was not all computed yet.
            if request.num_computed_tokens < request.num_tokens - 1:
                self.preempted_mid_prefill += 1
            else:
                self.preempted_mid_decode += 1
            return preempt(request, output)

        engine.runner.execute = record_step
        engine.scheduler._preempt = record_preempt


def run_engine(loaded, prompts, max_tokens, config, arrival_steps, sampler_seed=0):
    engine = Engine(DEFAULT_MODEL, config, sampler_seed=sampler_seed, loaded=loaded)
    engine.events = Events(engine)
    llm = LLM(DEFAULT_MODEL, engine=engine, load_tokenizer_too=False)
    params = [SamplingParams(max_tokens=n) for n in max_tokens]
    results = llm.generate(prompts, params, arrival_steps=arrival_steps)
    return results, engine


def assert_equal_to_reference(reference, prompts, max_tokens, results):
    mismatches = []
    for i, (prompt, n, result) in enumerate(zip(prompts, max_tokens, results)):
        expected = reference.greedy(prompt, n)
        if result.token_ids != expected:
            mismatches.append(f"prompt {i}: ours {result.token_ids} != transformers {expected}")
    assert not mismatches, "\n".join(mismatches)


def test_staggered_inflight_requests_equal_transformers(smollm2_loaded, smollm2_reference, prompts):
    config = EngineConfig(max_num_tokens=2048, num_kv_blocks=512)
    arrivals = [0, 0, 1, 2, 3, 3, 5, 8, 9, 12, 13, 15, 18, 21, 22, 25]
    results, engine = run_engine(smollm2_loaded, prompts, MAX_TOKENS, config, arrivals)
    assert_equal_to_reference(smollm2_reference, prompts, MAX_TOKENS, results)
    stats = engine.stats()
    assert stats.num_preemptions_total == 0
    assert stats.num_blocks_used == 0  # every finished request freed its blocks


def test_chunked_prefill_equals_transformers(smollm2_loaded, smollm2_reference, prompts):
    config = EngineConfig(max_num_tokens=24, num_kv_blocks=512)
    assert max(len(p) for p in prompts) > 2 * 24  # some prompts take three or more chunks
    arrivals = [0, 1, 1, 2, 3, 4, 4, 5, 6, 6, 7, 8, 9, 10, 11, 12]
    results, engine = run_engine(smollm2_loaded, prompts, MAX_TOKENS, config, arrivals)
    assert_equal_to_reference(smollm2_reference, prompts, MAX_TOKENS, results)
    assert engine.stats().num_blocks_used == 0
    # The chunks happened: every prompt longer than the budget was prefilled over several steps.
    steps = engine.events.prefill_steps
    assert sum(1 for count in steps.values() if count >= 3) >= 1
    assert all(steps[result.request_id] >= -(-len(p) // 24) for result, p in zip(results, prompts))


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_equals_transformers(smollm2_loaded, smollm2_reference, prompts, mode):
    longest = max(len(p) + n for p, n in zip(prompts, MAX_TOKENS))
    blocks = -(-longest // 16) + 6  # room for the longest request and a little more
    config = EngineConfig(max_num_tokens=24, num_kv_blocks=blocks, preemption_mode=mode)
    arrivals = [0] * 8 + [1] * 8
    results, engine = run_engine(smollm2_loaded, prompts, MAX_TOKENS, config, arrivals)
    assert_equal_to_reference(smollm2_reference, prompts, MAX_TOKENS, results)
    stats = engine.stats()
    events = engine.events
    # Preemptions happened both mid-prefill and mid-decode.
    assert events.preempted_mid_prefill >= 1 and events.preempted_mid_decode >= 1, vars(events)
    assert stats.num_preemptions_total == events.preempted_mid_prefill + events.preempted_mid_decode
    if mode == "swap":
        assert stats.num_swapped_out_total >= 1 and events.swapped_out == stats.num_swapped_out_total
    assert stats.num_blocks_used == 0


@pytest.mark.parametrize("policy, mode, watermark", [
    ("guaranteed_no_evict", "recompute", 0.0),
    ("max_utilization", "auto", 0.1),
])
def test_capacity_policies_equal_transformers(smollm2_loaded, smollm2_reference, prompts, policy, mode, watermark):
    """The cache of the preemption test above: guaranteed_no_evict holds requests back and
    never preempts; max_utilization with a watermark and auto (swap or recompute by the
    measured costs of this machine) preempts. Outputs equal transformers either way."""
    longest = max(len(p) + n for p, n in zip(prompts, MAX_TOKENS))
    blocks = -(-longest // 16) + 6
    config = EngineConfig(max_num_tokens=24, num_kv_blocks=blocks, preemption_mode=mode, capacity_policy=policy,
                          kv_watermark=watermark)
    arrivals = [0] * 8 + [1] * 8
    results, engine = run_engine(smollm2_loaded, prompts, MAX_TOKENS, config, arrivals)
    assert_equal_to_reference(smollm2_reference, prompts, MAX_TOKENS, results)
    stats = engine.stats()
    assert stats.host_link_bytes_per_second > 0 and stats.prefill_seconds_per_token > 0  # measured
    if policy == "guaranteed_no_evict":
        assert stats.num_preemptions_total == 0 and stats.num_recomputed_tokens_total == 0
    else:
        assert engine.scheduler.watermark_blocks == int(0.1 * blocks) >= 1
        assert stats.num_preemptions_total > 0
        assert stats.num_swapped_in_blocks_total <= stats.num_swapped_out_blocks_total
        assert stats.swapped_out_bytes_total == stats.num_swapped_out_blocks_total * engine.host_link.bytes_per_block
    assert stats.num_blocks_used == 0


def test_prefix_cache_hits_leave_outputs_unchanged(smollm2_loaded, smollm2_reference, smollm2_tokenizer):
    chats = [
        smollm2_tokenizer.apply_chat_template(
            [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}],
            add_generation_prompt=True, tokenize=False)
        for q in QUESTIONS
    ]
    shared_prompts = [smollm2_tokenizer.encode(text) for text in chats]
    max_tokens = MAX_TOKENS[:8]
    config = EngineConfig(max_num_tokens=512, num_kv_blocks=256, enable_kv_cache_reuse=True)
    arrivals = [0, 2, 4, 6, 8, 10, 12, 14]  # later requests find the system prompt cached
    results, engine = run_engine(smollm2_loaded, shared_prompts, max_tokens, config, arrivals)
    assert_equal_to_reference(smollm2_reference, shared_prompts, max_tokens, results)
    stats = engine.stats()
    assert stats.prefix_cache_hits > 0
    # The prompts share 59 tokens: three full 16-token blocks are reused.
    assert [r.num_cached_tokens for r in results] == [0] + [48] * 7
    assert results[0].num_cached_tokens == 0


# ---- tiny random-weight shapes of each supported family -------------------------------

@pytest.fixture(scope="module", params=["tiny-llama3", "tiny-mistral", "tiny-qwen2"])
def tiny_model(request, tmp_path_factory):
    """A transformers model of the named shape with random weights, saved as an HF
    folder; our engine loads the same folder."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from inflightllm.models.shapes import shape_config

    config_dict = shape_config(request.param)
    # Large weights make the logits peaked, so greedy choices are not near-ties.
    config_dict["initializer_range"] = 0.25
    config = AutoConfig.for_model(**config_dict)
    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.eval()
    if request.param == "tiny-qwen2":  # transformers initialises biases to zero: make them count
        with torch.no_grad():
            for layer in model.model.layers:
                for projection in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    assert projection.bias is not None
                    projection.bias.normal_(0.0, 0.5)
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder)
    return request.param, folder, model


def test_tiny_random_shapes_equal_transformers(tiny_model):
    from inflightllm.model_source import ModelSpec
    from inflightllm.models.loader import load_model
    from tests.conftest import HFReference

    name, folder, hf_model = tiny_model
    spec = ModelSpec(source="hf_folder", path=str(folder))
    loaded = load_model(spec)
    reference = HFReference(hf_model, loaded.eos_token_ids)
    generator = __import__("random").Random(7)
    # Lengths around the sliding window (64) and block boundaries; chunked prefill.
    lengths = [5, 16, 17, 40, 63, 64, 65, 90, 100, 130]
    prompts = [[generator.randrange(3, 49152) for _ in range(n)] for n in lengths]
    max_tokens = [12, 20, 8, 30, 16, 24, 10, 28, 18, 14]
    engine = Engine(spec, EngineConfig(max_num_tokens=48, num_kv_blocks=128, block_size=16), sampler_seed=0,
                    loaded=loaded)
    llm = LLM(spec, engine=engine, load_tokenizer_too=False)
    results = llm.generate(prompts, [SamplingParams(max_tokens=n) for n in max_tokens],
                           arrival_steps=[0, 0, 1, 2, 2, 3, 5, 6, 8, 9])
    assert_equal_to_reference(reference, prompts, max_tokens, results), name


def test_host_kv_tier_hits_leave_outputs_unchanged(smollm2_loaded, smollm2_reference, smollm2_tokenizer):
    """Multi-turn chats through a GPU-sized-down cache with the host KV tier on: each second
    turn (the whole first turn, its reply and a new message) finds its history evicted from
    the device cache by the other conversations and gets it back from the host tier. Greedy
    outputs equal transformers' on every turn."""
    conversations = [
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}] for q in QUESTIONS[:4]
    ]
    first = [smollm2_tokenizer.encode(smollm2_tokenizer.apply_chat_template(c, add_generation_prompt=True,
                                                                             tokenize=False))
             for c in conversations]
    replies = [smollm2_reference.greedy(p, 12) for p in first]
    follow_up = smollm2_tokenizer.encode("<|im_end|>\n<|im_start|>user\nAnd why is that?<|im_end|>\n"
                                         "<|im_start|>assistant\n")
    second = [p + r + follow_up for p, r in zip(first, replies)]
    prompts = first + second
    max_tokens = [12] * 4 + [10] * 4
    longest = max(len(p) + n for p, n in zip(prompts, max_tokens))
    block_bytes = 16 * 2 * 30 * 3 * 64 * 4  # SmolLM2-135M fp32: 30 layers, 3 KV heads of 64
    config = EngineConfig(max_num_tokens=256, num_kv_blocks=-(-longest // 16) + 2, max_batch_size=1,
                          host_kv_cache_bytes=64 * block_bytes)
    # One at a time, first turns then second turns: each second turn's history was evicted by
    # the three conversations in between.
    results, engine = run_engine(smollm2_loaded, prompts, max_tokens, config, arrival_steps=[0] * 8)
    assert_equal_to_reference(smollm2_reference, prompts, max_tokens, results)
    stats = engine.stats()
    assert stats.host_kv_blocks_total == 64 and stats.host_kv_bytes_per_block == block_bytes
    assert stats.host_kv_onloaded_blocks_total > 0 and stats.prefix_cache_host_hits > 0
    # Each second turn reused (at least) its first turn's full blocks, most from host.
    for turn1, result in zip(first, results[4:]):
        assert result.num_cached_tokens >= len(turn1) // 16 * 16
    assert stats.num_blocks_used == 0
