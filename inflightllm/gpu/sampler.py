"""Batched sampling on the GPU: one set of tensor ops for the whole step.

Per-row settings live in host arrays indexed by the runner's persistent rows (written
once when a request joins) and go to the device as one tensor per step. Greedy,
temperature, top-k, top-p and min-p are vectorised over the batch; the random draw is
the exponential race (argmax of p / E with E ~ Exp(1)), which samples from p. Rows with
their own seed draw E from their own generator, and the rare rows with penalties or
banned tokens are adjusted first; only those rows are visited one by one. Semantics
match the CPU reference sampler (`inflightllm/sampler.py`); log probs are of the raw
model distribution. One device-to-host copy returns the ids (and log probs when asked).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from inflightllm.request import Request
from inflightllm.sampler import _tail_matches


@dataclass
class RowParams:
    """Host arrays of per-row sampling settings, indexed by runner row."""

    temperature: np.ndarray
    top_k: np.ndarray
    top_p: np.ndarray
    min_p: np.ndarray
    greedy: np.ndarray
    special: np.ndarray  # penalties, bans or bad words: adjusted row by row
    min_tokens: np.ndarray  # stop ids banned (all such rows at once) while fewer outputs
    top_logprobs: np.ndarray
    wants_logprobs: np.ndarray

    @classmethod
    def empty(cls, rows: int) -> RowParams:
        return cls(
            temperature=np.ones(rows, np.float32),
            top_k=np.zeros(rows, np.int64),
            top_p=np.ones(rows, np.float32),
            min_p=np.zeros(rows, np.float32),
            greedy=np.ones(rows, bool),
            special=np.zeros(rows, bool),
            min_tokens=np.zeros(rows, np.int64),
            top_logprobs=np.zeros(rows, np.int64),
            wants_logprobs=np.zeros(rows, bool),
        )

    def set_row(self, row: int, request: Request) -> None:
        params = request.params
        self.greedy[row] = params.greedy
        self.temperature[row] = params.temperature if not params.greedy else 1.0
        self.top_k[row] = params.top_k
        self.top_p[row] = params.top_p
        self.min_p[row] = params.min_p
        self.special[row] = bool(params.needs_penalties or request.banned_single or request.banned_multi)
        self.min_tokens[row] = params.min_tokens if request.stop_token_ids else 0
        self.top_logprobs[row] = params.top_logprobs
        self.wants_logprobs[row] = params.logprobs or params.top_logprobs > 0


@dataclass
class SampleResult:
    """One step's samples: device tensors until `to_host` copies them (asynchronously)."""

    token_ids: torch.Tensor  # [m] int64
    wants: np.ndarray  # [m] bool: log probs asked
    top_counts: np.ndarray  # [m] top log probs asked
    chosen: torch.Tensor | None = None  # [m] log prob of the chosen token
    top_values: torch.Tensor | None = None  # [m, k_max]
    top_indices: torch.Tensor | None = None
    errors: dict[int, str] = field(default_factory=dict)  # row index -> why its sampling failed

    def to_host(self, non_blocking: bool = False) -> SampleResult:
        """Copies to (pinned) host memory; with non_blocking, valid once the stream passes."""

        def host(tensor):
            if tensor is None:
                return None
            if not non_blocking or tensor.device.type == "cpu":
                return tensor.cpu()
            out = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            return out.copy_(tensor, non_blocking=True)

        return SampleResult(host(self.token_ids), self.wants, self.top_counts, host(self.chosen),
                            host(self.top_values), host(self.top_indices), self.errors)

    def lists(self):
        """(token ids, log probs or None, top ids or None, top log probs or None) as lists."""
        ids = self.token_ids.tolist()
        if self.chosen is None:
            return ids, None, None, None
        m = len(ids)
        chosen = self.chosen.tolist()
        logprobs = [chosen[i] if self.wants[i] else None for i in range(m)]
        top_ids: list[list[int]] = [[] for _ in range(m)]
        top_values: list[list[float]] = [[] for _ in range(m)]
        if self.top_values is not None:
            values, indices = self.top_values.tolist(), self.top_indices.tolist()
            for i in np.flatnonzero(self.top_counts):
                top_ids[i] = indices[i][: self.top_counts[i]]
                top_values[i] = values[i][: self.top_counts[i]]
        return ids, logprobs, top_ids, top_values


