"""Offline generation for scripts and benchmarks: `LLM(...).generate(prompts, params)`."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from inflightllm.config import EngineConfig
from inflightllm.engine import Engine
from inflightllm.model_source import ModelSpec, load_tokenizer
from inflightllm.request import FinishReason
from inflightllm.sampling_params import SamplingParams


@dataclass
class GenerationResult:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: FinishReason = FinishReason.NONE
    num_cached_tokens: int = 0
    text: str | None = None


class LLM:
    """An engine plus (optionally) its tokenizer, driven to completion in-process."""

    def __init__(
        self,
        model: ModelSpec | str | Path,
        config: EngineConfig | None = None,
        sampler_seed: int | None = 0,
        load_tokenizer_too: bool = True,
        engine: Engine | None = None,
    ):
        if isinstance(model, (str, Path)):
            model = ModelSpec(source="hf_folder", path=str(model))
        self.model_spec = model
        self.engine = engine if engine is not None else Engine(model, config or EngineConfig(), sampler_seed)
        self.tokenizer = load_tokenizer(model) if load_tokenizer_too else None

    def generate(
        self,
        prompts: list[str] | list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        arrival_steps: list[int] | None = None,
        priorities: list[int] | None = None,
    ) -> list[GenerationResult]:
        """Generate for every prompt; returns results in prompt order.

        `arrival_steps[i]` delays prompt i until that many engine steps have run, to
        exercise requests joining a running batch (in-flight batching).
        """
        if params is None:
            params = SamplingParams()
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        arrivals = arrival_steps or [0] * len(prompts)
        prio = priorities or [0] * len(prompts)
        token_prompts = [self._encode(p) for p in prompts]
        results = [GenerationResult(request_id=f"gen-{i}-{time.monotonic_ns()}", prompt_token_ids=t)
                   for i, t in enumerate(token_prompts)]
        by_id = {r.request_id: r for r in results}
        pending = sorted(range(len(prompts)), key=lambda i: arrivals[i])
        step = 0
        remaining = len(prompts)
        while remaining:
            while pending and arrivals[pending[0]] <= step:
                i = pending.pop(0)
                self.engine.add_request(results[i].request_id, token_prompts[i], params_list[i], priority=prio[i])
            for output in self.engine.step():
                result = by_id[output.request_id]
                result.token_ids.extend(output.new_token_ids)
                result.logprobs.extend(output.new_logprobs)
                if output.finished:
                    result.finish_reason = output.finish_reason
                    result.num_cached_tokens = output.num_cached_tokens
                    remaining -= 1
            step += 1
        if self.tokenizer is not None:
            for result in results:
                result.text = self.tokenizer.decode(result.token_ids, skip_special_tokens=True)
        return results

    def _encode(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need the tokenizer (load_tokenizer_too=True)")
            return self.tokenizer.encode(prompt)
        return list(prompt)
