"""A runner with no model compute, to measure the response path alone (`engine.runner: dummy`).

A measurement tool, not a model: it answers every step at once with deterministic token
ids drawn from the real tokenizer's vocabulary (special and end-of-sequence tokens left
out), so everything around the model runs for real: the scheduler, the KV block manager
(blocks are handed out and freed, no KV memory is allocated), the engine loop, the
response sender, the ensemble and postprocessing's detokenization. What a client then
measures (pieces/s, tokens/s) is the ceiling that the serving path puts on any model
(docs/PERFORMANCE.md, "The response path").

The tokens of a request depend only on its prompt and their position: the same prompt
gives the same text in every run, whatever else runs beside it. Sampling parameters are
ignored; no end-of-sequence token is ever produced, so a request ends by `max_tokens`
(or a stop sequence the ids happen to form). Log probs cannot be given: such a request
fails alone with an error that says so.
"""

from __future__ import annotations

import json
import time
import zlib
from pathlib import Path

import torch

from inflightllm.env_settings import env_number
from inflightllm.model_runner import CompletedStep, RequestStates
from inflightllm.model_source import ModelSpec, prepare
from inflightllm.models.llama import LlamaArch
from inflightllm.models.loader import (
    TORCH_DTYPES,
    LoadedModel,
    eos_token_ids,
    sampleable_vocab_size,
)
from inflightllm.step import SampledTokens, StepDescription

_MASK = (1 << 64) - 1
STEP_MS_ENV = "INFLIGHTLLM_DUMMY_STEP_MS"
LOGPROBS_REFUSED = (
    "the dummy engine (engine.runner: dummy) computes no log probs; "
    "send the request without return_log_probs / num_top_logprobs"
)


def step_seconds() -> float:
    """INFLIGHTLLM_DUMMY_STEP_MS (0 to 10,000 ms, default 0) in seconds."""
    return env_number(STEP_MS_ENV, 0.0, 0.0, 10_000.0, "milliseconds a dummy step waits") / 1e3


def describe_model(spec: ModelSpec) -> LoadedModel:
    """The model's config, architecture numbers and EOS ids, without weights (`model` is None)."""
    folder = prepare(spec)
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    return LoadedModel(
        model=None,
        arch=LlamaArch.from_config(config),
        config=config,
        folder=folder,
        eos_token_ids=eos_token_ids(folder, config),
        dtype=TORCH_DTYPES[spec.dtype],
        device=torch.device("cpu"),
        spec=spec,
    )


def special_token_ids(folder: Path) -> set[int]:
    """Ids of the tokenizer's added (special) tokens, from its tokenizer.json."""
    path = folder / "tokenizer.json"
    if not path.is_file():
        return set()
    return {int(token["id"]) for token in json.loads(path.read_text(encoding="utf-8")).get("added_tokens", [])}


def token_pool(loaded: LoadedModel) -> list[int]:
    """The ids the dummy draws from: the vocabulary minus special and EOS tokens, and
    minus ids beyond the tokenizer's (never sampled: models/loader.py)."""
    excluded = special_token_ids(loaded.folder) | set(loaded.eos_token_ids)
    limit = sampleable_vocab_size(loaded.folder, loaded.arch.vocab_size) or loaded.arch.vocab_size
    pool = [token for token in range(limit) if token not in excluded]
    if not pool:
        raise ValueError(f"the tokenizer in {loaded.folder} leaves no ordinary token to generate")
    return pool


def _mix(value: int) -> int:
    """splitmix64's finaliser: a well-spread 64-bit hash of `value`."""
    value = (value + 0x9E3779B97F4A7C15) & _MASK
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK
    return value ^ (value >> 31)


class DummyRunner:
    """The runner interface (`execute`, `launch`, `num_blocks`) with no model behind it."""

    def __init__(self, pool: list[int], num_blocks: int):
        self.pool = pool
        self.num_blocks = num_blocks
        self.states = RequestStates()
        self._prompt_keys: dict[str, int] = {}
        self._position_mix: list[int] = []  # _mix(position) by output position
        # INFLIGHTLLM_DUMMY_STEP_MS: a step's wait for its "device" (GIL released, as a GPU
        # runner's), to give the response path a model's pace (perf/bench_gpu_server.py).
        self.step_s = step_seconds()

    @classmethod
    def for_model(cls, loaded: LoadedModel, num_blocks: int) -> DummyRunner:
        return cls(token_pool(loaded), num_blocks)

    def token_at(self, prompt_key: int, position: int) -> int:
        """The id generated at output `position` of a request whose prompt hashes to `prompt_key`."""
        return self.pool[_mix(prompt_key ^ _mix(position)) % len(self.pool)]

    def launch(self, step: StepDescription) -> CompletedStep:
        return CompletedStep(self.execute(step))

    def execute(self, step: StepDescription) -> SampledTokens:
        # A model runner waits for its device with the GIL released; the dummy has nothing
        # to wait for, so it yields the GIL once per step (a zero-length wait). Without it
        # the loop thread, which then never blocks, holds the GIL for whole switch intervals
        # (5 ms) and starves the response sender thread it is meant to measure.
        time.sleep(self.step_s)
        for request_id in step.finished_request_ids:
            self._prompt_keys.pop(request_id, None)
        # No KV memory: swaps move nothing. The states keep the tokens and block tables.
        self.states.update(step)
        result = SampledTokens()
        # Per scheduled request: lookups hoisted, and `token_at` inlined with the position's
        # half of the hash cached (`_position_mix[p] == _mix(p)`): the same tokens.
        states = self.states.requests
        prompt_keys = self._prompt_keys
        pool, pool_size, position_mix = self.pool, len(self.pool), self._position_mix
        for request_id, num_new in step.scheduled:
            state = states[request_id]
            tokens = state.token_ids
            if state.num_computed_tokens + num_new != len(tokens):
                continue  # a prefill chunk that does not reach the end samples nothing
            params = state.params
            if params.logprobs or params.top_logprobs:
                result.failed[request_id] = LOGPROBS_REFUSED
                states.pop(request_id, None)
                continue
            key = prompt_keys.get(request_id)
            if key is None:
                key = zlib.crc32(repr(state.prompt_token_ids).encode())
                prompt_keys[request_id] = key
            position = len(tokens) - len(state.prompt_token_ids)
            while len(position_mix) <= position:
                position_mix.append(_mix(len(position_mix)))
            token = pool[_mix(key ^ position_mix[position]) % pool_size]
            tokens.append(token)
            result.request_ids.append(request_id)
            result.token_ids.append(token)
            result.logprobs.append(None)
            result.top_ids.append([])
            result.top_logprobs.append([])
        return result