class GpuSampler:
    """Samples one token per row of logits for the runner's rows."""

    def __init__(self, device: torch.device, max_rows: int, seed: int | None = None, upload=None):
        self.device = device
        # host array -> device tensor, asynchronously (the runner's pinned staging)
        self.upload = upload or (lambda array: torch.from_numpy(np.ascontiguousarray(array)).to(
            device, non_blocking=True))
        self.params = RowParams.empty(max_rows)
        self.generator = torch.Generator(device=device)
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)
        self.row_generators: dict[int, torch.Generator] = {}
        self.stop_ids: dict[int, np.ndarray] = {}  # row -> its stop ids, for rows with min_tokens

    def add_row(self, row: int, request: Request) -> None:
        self.params.set_row(row, request)
        if self.params.min_tokens[row]:
            self.stop_ids[row] = np.array(sorted(request.stop_token_ids), np.int64)
        else:
            self.stop_ids.pop(row, None)
        if request.params.seed is not None and not request.params.greedy:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(request.params.seed)
            self.row_generators[row] = generator
        else:
            self.row_generators.pop(row, None)

    def remove_row(self, row: int) -> None:
        self.row_generators.pop(row, None)
        self.stop_ids.pop(row, None)

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, rows: np.ndarray, requests: list[Request]):
        """Sample and wait: returns (token_ids list, logprobs list|None, top ids, top logprobs)."""
        return self.sample(logits, rows, requests).to_host().lists()

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, rows: np.ndarray, requests: list[Request],
               output_counts: np.ndarray | None = None) -> SampleResult:
        """logits [m, vocab] (modified in place) float32, or in the model's 16-bit dtype;
        rows [m] runner rows; requests the runner's states of those rows; `output_counts`
        the tokens each has generated (in flight included), for min_tokens. Returns
        device tensors; nothing waits.

        16-bit logits are converted to float32 first unless every row is greedy with no
        log probs, penalties or bans: an argmax is the same on either (the conversion is
        exact and both take the first maximum), and a greedy step at batch 1,024 skips
        writing and rereading [1,024, vocab] float32 logits (0.5 GB for Llama 3)."""
        p = self.params
        wants, greedy, special = p.wants_logprobs[rows], p.greedy[rows], p.special[rows]
        any_wants, all_greedy, specials = wants.any(), greedy.all(), np.flatnonzero(special)
        if logits.dtype != torch.float32 and not (all_greedy and not any_wants and not len(specials)):
            logits = logits.float()
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any_wants else None
        errors: dict[int, str] = {}
        for index in specials:
            try:
                _adjust_row(logits[index], requests[index], self.upload)
            except Exception as error:  # noqa: BLE001 - this request fails alone
                errors[int(index)] = f"sampling failed: {type(error).__name__}: {error}"
        self._ban_stops_before_min_tokens(logits, rows, requests, output_counts)
        token_ids = torch.argmax(logits, dim=-1)
        if not all_greedy:
            token_ids = torch.where(
                self.upload(greedy), token_ids, self._sample(logits, rows)
            )
        result = SampleResult(token_ids=token_ids, wants=wants, top_counts=p.top_logprobs[rows], errors=errors)
        if raw_logprobs is not None:
            result.chosen = raw_logprobs.gather(1, token_ids[:, None]).squeeze(1)
            k_max = int(result.top_counts.max())
            if k_max:
                result.top_values, result.top_indices = torch.topk(raw_logprobs, k_max, dim=-1)
        return result

    def _ban_stops_before_min_tokens(self, logits, rows, requests, output_counts) -> None:
        """min_tokens: every row with fewer outputs than its minimum gets -inf on its stop
        ids, all rows in one indexed write (one upload of the (row, id) pairs)."""
        minimums = self.params.min_tokens[rows]
        if not minimums.any():
            return
        if output_counts is None:
            output_counts = np.fromiter((r.num_output_tokens for r in requests), np.int64, len(requests))
        below = np.flatnonzero(np.asarray(output_counts) < minimums)
        if not len(below):
            return
        ids = [self.stop_ids[int(rows[i])] for i in below]
        # One flat index per (row, id), filled with index_fill_: `logits[r, c] = float` would
        # copy the scalar from pageable host memory, and that copy waits for the stream (it
        # was half of the engine process's CPU samples on the H200, spinning there, and it
        # undid the asynchronous scheduling's overlap).
        vocab = logits.shape[1]
        flat = np.repeat(below * vocab, [len(a) for a in ids]) + np.concatenate(ids)
        _fill_neg_inf(logits, self.upload(flat))

    def _sample(self, logits: torch.Tensor, rows: np.ndarray) -> torch.Tensor:
        p = self.params
        settings = self.upload(
            np.stack([p.temperature[rows], p.top_p[rows], p.min_p[rows], p.top_k[rows].astype(np.float32)], axis=1)
        )
        temperature, top_p, min_p, top_k = settings.unbind(1)
        scaled = logits / temperature[:, None]
        vocab = scaled.shape[1]
        top_k_rows = p.top_k[rows]
        if ((top_k_rows > 0) & (top_k_rows < vocab)).any() or (p.top_p[rows] < 1.0).any():
            sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
            k = torch.where((top_k > 0) & (top_k < vocab), top_k, torch.full_like(top_k, vocab)).long()
            kth = sorted_logits.gather(1, (k - 1)[:, None])  # [m, 1]
            sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
            probs_sorted = torch.softmax(sorted_logits, dim=-1)
            before = probs_sorted.cumsum(dim=-1) - probs_sorted  # mass strictly before each token
            drop = before >= top_p[:, None]
            drop[:, 0] = False
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
            scaled = torch.empty_like(scaled).scatter_(1, order, sorted_logits)
        probs = torch.softmax(scaled, dim=-1)
        if (p.min_p[rows] > 0).any():
            probs = probs.masked_fill(probs < min_p[:, None] * probs.amax(dim=-1, keepdim=True), 0.0)
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for index, row in enumerate(rows):
            generator = self.row_generators.get(int(row))
            if generator is not None:
                noise[index].exponential_(generator=generator)
        return torch.argmax(probs / noise, dim=-1)


