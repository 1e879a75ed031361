"""Batched sampling on the GPU: one set of tensor ops for the whole step, no full sort.

Per-row settings live in host arrays indexed by the runner's persistent rows (written
once when a request joins) and go to the device as small tensors per step. Semantics
match the CPU reference sampler (`inflightllm/sampler.py`); how, and where ties go:

- Top-k rows (0 < top_k <= TOP_K_MAX): one `torch.topk` over those rows takes each row's
  best `candidates(top_k)` logits, sorted (a few more than top_k, so that the logits tied
  with the k-th are kept as the reference keeps them). top-p, min-p, the softmax and the
  draw then run on those [rows, k] candidates only.
- Other sampled rows (top-p without top-k, or top_k > TOP_K_MAX) find their top-k and
  top-p thresholds by bisection over the logits' bit patterns: a fixed number of batched
  reductions (16 for bf16/fp16 logits, 32 for float32: the count of logits >= t, the
  mass of the probabilities of logits >= t), no sort and no host sync. The threshold
  found is exactly the smallest logit the reference keeps.
- The draw is the exponential race (argmax of p / E with E ~ Exp(1)), which samples from
  p. A seeded row's E is a function of its seed, its draw's index (the tokens it generated
  before) and the entry (`seeded_exponential`, counter-based: all seeded rows in one
  kernel, where a torch generator per row cost a launch and ~0.1 ms of host time per row
  per step), over a length fixed by its own settings: its tokens depend on neither its
  batch neighbours nor a preemption.
- Penalties read per-row token counts kept on the device (`PenaltyCounts`), updated from
  the sampled ids on the device: all penalty rows in one set of ops, no host round trip.
- Log probs are of the raw model distribution: one log-sum-exp per row, the chosen logit
  and a top-k of the raw logits minus it; no [rows, vocab] log-softmax tensor.

Ties: a token whose value equals the smallest kept value is kept (top-k and top-p alike;
the reference's top-k does the same, its top-p keeps those tied tokens its sort happens
to put first). A top-k row considers only its first `candidates(top_k)` logits.
Bans (bad words) are the rare rows visited one by one. One device-to-host copy returns
the ids (and log probs when asked).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from inflightllm.request import Request
from inflightllm.sampler import _tail_matches

# Rows with top_k up to this take the top-k path (torch.topk of candidates(top_k) <= 1,024
# logits per row); larger top_k find their threshold by bisection over the whole row.
TOP_K_MAX = 512


def candidates(top_k: np.ndarray | int, vocab: int):
    """Logits a top-k row considers: its k and as many again (at least 16), so that the
    logits tied with the k-th (frequent with bf16 logits) are kept as the reference keeps
    them; capped at the vocabulary."""
    return np.minimum(vocab, top_k + np.maximum(top_k, 16))


@dataclass
class RowParams:
    """Host arrays of per-row sampling settings, indexed by runner row."""

    temperature: np.ndarray
    top_k: np.ndarray
    top_p: np.ndarray
    min_p: np.ndarray
    greedy: np.ndarray
    bans: np.ndarray  # bad words: adjusted row by row
    penalized: np.ndarray  # repetition, presence or frequency penalty: batched on device counts
    repetition: np.ndarray
    presence: np.ndarray
    frequency: np.ndarray
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
            bans=np.zeros(rows, bool),
            penalized=np.zeros(rows, bool),
            repetition=np.ones(rows, np.float32),
            presence=np.zeros(rows, np.float32),
            frequency=np.zeros(rows, np.float32),
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
        self.bans[row] = bool(request.banned_single or request.banned_multi)
        self.penalized[row] = params.needs_penalties
        self.repetition[row] = params.repetition_penalty
        self.presence[row] = params.presence_penalty
        self.frequency[row] = params.frequency_penalty
        self.min_tokens[row] = params.min_tokens if request.stop_token_ids else 0
        self.top_logprobs[row] = params.top_logprobs
        self.wants_logprobs[row] = params.logprobs or params.top_logprobs > 0


class PenaltyCounts:
    """Per-row token counts on the device, for the rows with penalties only.

    Each penalty row gets a slot: `output_counts[slot]` ([vocab] int32: how often each id
    was generated) and `seen[slot]` ([vocab] bool: the id is in the prompt or was
    generated: the repetition penalty's set, read without the counts). A row's
    slot is filled from its tokens at its first sampling step (the vocabulary is known
    then) and updated from the sampled ids on the device after each step, so penalties
    need no host copy of the tokens in flight. 5 bytes per id: 0.64 MB per penalty row at
    Llama 3's 128,256 ids (0.66 GB for 1,024 penalty rows); the slots grow by doubling as
    penalty rows arrive."""

    def __init__(self, device: torch.device, max_rows: int):
        self.device = device
        self.slot_of_row = np.full(max_rows, -1, np.int64)
        self.free_slots: list[int] = []
        self.num_slots = 0
        self.vocab = 0
        self.output_counts: torch.Tensor | None = None  # [capacity, vocab] int32
        self.seen: torch.Tensor | None = None  # [capacity, vocab] bool
        self.pending: dict[int, tuple[list[int], list[int]]] = {}  # row -> (prompt, outputs) to fill
        self.failed: dict[int, str] = {}  # row -> why its counts could not be filled

    def add_row(self, row: int, request: Request) -> None:
        self.remove_row(row)
        if self.free_slots:
            slot = self.free_slots.pop()
        else:
            slot = self.num_slots
            self.num_slots += 1
        self.slot_of_row[row] = slot
        self.pending[row] = (list(request.prompt_token_ids), list(request.output_token_ids))

    def remove_row(self, row: int) -> None:
        slot = int(self.slot_of_row[row])
        if slot >= 0:
            self.free_slots.append(slot)
            self.slot_of_row[row] = -1
        self.pending.pop(row, None)
        self.failed.pop(row, None)

    def fill_pending(self, vocab: int, upload) -> None:
        """Allocate (or grow) the slots for this vocabulary and fill the new rows' counts."""
        if self.vocab not in (0, vocab):
            raise ValueError(f"logits of {vocab} ids after logits of {self.vocab}: the vocabulary cannot change")
        self.vocab = vocab
        capacity = 0 if self.output_counts is None else self.output_counts.shape[0]
        if self.num_slots > capacity:
            grown = min(max(self.num_slots, 2 * capacity, 8), len(self.slot_of_row))  # at most a slot per row
            counts = torch.zeros(grown, vocab, dtype=torch.int32, device=self.device)
            seen = torch.zeros(grown, vocab, dtype=torch.bool, device=self.device)
            if capacity:
                counts[:capacity].copy_(self.output_counts)
                seen[:capacity].copy_(self.seen)
            self.output_counts, self.seen = counts, seen
        for row, (prompt, outputs) in self.pending.items():
            bad = [token for token in prompt + outputs if not 0 <= token < vocab]
            if bad:
                self.failed[row] = f"sampling failed: IndexError: token id {bad[0]} is outside the {vocab} logits"
                continue
            slot = int(self.slot_of_row[row])
            self.output_counts[slot].zero_()
            self.seen[slot].zero_()
            if prompt or outputs:
                self.seen[slot].index_fill_(0, upload(np.asarray(prompt + outputs, np.int64)), True)
            if outputs:
                ids = upload(np.asarray(outputs, np.int64))
                self.output_counts[slot].index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))
        self.pending.clear()

    def record(self, slots: torch.Tensor, token_ids: torch.Tensor) -> None:
        """Count each slot's sampled id (device tensors: nothing waits)."""
        flat = slots * self.vocab + token_ids
        self.output_counts.view(-1).index_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        self.seen.view(-1).index_fill_(0, flat, True)


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
        # Seeded rows (their E from `seeded_exponential`): the seed of each row, and which are.
        self.row_seed = np.zeros(max_rows, np.int64)
        self.row_seeded = np.zeros(max_rows, bool)
        self.stop_ids: dict[int, np.ndarray] = {}  # row -> its stop ids, for rows with min_tokens
        self.penalty_counts = PenaltyCounts(device, max_rows)

    def add_row(self, row: int, request: Request) -> None:
        self.params.set_row(row, request)
        if self.params.min_tokens[row]:
            self.stop_ids[row] = np.array(sorted(request.stop_token_ids), np.int64)
        else:
            self.stop_ids.pop(row, None)
        seeded = request.params.seed is not None and not request.params.greedy
        self.row_seeded[row] = seeded
        self.row_seed[row] = request.params.seed if seeded else 0
        if self.params.penalized[row]:
            self.penalty_counts.add_row(row, request)
        else:
            self.penalty_counts.remove_row(row)

    def remove_row(self, row: int) -> None:
        self.row_seeded[row] = False
        self.stop_ids.pop(row, None)
        self.penalty_counts.remove_row(row)

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

        16-bit logits are never converted as a whole unless penalty rows share the step
        with other rows: greedy rows take the argmax of the 16-bit logits (the conversion
        is exact and both take the first maximum), top-k rows convert only their
        candidates, the other sampled rows as they divide by the temperature, and log
        probs sum in float32. A greedy step at batch 1,024 (Llama 3) so skips writing and
        rereading [1,024, vocab] float32 logits (0.5 GB)."""
        rows = np.asarray(rows)
        p = self.params
        m, vocab = logits.shape
        wants, greedy, top_counts = p.wants_logprobs[rows], p.greedy[rows], p.top_logprobs[rows]
        result = SampleResult(token_ids=None, wants=wants, top_counts=top_counts)
        asking = np.flatnonzero(wants)
        lse = self._raw_logprob_stats(logits, asking, top_counts, result) if len(asking) else None

        work = self._apply_penalties(logits, rows, wants, result.errors)
        for index in np.flatnonzero(p.bans[rows]):
            try:
                _ban_row(work[index], requests[index], self.upload)
            except Exception as error:  # noqa: BLE001 - this request fails alone
                result.errors[int(index)] = f"sampling failed: {type(error).__name__}: {error}"
        self._ban_stops_before_min_tokens(work, rows, requests, output_counts)

        if greedy.all():
            token_ids = torch.argmax(work, dim=-1)
        else:
            token_ids = (torch.argmax(work, dim=-1) if greedy.any()
                         else torch.empty(m, dtype=torch.int64, device=logits.device))
            top_k_group, full_group = self._top_k_groups(rows, vocab)
            draws = None  # each row's draw index: the tokens it generated before this one (seeded rows)
            if self.row_seeded[rows].any():
                draws = (np.asarray(output_counts, np.int64) if output_counts is not None else
                         np.fromiter((r.num_output_tokens for r in requests), np.int64, len(requests)))
            for group, draw in ((top_k_group, self._sample_top_k), (full_group, self._sample_full)):
                if len(group):
                    token_ids = _put(token_ids, group, draw(_take(work, group, self.upload), rows[group],
                                                            None if draws is None else draws[group]), self.upload)
        result.token_ids = token_ids

        penalized = np.flatnonzero(p.penalized[rows])
        if len(penalized):  # the counts follow the sampled ids on the device
            slots = self.upload(self.penalty_counts.slot_of_row[rows[penalized]])
            self.penalty_counts.record(slots, _take(token_ids, penalized, self.upload))
        if lse is not None:
            # The logits at the chosen ids are raw: bans never hit a chosen id, and
            # penalties went to a copy where a row asks for log probs.
            chosen = logits.gather(1, token_ids[:, None]).squeeze(1).float()
            chosen = _take(chosen, asking, self.upload) - lse
            result.chosen = _put(torch.zeros(m, device=logits.device), asking, chosen, self.upload)
        return result

    # ---- log probs ----------------------------------------------------------------------
    def _raw_logprob_stats(self, logits, asking, top_counts, result) -> torch.Tensor:
        """The log-sum-exp of the rows asking for log probs ([w] float32) and their top log
        probs into `result` (a topk of the raw logits, the order of a topk of the log probs)."""
        raw = _take(logits, asking, self.upload)  # [w, vocab]
        maxima = raw.amax(dim=-1, keepdim=True).float()  # [w, 1]
        # one [w, vocab] float32 temporary, exponentiated in place
        lse = maxima.squeeze(1) + torch.sub(raw, maxima).exp_().sum(dim=-1).log_()
        k_max = int(top_counts.max())
        if k_max:
            m = len(top_counts)
            values, indices = torch.topk(raw, k_max, dim=-1)
            values = values.float() - lse[:, None]
            result.top_values = _put(torch.zeros(m, k_max, device=logits.device), asking, values, self.upload)
            result.top_indices = _put(torch.zeros(m, k_max, dtype=torch.int64, device=logits.device), asking,
                                      indices, self.upload)
        return lse

    # ---- penalties and bans ---------------------------------------------------------------
    def _apply_penalties(self, logits: torch.Tensor, rows: np.ndarray, wants: np.ndarray,
                         errors: dict[int, str]) -> torch.Tensor:
        """Repetition (prompt and output ids), presence and frequency (output ids) penalties
        of every penalty row at once, as the reference applies them, in float32. Returns the
        logits to sample from: `logits` itself when no row has penalties; a new tensor when
        a penalty row asks for log probs (those stay of the raw logits)."""
        p, counts = self.params, self.penalty_counts
        penalized = np.flatnonzero(p.penalized[rows])
        if not len(penalized):
            return logits
        counts.fill_pending(logits.shape[1], self.upload)
        if counts.failed:  # (rare: no per-row Python loop otherwise)
            failed = [index for index in penalized if int(rows[index]) in counts.failed]
            for index in failed:
                errors[int(index)] = counts.failed[int(rows[index])]
            penalized = np.setdiff1d(penalized, failed)
            if not len(penalized):
                return logits
        penalty_rows = rows[penalized]
        repetition, presence, frequency = self._settings(
            p.repetition[penalty_rows], p.presence[penalty_rows], p.frequency[penalty_rows])
        slots = self.upload(counts.slot_of_row[penalty_rows])
        scores = _take(logits, penalized, self.upload).float()  # [r, vocab], out of place from here on
        # Each term only where some row has it (the others' would leave their logits as they are).
        if (p.repetition[penalty_rows] != 1.0).any():
            seen = counts.seen.index_select(0, slots)  # [r, vocab] bool
            scores = torch.where(seen, torch.where(scores < 0, scores * repetition, scores / repetition), scores)
        if (p.presence[penalty_rows] != 0.0).any() or (p.frequency[penalty_rows] != 0.0).any():
            outputs = counts.output_counts.index_select(0, slots).float()  # [r, vocab]
            scores = scores - (frequency * outputs + presence * (outputs > 0).float())
        if scores is logits:
            scores = scores.clone()
        if len(penalized) == len(rows):
            return scores
        if logits.dtype != torch.float32:
            work = logits.float()
        else:
            work = logits.clone() if wants[penalized].any() else logits
        return work.index_copy_(0, self.upload(penalized), scores)

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

    # ---- the draws ------------------------------------------------------------------------
    def _settings(self, *columns: np.ndarray) -> list[torch.Tensor]:
        """Per-row float settings ([r] host arrays) as [r, 1] float32 device tensors, in one upload."""
        stacked = self.upload(np.stack([np.asarray(c, np.float32) for c in columns], axis=1))
        return [column[:, None] for column in stacked.unbind(1)]

    def _top_k_groups(self, rows: np.ndarray, vocab: int) -> tuple[np.ndarray, np.ndarray]:
        """Indices of the sampled rows of `rows` on the top-k path and on the full path."""
        p = self.params
        sampled = ~p.greedy[rows]
        top_k = p.top_k[rows]
        top_k_rows = sampled & (top_k > 0) & (top_k <= TOP_K_MAX) & (top_k < vocab)
        return np.flatnonzero(top_k_rows), np.flatnonzero(sampled & ~top_k_rows)

    @torch.inference_mode()
    def distribution(self, logits: torch.Tensor, rows: np.ndarray) -> torch.Tensor:
        """[m, vocab] float32: the normalised distribution each row's draw follows, from
        these logits as they are (no penalties or bans); a greedy row's is its argmax.
        What the tests compare with the reference's `sampling_distribution`."""
        rows = np.asarray(rows)
        m, vocab = logits.shape
        out = torch.zeros(m, vocab, device=logits.device)
        out.scatter_(1, torch.argmax(logits, dim=-1, keepdim=True), 1.0)
        top_k_group, full_group = self._top_k_groups(rows, vocab)
        if len(top_k_group):
            weights, indices = self._top_k_weights(_take(logits, top_k_group, self.upload), rows[top_k_group])
            dense = torch.zeros(len(top_k_group), vocab, device=logits.device).scatter_(1, indices, weights)
            out.index_copy_(0, self.upload(top_k_group), dense)
        if len(full_group):
            out.index_copy_(0, self.upload(full_group), self._full_weights(_take(logits, full_group, self.upload),
                                                                            rows[full_group]))
        return out / out.sum(dim=-1, keepdim=True)

    def _sample_top_k(self, logits: torch.Tensor, rows: np.ndarray, draws: np.ndarray | None = None) -> torch.Tensor:
        weights, indices = self._top_k_weights(logits, rows)
        lengths = candidates(self.params.top_k[rows], logits.shape[1])
        return indices.gather(1, self._race(weights, rows, lengths, draws)[:, None]).squeeze(1)

    def _sample_full(self, logits: torch.Tensor, rows: np.ndarray, draws: np.ndarray | None = None) -> torch.Tensor:
        return self._race(self._full_weights(logits, rows), rows, None, draws)

    def _top_k_weights(self, logits: torch.Tensor, rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows with 0 < top_k <= TOP_K_MAX: [r, vocab] logits (any float dtype) -> the
        [r, c] weights (unnormalised probabilities, 0 = dropped) of the [r, c] ids of one
        topk of the largest `candidates(top_k)`, sorted. The reference's masks on those:
        keep >= the k-th; top-p on the cumulative mass in that order (the smallest value
        whose mass before it is below top_p, and every value at least it); min-p against
        the top probability."""
        p = self.params
        top_k = p.top_k[rows]
        lengths = candidates(top_k, logits.shape[1])
        temperature, top_p, min_p, kth_index, length = self._settings(
            p.temperature[rows], p.top_p[rows], p.min_p[rows], top_k - 1, lengths)
        values, indices = torch.topk(logits, int(lengths.max()), dim=-1)  # [r, c] descending
        scaled = values.float() / temperature  # temperature > 0 keeps the order
        position = torch.arange(scaled.shape[1], device=scaled.device)[None, :]
        kth = scaled.gather(1, kth_index.long())
        keep = (position < length) & (scaled >= kth)
        scaled = scaled.masked_fill(~keep, float("-inf"))
        probs = torch.softmax(scaled, dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass strictly before each candidate
        smallest_kept = torch.where(before < top_p, scaled, float("inf")).amin(dim=-1, keepdim=True)
        keep &= (scaled >= smallest_kept) | (top_p >= 1.0)
        keep &= probs >= min_p * probs[:, :1]  # min_p 0 keeps all; the first is the largest
        return probs.masked_fill(~keep, 0.0), indices

    def _full_weights(self, logits: torch.Tensor, rows: np.ndarray) -> torch.Tensor:
        """Other sampled rows (no top-k, or top_k > TOP_K_MAX): [r, vocab] -> [r, vocab]
        weights over the whole vocabulary. The k-th largest logit and the smallest logit
        top-p keeps come from bisection (`_largest_threshold`) over the logits as given
        (16-bit logits: 16 rounds; float32: 32), never a sort; on CUDA top-p's search tries
        MASS_THRESHOLDS thresholds a round (`largest_mass_threshold`: 4 rounds; float32: 7). Dividing by a temperature
        keeps the order, so thresholds on the given logits are thresholds on the scaled."""
        p = self.params
        vocab = logits.shape[1]
        top_k, top_p, min_p = p.top_k[rows], p.top_p[rows], p.min_p[rows]
        (temperature,) = self._settings(p.temperature[rows])
        scaled = logits / temperature  # [r, vocab] float32 (a 16-bit input is promoted)
        lowest = torch.full((len(rows),), float("-inf"), dtype=logits.dtype, device=logits.device)
        highest = logits.amax(dim=-1)  # [r]: above it, nothing counts
        big_k = (top_k > 0) & (top_k < vocab)
        if big_k.any():  # rows without one get a count no threshold reaches: nothing masked
            wanted = self.upload(np.where(big_k, top_k, vocab + 1).astype(np.int64))
            kth = _largest_threshold(wanted, lambda t: (logits >= t[:, None]).sum(dim=-1), lowest, highest)
            scaled.masked_fill_(logits < kth[:, None], float("-inf"))
        probs = torch.softmax(scaled, dim=-1)
        del scaled
        if (top_p < 1.0).any():  # rows at 1 get a mass no threshold reaches: nothing masked
            (mass,) = self._settings(np.where(top_p < 1.0, top_p, np.inf))
            if logits.is_cuda:  # MASS_THRESHOLDS thresholds a pass, one kernel each
                smallest_kept = largest_mass_threshold(logits, probs, mass[:, 0], lowest, highest)
            else:
                smallest_kept = _largest_threshold(
                    mass[:, 0], lambda t: torch.where(logits >= t[:, None], probs, 0.0).sum(dim=-1), lowest, highest)
            probs.masked_fill_(logits < smallest_kept[:, None], 0.0)
        if (min_p > 0).any():
            (minimum,) = self._settings(min_p)
            probs.masked_fill_(probs < minimum * probs.amax(dim=-1, keepdim=True), 0.0)
        return probs

    def _race(self, probs: torch.Tensor, rows: np.ndarray, lengths: np.ndarray | None,
              draws: np.ndarray | None = None) -> torch.Tensor:
        """argmax of probs / E, E ~ Exp(1) per entry: a draw from probs (unnormalised).
        A seeded row's E is `seeded_exponential(seed, draws[i])` over its own `lengths[i]`
        entries (all of them where lengths is None): a length its own settings fix, so its
        draw depends on neither the rows beside it nor the sampler's generator."""
        noise = torch.empty(probs.shape, dtype=torch.float32, device=probs.device).exponential_(
            generator=self.generator)
        seeded = np.flatnonzero(self.row_seeded[rows])
        if len(seeded):
            width = probs.shape[1]
            ends = (np.full(len(seeded), width, np.int64) if lengths is None
                    else np.minimum(np.asarray(lengths, np.int64)[seeded], width))
            counters = np.zeros(len(seeded), np.int64) if draws is None else np.asarray(draws, np.int64)[seeded]
            write_seeded_exponential(noise, seeded, self.row_seed[rows[seeded]], counters, ends, self.upload)
        return torch.argmax(probs / noise, dim=-1)


# ---- seeded rows' noise: counter-based, all rows at once --------------------------------------
# E[j] = -log(u), u = ((h >> 40) + 0.5) / 2**24 in (0, 1), h = mix(key + (j + 1) * GOLDEN),
# key = mix(mix(seed) + counter): splitmix64's finaliser (`mix`) over the seed, the draw's index
# and the entry. The CUDA kernel and `seeded_exponential` (NumPy, the CPU device's and the
# tests' reference) compute the same bits; -log differs by at most an ulp or two.
_GOLDEN = 0x9E3779B97F4A7C15
_MASK64 = (1 << 64) - 1

_SEEDED_EXPONENTIAL_SOURCE = r"""
__device__ __forceinline__ unsigned long long mix64(unsigned long long z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

// noise [*, row_stride] float32: row index[i] gets E over its first lengths[i] entries.
// grid (x, number of seeded rows), any x; 256 threads.
extern "C" __global__ void seeded_exponential(float* __restrict__ noise, long long row_stride,
                                              const long long* __restrict__ index,
                                              const long long* __restrict__ seeds,
                                              const long long* __restrict__ counters,
                                              const long long* __restrict__ lengths) {
    const int i = blockIdx.y;
    const long long length = lengths[i];
    const unsigned long long key = mix64(mix64((unsigned long long)seeds[i]) + (unsigned long long)counters[i]);
    float* row = noise + index[i] * row_stride;
    for (long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x; j < length;
         j += (long long)gridDim.x * blockDim.x) {
        const unsigned long long bits = mix64(key + (unsigned long long)(j + 1) * 0x9E3779B97F4A7C15ULL);
        const float u = ((float)(bits >> 40) + 0.5f) * 5.9604644775390625e-08f;
        row[j] = -logf(u);
    }
}
"""


def _mix64(z: np.ndarray) -> np.ndarray:
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def seeded_exponential(seed: int, counter: int, length: int) -> np.ndarray:
    """[length] float32: a seeded row's E for its draw number `counter` (the reference)."""
    with np.errstate(over="ignore"):
        key = _mix64(_mix64(np.array([seed & _MASK64], np.uint64)) + np.uint64(counter & _MASK64))
        entries = np.arange(1, length + 1, dtype=np.uint64) * np.uint64(_GOLDEN)
        bits = _mix64(key + entries)
    u = ((bits >> np.uint64(40)).astype(np.float32) + np.float32(0.5)) * np.float32(2.0 ** -24)
    return -np.log(u)


_SEEDED_KERNELS: dict[int, object] = {}


def _seeded_kernel(device: int):
    kernel = _SEEDED_KERNELS.get(device)
    if kernel is None:
        import cupy

        with cupy.cuda.Device(device):
            kernel = cupy.RawKernel(_SEEDED_EXPONENTIAL_SOURCE, "seeded_exponential")
            kernel.compile()
        kernel = _SEEDED_KERNELS[device] = kernel
    return kernel


def write_seeded_exponential(noise: torch.Tensor, index: np.ndarray, seeds: np.ndarray, counters: np.ndarray,
                             lengths: np.ndarray, upload) -> None:
    """Rows `index` of `noise` ([r, width] float32) get their seeded E over their first
    `lengths` entries: one kernel for all of them on CUDA (no host sync), the NumPy
    reference on the CPU."""
    if noise.device.type != "cuda":
        for i, row in enumerate(np.asarray(index).tolist()):
            end = int(lengths[i])
            noise[row, :end] = torch.from_numpy(seeded_exponential(int(seeds[i]), int(counters[i]), end))
        return
    if noise.dtype != torch.float32 or noise.stride(1) != 1:
        raise ValueError(f"seeded noise: float32 rows of unit stride expected, got {noise.dtype} {noise.stride()}")
    from inflightllm.gpu import ops

    packed = upload(np.stack([np.asarray(index, np.int64), np.asarray(seeds, np.int64),
                              np.asarray(counters, np.int64), np.asarray(lengths, np.int64)]))
    threads = 256
    blocks = max(1, min(64, -(-int(np.max(lengths)) // (threads * 4))))
    with ops.torch_stream():
        _seeded_kernel(noise.device.index)(
            (blocks, len(index)), (threads,),
            (ops._ptr(noise), np.int64(noise.stride(0)), ops._ptr(packed[0]), ops._ptr(packed[1]),
             ops._ptr(packed[2]), ops._ptr(packed[3])))


def _float_key(values: torch.Tensor) -> torch.Tensor:
    """float32/bf16/fp16 -> int64 with the same order (-0.0 just below +0.0)."""
    bits = values.contiguous().view(_BITS[values.element_size()]).to(torch.int64)
    sign_free = (1 << (8 * values.element_size() - 1)) - 1  # every bit but the sign's
    return torch.where(bits >= 0, bits, bits ^ sign_free)


def _key_float(keys: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    size = torch.empty(0, dtype=dtype).element_size()
    sign_free = (1 << (8 * size - 1)) - 1
    return torch.where(keys >= 0, keys, keys ^ sign_free).to(_BITS[size]).view(dtype)


_BITS = {2: torch.int16, 4: torch.int32}


def _largest_threshold(target: torch.Tensor, measure, low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """Per row, the largest float t (of low's dtype) with measure(t) >= target, where
    measure(t) [r] (the count, or the mass, of a row's entries >= t) falls as t rises;
    `low` [r] meets the target (or is returned), `high` [r] is the row's largest entry
    (above it the measure is 0).

    Bisection over the floats' bit patterns, ordered as integers: 16 or 32 halvings cover
    every 16- or 32-bit float, so the answer is exact; and as the measure only changes at
    the row's values, the largest t is one of them: the k-th largest logit for a count of
    k, the smallest logit top-p keeps for a mass of top_p. A fixed number of batched
    reductions, no sort, no host sync."""
    lo = _float_key(low)
    hi = _float_key(high) + 1  # measures 0 < target
    for _ in range(8 * low.element_size()):
        mid = torch.div(lo + hi, 2, rounding_mode="floor")
        reached = measure(_key_float(mid, low.dtype)) >= target
        lo = torch.where(reached, mid, lo)
        hi = torch.where(reached, hi, mid)
    return _key_float(lo, low.dtype)


# ---- top-p's threshold on CUDA: many thresholds a pass ------------------------------------------
# `_largest_threshold` halves the interval each round, with a pass over [rows, vocab] (a where
# and a sum: 16 rounds for 16-bit logits, ~4.5 ms a step at 512 rows of a 128k vocabulary on
# an H100). `largest_mass_threshold` measures MASS_THRESHOLDS thresholds in one pass of one
# kernel, so the interval shrinks 32-fold a round: 4 rounds (float32: 7).
MASS_THRESHOLDS = 32

_MASS_SOURCE = r"""
#include <cuda_fp16.h>
#include <cuda_bf16.h>
template <typename T> __device__ __forceinline__ float as_float(T x);
template <> __device__ __forceinline__ float as_float<float>(float x) { return x; }
template <> __device__ __forceinline__ float as_float<__half>(__half x) { return __half2float(x); }
template <> __device__ __forceinline__ float as_float<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }

// partial[r, c, k] = sum of probs[r, j] over the j of chunk c with logits[r, j] >= thresholds[r, k]
// (k < 32; no atomics: the caller sums the chunks, so the masses are deterministic, and for
// t_a <= t_b the mass at t_a is never below the mass at t_b, rounding included).
// grid (chunks, rows), 256 threads.
template <typename T>
__global__ void __launch_bounds__(256)
masses_at_least(const T* __restrict__ logits, long long logit_stride, const float* __restrict__ probs,
                long long prob_stride, const float* __restrict__ thresholds, float* __restrict__ partial, int vocab) {
    const int r = blockIdx.y, c = blockIdx.x, tid = threadIdx.x;
    float th[32], acc[32];
#pragma unroll
    for (int k = 0; k < 32; ++k) { th[k] = thresholds[(long long)r * 32 + k]; acc[k] = 0.f; }
    const T* lr = logits + (long long)r * logit_stride;
    const float* pr = probs + (long long)r * prob_stride;
    const int per = (vocab + gridDim.x - 1) / gridDim.x;
    const int begin = c * per, end = min(vocab, begin + per);
    for (int j = begin + tid; j < end; j += 256) {
        const float v = as_float<T>(lr[j]), p = pr[j];
#pragma unroll
        for (int k = 0; k < 32; ++k) acc[k] += v >= th[k] ? p : 0.f;
    }
    __shared__ float part[8][33];
    const int lane = tid & 31, warp = tid >> 5;
#pragma unroll
    for (int k = 0; k < 32; ++k) {
        float x = acc[k];
        for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
        if (lane == 0) part[warp][k] = x;
    }
    __syncthreads();
    if (tid < 32) {
        float x = 0.f;
        for (int w = 0; w < 8; ++w) x += part[w][tid];
        partial[((long long)r * gridDim.x + c) * 32 + tid] = x;
    }
}
"""

_MASS_CTYPE = {torch.float32: "float", torch.float16: "__half", torch.bfloat16: "__nv_bfloat16"}
_MASS_MODULES: dict[int, object] = {}


def _mass_kernel(device: int, dtype: torch.dtype):
    module = _MASS_MODULES.get(device)
    if module is None:
        import cupy

        names = [f"masses_at_least<{name}>" for name in _MASS_CTYPE.values()]
        with cupy.cuda.Device(device):
            module = cupy.RawModule(code=_MASS_SOURCE, options=("-std=c++17",), name_expressions=names)
            module.compile()
        module = _MASS_MODULES[device] = module
    return module.get_function(f"masses_at_least<{_MASS_CTYPE[dtype]}>")


def mass_rounds(bits: int, ways: int = MASS_THRESHOLDS) -> int:
    """Rounds of `largest_mass_threshold` that leave an interval of one key, from the
    2**bits + 1 keys of a `bits`-bit float (each round: ceil(keys / ways))."""
    keys, rounds = 2**bits + 1, 0
    while keys > 1:
        keys, rounds = -(-keys // ways), rounds + 1
    return rounds


def largest_mass_threshold(logits: torch.Tensor, probs: torch.Tensor, target: torch.Tensor, low: torch.Tensor,
                           high: torch.Tensor) -> torch.Tensor:
    """`_largest_threshold` of the mass (the sum of probs over entries whose logit is at
    least t), on CUDA: each round measures MASS_THRESHOLDS keys evenly spaced over the
    interval [lo, hi) in one kernel and keeps the piece between the last one reached and
    the next, so the answer is the same exact value of the row's logits (up to the order of
    the float sums). logits [r, vocab] (16-bit or float32), probs [r, vocab] float32
    contiguous rows, target [r] float32, low/high [r] of logits' dtype."""
    from inflightllm.gpu import ops

    rows, vocab = logits.shape
    ways = MASS_THRESHOLDS
    assert logits.stride(1) == 1 and probs.stride(1) == 1 and probs.dtype == torch.float32
    kernel = _mass_kernel(logits.device.index, logits.dtype)
    chunks = max(1, min(-(-vocab // 4096), -(-1024 // rows)))
    partial = torch.empty((rows, chunks, ways), dtype=torch.float32, device=logits.device)
    offsets = torch.arange(ways, device=logits.device, dtype=torch.int64)[None, :]
    lo = _float_key(low)
    hi = _float_key(high) + 1  # measures 0 < target
    for _ in range(mass_rounds(8 * logits.element_size(), ways)):
        step = torch.clamp(torch.div(hi - lo + ways - 1, ways, rounding_mode="floor"), min=1)[:, None]
        keys = lo[:, None] + step * offsets  # [r, ways]
        inside = keys < hi[:, None]
        thresholds = _key_float(torch.minimum(keys, hi[:, None] - 1), logits.dtype).float().contiguous()
        with ops.torch_stream():
            kernel((chunks, rows), (256,), (ops._ptr(logits), np.int64(logits.stride(0)), ops._ptr(probs),
                                            np.int64(probs.stride(0)), ops._ptr(thresholds), ops._ptr(partial),
                                            np.int32(vocab)))
        reached = (partial.sum(dim=1) >= target[:, None]) & inside
        reached[:, 0] = True  # lo meets the target (or is returned)
        last = reached.sum(dim=1, keepdim=True) - 1  # the masses fall as t rises: reached is a prefix
        new_lo = lo[:, None] + step * last
        hi = torch.minimum(hi, (new_lo + step)[:, 0])
        lo = new_lo[:, 0]
    return _key_float(lo, logits.dtype)


def _take(tensor: torch.Tensor, index: np.ndarray, upload) -> torch.Tensor:
    """tensor[index] along dim 0; the tensor itself when index is every row (in order)."""
    if len(index) == tensor.shape[0]:
        return tensor
    return tensor.index_select(0, upload(np.asarray(index, np.int64)))


def _put(target: torch.Tensor, index: np.ndarray, values: torch.Tensor, upload) -> torch.Tensor:
    """target with target[index] = values; values itself when index is every row."""
    if len(index) == target.shape[0]:
        return values
    return target.index_copy_(0, upload(np.asarray(index, np.int64)), values)


def _fill_neg_inf(logits: torch.Tensor, flat_index: torch.Tensor) -> None:
    """-inf at these flat positions of `logits` (contiguous), with no host-device sync."""
    logits.view(-1).index_fill_(0, flat_index, float("-inf"))


def _ban_row(row: torch.Tensor, request: Request, upload) -> None:
    """Bad words of one request, as the CPU reference sampler bans them (min_tokens is
    applied to all rows at once: `_ban_stops_before_min_tokens`; penalties to all penalty
    rows at once: `_apply_penalties`). `upload` copies a host array to the device without
    making the host wait (pinned staging)."""
    banned = set(request.banned_single)
    for sequence in request.banned_multi:
        if _tail_matches(request.token_ids, sequence[:-1]):
            banned.add(sequence[-1])
    if banned:
        _fill_neg_inf(row, upload(np.array(sorted(banned), np.int64)))
