"""Session-wide fixtures for engine tests: the real SmolLM2 weights loaded once, and
`transformers` references computed once."""

from __future__ import annotations

import pytest
import torch

from inflightllm.model_source import DEFAULT_MODEL, prepare
from inflightllm.models.loader import LoadedModel, load_model


@pytest.fixture(scope="session")
def smollm2_folder():
    return prepare(DEFAULT_MODEL)


@pytest.fixture(scope="session")
def smollm2_loaded(smollm2_folder) -> LoadedModel:
    return load_model(DEFAULT_MODEL)


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_folder):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_folder, dtype=torch.float32)
    model.eval()
    return model


class HFReference:
    """Greedy `transformers.generate` on one unpadded prompt at a time, memoised."""

    def __init__(self, model, eos_token_ids):
        self.model = model
        self.eos_token_ids = set(eos_token_ids)
        self._cache: dict[tuple, list[int]] = {}

    def greedy(self, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        """Generated ids, cut before the first EOS (the engine does not emit stop tokens)."""
        key = (tuple(prompt_ids), max_new_tokens)
        if key not in self._cache:
            with torch.no_grad():
                out = self.model.generate(
                    torch.tensor([prompt_ids]),
                    attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.int64),
                    max_new_tokens=max_new_tokens,
                    do_sample=False,
                    pad_token_id=next(iter(self.eos_token_ids), 0),
                )[0][len(prompt_ids):].tolist()
            cut = next((i for i, t in enumerate(out) if t in self.eos_token_ids), len(out))
            self._cache[key] = out[:cut]
        return self._cache[key]


@pytest.fixture(scope="session")
def smollm2_reference(smollm2_hf, smollm2_loaded) -> HFReference:
    return HFReference(smollm2_hf, smollm2_loaded.eos_token_ids)