def _fill_neg_inf(logits: torch.Tensor, flat_index: torch.Tensor) -> None:
    """-inf at these flat positions of `logits` (contiguous), with no host-device sync."""
    logits.view(-1).index_fill_(0, flat_index, float("-inf"))


def _adjust_row(row: torch.Tensor, request: Request, upload) -> None:
    """Penalties and bans of one request, as the CPU reference sampler applies them
    (min_tokens is applied to all rows at once: `_ban_stops_before_min_tokens`). `upload`
    copies a host array to the device without making the host wait (pinned staging)."""
    params = request.params
    if params.repetition_penalty != 1.0:
        seen = upload(np.array(sorted(set(request.token_ids)), np.int64))
        scores = row[seen]
        penalty = params.repetition_penalty
        row[seen] = torch.where(scores < 0, scores * penalty, scores / penalty)
    if (params.presence_penalty or params.frequency_penalty) and request.num_output_tokens:
        outputs = upload(np.asarray(request.output_token_ids, np.int64))
        # (bincount on the GPU reads the largest id back to size its result: a sync)
        counts = torch.zeros_like(row).index_add_(0, outputs, torch.ones(outputs.shape, dtype=row.dtype, device=row.device))
        row -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(row.dtype)
    banned = set(request.banned_single)
    for sequence in request.banned_multi:
        if _tail_matches(request.token_ids, sequence[:-1]):
            banned.add(sequence[-1])
    if banned:
        _fill_neg_inf(row, upload(np.array(sorted(banned), np.int64)))
