"""Named model shapes for random-weight deployments (speed, memory and exactness runs).

Each entry is a Hugging Face `config.json` dictionary. Random weights are drawn from
a seeded generator at load time; no weights are stored.
"""

from __future__ import annotations

import copy

_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

SHAPES: dict[str, dict] = {
    # Meta-Llama-3.1-8B's shape.
    "llama3-8b": {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": dict(_LLAMA3_ROPE),
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "hidden_act": "silu",
        "bos_token_id": 128000,
        "eos_token_id": 128001,
    },
    # Meta-Llama-3.1-70B's shape.
    "llama3-70b": {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": dict(_LLAMA3_ROPE),
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "hidden_act": "silu",
        "bos_token_id": 128000,
        "eos_token_id": 128001,
    },
    # SmolLM2-135M's shape (the default model's), for GPU exactness runs on random weights.
    "smollm2-135m": {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "vocab_size": 49152,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "mlp_bias": False,
        "hidden_act": "silu",
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    # Tiny shapes of each supported family, for exactness tests on CPU.
    "tiny-llama3": {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "vocab_size": 49152,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": dict(_LLAMA3_ROPE, original_max_position_embeddings=256),
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "hidden_act": "silu",
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    "tiny-mistral": {
        "model_type": "mistral",
        "architectures": ["MistralForCausalLM"],
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "vocab_size": 49152,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "sliding_window": 64,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    "tiny-qwen2": {
        "model_type": "qwen2",
        "architectures": ["Qwen2ForCausalLM"],
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 49152,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "use_sliding_window": False,
        "tie_word_embeddings": True,
        "hidden_act": "silu",
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
}


# One rank's share of llama3-8b under tensor parallelism of 2 (half the heads, the MLP width
# and the vocabulary): the per-rank GEMV and attention work of a TP=2 step, measured on one GPU
# without the all-reduces (perf/bench_gpu.py --shape llama3-8b-tp2-rank).
SHAPES["llama3-8b-tp2-rank"] = dict(SHAPES["llama3-8b"], num_attention_heads=16, num_key_value_heads=4,
                                    intermediate_size=7168, vocab_size=64128)

# tiny-llama3 with a 1,024-token vocabulary: model compute and per-row sampling are
# negligible on a CPU, so an engine run measures the host path around the model
# (perf/bench_sequence_groups.py --shape tiny-llama3-v1k --device cpu). Ids above 1,023 of
# the borrowed tokenizer are never produced.
SHAPES["tiny-llama3-v1k"] = dict(SHAPES["tiny-llama3"], vocab_size=1024)


def shape_config(name: str) -> dict:
    """A copy of the named shape's config dictionary; KeyError names the choices."""
    if name not in SHAPES:
        raise KeyError(f"unknown model shape {name!r}; known shapes: {', '.join(sorted(SHAPES))}")
    return copy.deepcopy(SHAPES[name])
