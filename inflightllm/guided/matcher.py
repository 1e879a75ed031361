"""A constrained request's grammar state, and the batched mask over a step's logits.

`GuidedState` wraps xgrammar's matcher: it advances with each token the engine appends
and fills the request's next-token bitmask on the host (32 tokens per int32 word, bit set
= allowed). `apply_token_bitmask` applies the masks of all constrained rows of a step to
its logits in one batched call, on the logits' device (CPU or CUDA, any float dtype),
without a host synchronisation; unconstrained rows are not touched.
"""

from __future__ import annotations

import numpy as np
import torch


class GuidedState:
    """The grammar matcher of one request, and its bitmask for the next token."""

    def __init__(self, compiled, vocab_size: int):
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(compiled)
        self.vocab_size = vocab_size
        self.num_words = (vocab_size + 31) // 32
        self._mask = torch.zeros(1, self.num_words, dtype=torch.int32)  # xgrammar fills a torch row
        self._filled = False
        self._taken: tuple[int, bool] | None = None  # (token, allowed) accepted by `advance_batch`

    def accept(self, token_id: int) -> bool:
        """Advance over a sampled token; False when the grammar does not allow it. A token
        that `advance_batch` accepted already is not accepted twice (its answer is kept)."""
        taken, self._taken = self._taken, None
        if taken is not None and taken[0] == token_id:
            return taken[1]
        self._filled = False
        return bool(self.matcher.accept_token(token_id))

    @property
    def is_terminated(self) -> bool:
        """The grammar accepted a stop token: nothing may follow."""
        return self.matcher.is_terminated()

    def next_mask(self) -> np.ndarray:
        """The allowed next tokens as [num_words] int32 (filled once per accepted token)."""
        if not self._filled:
            self.matcher.fill_next_token_bitmask(self._mask, 0)
            self._filled = True
        return self._mask.numpy()[0]

    def allows_only(self, token_ids) -> bool:
        """Whether every allowed next token is one of `token_ids` (the grammar is done)."""
        # On the packed words (vocab/32 of them): this runs for every constrained row after
        # every token, so no unpacking to one byte per token.
        words = self.next_mask().view(np.uint32).copy()
        tail = self.vocab_size % 32
        if tail:
            words[-1] &= np.uint32((1 << tail) - 1)  # bits past the vocabulary are not tokens
        for token in token_ids:
            if 0 <= token < self.vocab_size:
                words[token >> 5] &= np.uint32(~(1 << (token & 31)) & 0xFFFFFFFF)
        return not words.any()


def fill_masks(states: list[GuidedState], batch) -> None:
    """Fill the next-token masks of the states that need one, in one call of xgrammar's
    BatchGrammarMatcher `batch` (its worker threads, outside the GIL): one row's fill is
    tens of microseconds, so 1,024 rows one by one on the step thread would cost more than
    a decode step."""
    todo = [state for state in states if not state._filled and not state.matcher.is_terminated()]
    if not todo:
        return
    if len(todo) == 1:
        todo[0].next_mask()
        return
    bitmask = torch.zeros(len(todo), todo[0].num_words, dtype=torch.int32)
    batch.batch_fill_next_token_bitmask([state.matcher for state in todo], bitmask)
    for row, state in enumerate(todo):
        state._mask = bitmask[row:row + 1]
        state._filled = True


def advance_batch(states: list[GuidedState], tokens: list[int], batch) -> None:
    """Accept each state's sampled token (one call into xgrammar for all), then fill the
    masks of those that go on (`fill_masks`); the engine's per-request `accept` then takes
    the kept answer, and its end-of-grammar check reads the filled mask."""
    tokens = [int(token) for token in tokens]
    allowed = batch.batch_accept_token([state.matcher for state in states], tokens)
    for state, token, ok in zip(states, tokens, allowed):
        state._taken = (token, bool(ok))
        state._filled = False
    fill_masks([state for state, ok in zip(states, allowed) if ok], batch)


_BIT_SHIFTS: dict[torch.device, torch.Tensor] = {}


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[k, num_words] int32 -> [k, vocab] bool allowed; ids past the mask's words are not."""
    shifts = _BIT_SHIFTS.get(bitmask.device)
    if shifts is None:
        shifts = _BIT_SHIFTS[bitmask.device] = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().reshape(bitmask.shape[0], -1)
    if allowed.shape[1] >= vocab:
        return allowed[:, :vocab]
    padded = torch.zeros(bitmask.shape[0], vocab, dtype=torch.bool, device=bitmask.device)
    padded[:, : allowed.shape[1]] = allowed
    return padded


@torch.inference_mode()  # the model's logits are inference tensors: in-place edits need this mode
def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """-inf on the logits of disallowed tokens of the constrained rows, in place.

    logits [m, vocab] (a step's sampling rows); bitmask [k, num_words] int32 on the logits'
    device; rows [k] int64 the logits rows the masks belong to. One gather, one masked
    fill and one scatter, whatever k is."""
    allowed = unpack_bitmask(bitmask, logits.shape[1])
    selected = logits.index_select(0, rows).masked_fill_(~allowed, float("-inf"))
    logits.index_copy_(0, rows, selected)


def apply_step_bitmask(logits: torch.Tensor, masked_ids: list[str], bitmask, request_ids: list[str],
                       upload=None) -> None:
    """Apply the masks of `masked_ids` (rows of `bitmask`, [k, words] int32 NumPy) to
    `logits`, whose rows are `request_ids` (the runner's sampling order). `upload`: host
    array -> device tensor (the GPU runner's pinned staging); by default a plain copy to
    the logits' device."""
    if not masked_ids:
        return
    index = {request_id: row for row, request_id in enumerate(request_ids)}
    pairs = [(k, index[rid]) for k, rid in enumerate(masked_ids) if rid in index]
    if not pairs:
        return
    mask_rows = np.fromiter((k for k, _ in pairs), np.int64, len(pairs))
    logit_rows = np.fromiter((row for _, row in pairs), np.int64, len(pairs))
    bitmask = np.ascontiguousarray(np.asarray(bitmask, np.int32)[mask_rows])
    if upload is None:
        def upload(array):
            return torch.from_numpy(array).to(logits.device, non_blocking=True)
    apply_token_bitmask(logits, upload(bitmask), upload(logit_rows))
