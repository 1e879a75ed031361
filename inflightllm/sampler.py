"""Turns logits into next tokens: penalties, bans, temperature, top-k/top-p/min-p,
seeded sampling, and log probs of the model's own distribution."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from inflightllm.request import Request


@dataclass
class SampleOutput:
    token_ids: list[int]  # -1 where the row failed
    logprobs: list[float | None] = field(default_factory=list)  # of the chosen token
    top_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)
    errors: list[str | None] = field(default_factory=list)  # per row: why it failed, or None


def _tail_matches(tokens: list[int], prefix: tuple[int, ...]) -> bool:
    return len(tokens) >= len(prefix) and tuple(tokens[len(tokens) - len(prefix) :]) == prefix


class SamplingError(RuntimeError):
    """One row could not be sampled (non-finite logits, nothing left to sample, ...)."""


class Sampler:
    """Samples one token per row of logits; rows follow the given requests.

    Each row is guarded on its own: a row whose sampling fails (NaN logits, every token
    banned, a failing knob) gets an error in `SampleOutput.errors` and token id -1, and
    the other rows are sampled as usual.
    """

    def __init__(self, seed: int | None = None):
        self.generator = torch.Generator()
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)

    @torch.inference_mode()  # the model's logits are inference tensors: in-place edits need this mode
    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> SampleOutput:
        """logits: [num_requests, vocab_size] float32 (modified in place)."""
        raw_logprobs = None
        if any(r.params.logprobs or r.params.top_logprobs for r in requests):
            raw_logprobs = torch.log_softmax(logits, dim=-1)  # row-wise: a bad row spoils only itself
        output = SampleOutput(token_ids=[])
        for row, request in enumerate(requests):
            try:
                token, logprob, top_ids, top_values = self._sample_one(logits[row], raw_logprobs, row, request)
            except Exception as error:  # this request fails alone
                output.token_ids.append(-1)
                output.logprobs.append(None)
                output.top_ids.append([])
                output.top_logprobs.append([])
                output.errors.append(f"sampling failed: {type(error).__name__}: {error}")
                continue
            output.token_ids.append(token)
            output.logprobs.append(logprob)
            output.top_ids.append(top_ids)
            output.top_logprobs.append(top_values)
            output.errors.append(None)
        return output

    def _sample_one(self, row_logits: torch.Tensor, raw_logprobs, row: int, request: Request):
        if bool(torch.isnan(row_logits).any()):
            raise SamplingError("the model's logits hold NaN")
        self._apply_penalties_and_bans(row_logits, request)
        if not bool(torch.isfinite(row_logits).any()):
            raise SamplingError("no token is left to sample (every logit is -inf or inf)")
        if request.params.greedy:
            token = int(torch.argmax(row_logits))
        else:
            token = self._sample_row(row_logits, request)
        params = request.params
        if raw_logprobs is None or not (params.logprobs or params.top_logprobs):
            return token, None, [], []
        logprob = float(raw_logprobs[row, token])
        if not params.top_logprobs:
            return token, logprob, [], []
        values, ids = torch.topk(raw_logprobs[row], params.top_logprobs)
        return token, logprob, ids.tolist(), values.tolist()

    def _apply_penalties_and_bans(self, row: torch.Tensor, request: Request) -> None:
        params = request.params
        if params.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(request.token_ids)), dtype=torch.int64)
            scores = row[seen]
            penalty = params.repetition_penalty
            row[seen] = torch.where(scores < 0, scores * penalty, scores / penalty)
        if (params.presence_penalty or params.frequency_penalty) and request.num_output_tokens:
            outputs = torch.tensor(request.output_token_ids, dtype=torch.int64)
            counts = torch.bincount(outputs, minlength=row.shape[0]).to(row.dtype)
            row -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(row.dtype)
        banned = set(request.banned_single)
        for sequence in request.banned_multi:
            if _tail_matches(request.token_ids, sequence[:-1]):
                banned.add(sequence[-1])
        if request.num_output_tokens < params.min_tokens:
            banned |= request.stop_token_ids
        if banned:
            row[torch.tensor(sorted(banned), dtype=torch.int64)] = float("-inf")

    def _sample_row(self, row: torch.Tensor, request: Request) -> int:
        params = request.params
        probs = sampling_distribution(row, params)
        if not bool(torch.isfinite(probs).all()) or not float(probs.sum()) > 0.0:
            raise SamplingError(f"the sampling distribution is not finite (temperature {params.temperature})")
        generator = request.generator if request.generator is not None else self.generator
        return int(torch.multinomial(probs, 1, generator=generator))


def sampling_distribution(row: torch.Tensor, params) -> torch.Tensor:
    """The distribution a sampled row draws from ([vocab], not normalised after min-p):
    temperature, then top-k (every logit >= the k-th largest), top-p (drop a token once
    the mass before it in descending order reaches top_p; keep the first), min-p. The
    semantics every sampler matches (the GPU sampler's tests compare with this)."""
    row = row / params.temperature
    if params.top_k > 0 and params.top_k < row.shape[0]:
        kth = torch.topk(row, params.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(row, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        # Drop tokens once the mass before them already reaches top_p (keep >= 1).
        drop_sorted = (cumulative - torch.softmax(sorted_logits, dim=-1)) >= params.top_p
        drop_sorted[0] = False
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        row = row.masked_fill(drop, float("-inf"))
    probs = torch.softmax(row, dim=-1)
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    return probs
