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
        # The request's own one-row mask (xgrammar fills a torch row; `_own_rows` is its NumPy
        # view). The current mask is row `_row` of the 2-D array `_rows`: `_own_rows`, or the
        # batch array `fill_masks` filled (then only those two attributes are set per row: a
        # torch slice per row cost ~10 us, 10+ ms a step at 1,024 rows). `gather_masks` copies
        # a step's rows of one batch array in one vectorised copy.
        self._own = torch.zeros(1, self.num_words, dtype=torch.int32)
        self._own_rows = self._own.numpy()
        self._rows = self._own_rows
        self._row = 0
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
            self.matcher.fill_next_token_bitmask(self._own, 0)
            self._rows, self._row = self._own_rows, 0
            self._filled = True
        return self._rows[self._row]  # a NumPy view: cheaper than Tensor.numpy()

    def keep_own_copy(self) -> None:
        """Copy the current mask out of a batch array about to be reused (`BitmaskRing`)."""
        if self._rows is not self._own_rows:
            self._own_rows[0] = self._rows[self._row]
            self._rows, self._row = self._own_rows, 0

    def allows_only(self, token_ids) -> bool:
        """Whether every allowed next token is one of `token_ids` (the grammar is done)."""
        # On the packed words (vocab/32 of them): this runs for every constrained row after
        # every token, so no unpacking to one byte per token.
        mask = self.next_mask()
        vocab = self.vocab_size
        tail = vocab & 31  # the last word's bits that are tokens (0: all 32)
        # The common case first: none of `token_ids` is allowed, so the answer is whether no
        # token at all is (no copy, no masking; count_nonzero is numpy's fastest scan).
        # Python ints: a word's sign bit is bit 31.
        for token in token_ids:
            if 0 <= token < vocab and (int(mask[token >> 5]) >> (token & 31)) & 1:
                break
        else:
            if not tail:
                return not np.count_nonzero(mask)
            return not (np.count_nonzero(mask[:-1]) or int(mask[-1]) & ((1 << tail) - 1))
        words = mask.view(np.uint32).copy()
        if tail:
            words[-1] &= np.uint32((1 << tail) - 1)  # bits past the vocabulary are not tokens
        for token in token_ids:
            if 0 <= token < self.vocab_size:
                words[token >> 5] &= np.uint32(~(1 << (token & 31)) & 0xFFFFFFFF)
        return not words.any()


class BitmaskRing:
    """The arrays `fill_masks` fills, reused: a fresh [1,024, 4,008] int32 array each step
    (16 MB at a 128k vocabulary) costs 1-5 ms in page faults where a reused one costs
    0.6. `depth` arrays in turn; a state still holding its mask in an array about to be
    reused (a row not sampled since, e.g. preempted) gets its own copy of the row first."""

    def __init__(self, depth: int = 3):
        # each: (the array, the NumPy view its states hold as `_rows`, those states)
        self._slots: list[tuple[torch.Tensor, np.ndarray, list[GuidedState]] | None] = [None] * depth
        self._next = 0

    def take(self, states: list[GuidedState]) -> tuple[torch.Tensor, np.ndarray]:
        """A [len(states), words] int32 array for these states' masks, and its NumPy view
        (what the states are to hold as `_rows`)."""
        index = self._next
        self._next = (index + 1) % len(self._slots)
        slot = self._slots[index]
        rows, words = len(states), states[0].num_words
        array = None
        if slot is not None:
            array, held, users = slot
            for state in users:
                if state._rows is held:  # its mask is still in there: a copy of its row
                    state.keep_own_copy()
            if array.shape[0] < rows or array.shape[1] != words:
                array = None
        if array is None:
            array = torch.empty(rows, words, dtype=torch.int32)
        bitmask = array[:rows]
        view = bitmask.numpy()
        self._slots[index] = (array, view, list(states))
        return bitmask, view


def fill_masks(states: list[GuidedState], batch, ring: BitmaskRing | None = None) -> None:
    """Fill the next-token masks of the states that need one, in one call of xgrammar's
    BatchGrammarMatcher `batch` (its worker threads, outside the GIL): one row's fill is
    tens of microseconds, so 1,024 rows one by one on the step thread would cost more than
    a decode step. `ring`: the arrays to fill (reused step after step), else a new one."""
    todo = [state for state in states if not state._filled and not state.matcher.is_terminated()]
    if not todo:
        return
    if len(todo) == 1:
        todo[0].next_mask()
        return
    # Not zeroed first: xgrammar writes every word of each row it fills (checked against a
    # pre-filled sentinel on 60 steps of 64 JSON-schema rows).
    if ring is not None:
        bitmask, rows = ring.take(todo)
    else:
        bitmask = torch.empty(len(todo), todo[0].num_words, dtype=torch.int32)
        rows = bitmask.numpy()
    batch.batch_fill_next_token_bitmask([state.matcher for state in todo], bitmask)
    for row, state in enumerate(todo):
        state._rows = rows
        state._row = row
        state._filled = True


def gather_masks(states: list[GuidedState | None], out: np.ndarray | None = None) -> np.ndarray:
    """[len(states), words] int32: each state's next-token mask, all tokens allowed for a
    None (a row whose request ended meanwhile). The rows of one batch array (`fill_masks`)
    go in one vectorised copy (np.take, straight into `out` when they fill a slice of it),
    not one by one: 1,024 rows of 16 KB stacked one at a time cost milliseconds a step.
    `out`: where to write (e.g. the GPU runner's pinned upload buffer); made when None."""
    if out is None:
        words = next((state.num_words for state in states if state is not None), 0)
        out = np.empty((len(states), words), np.int32)
    groups: dict[int, tuple[np.ndarray, list[int], list[int]]] = {}
    ended: list[int] = []
    for index, state in enumerate(states):
        if state is None:
            ended.append(index)
            continue
        if not state._filled:
            state.next_mask()
        group = groups.get(id(state._rows))
        if group is None:
            group = groups[id(state._rows)] = (state._rows, [], [])
        group[1].append(index)
        group[2].append(state._row)
    for rows, targets, sources in groups.values():
        first, count = targets[0], len(targets)
        if targets[-1] - first == count - 1:  # consecutive targets: into the slice, one copy
            if count == rows.shape[0] and sources == list(range(count)):
                out[first:first + count] = rows  # the whole batch array, in order
            else:
                # mode 'clip' (the rows are valid): 'raise' would copy through a buffer first
                np.take(rows, sources, axis=0, out=out[first:first + count], mode="clip")
        else:
            out[targets] = rows[sources]
    if ended:
        out[ended] = -1
    return out


# Fewer rows than this per slice are not worth a worker's hand-off (tens of microseconds).
MIN_ACCEPT_SLICE = 64


def accept_tokens(matchers: list, tokens: list[int], executor=None) -> list[bool]:
    """xgrammar's batch accept of `tokens[i]` into `matchers[i]`. It runs the matchers one
    after another (outside the GIL), so with an `executor` (`GrammarCompilerPool.accept_executor`)
    the rows go in contiguous slices: one per worker and one on this thread."""
    import xgrammar as xgr

    accept = xgr.BatchGrammarMatcher.batch_accept_token
    workers = getattr(executor, "_max_workers", 0) if executor is not None else 0
    slices = min(workers + 1, len(matchers) // MIN_ACCEPT_SLICE)
    if slices < 2:
        return list(accept(matchers, tokens))
    bounds = [len(matchers) * i // slices for i in range(slices + 1)]
    futures = [executor.submit(accept, matchers[a:b], tokens[a:b]) for a, b in zip(bounds[1:-1], bounds[2:])]
    allowed = list(accept(matchers[: bounds[1]], tokens[: bounds[1]]))
    for future in futures:
        allowed.extend(future.result())
    return allowed


def advance_batch(states: list[GuidedState], tokens: list[int], batch, executor=None,
                  ring: BitmaskRing | None = None) -> None:
    """Accept each state's sampled token (`accept_tokens`: in slices on `executor`'s workers
    when given), then fill the masks of those that go on (`fill_masks`); the engine's
    per-request `accept` then takes the kept answer, and its end-of-grammar check reads the
    filled mask."""
    tokens = [int(token) for token in tokens]
    allowed = accept_tokens([state.matcher for state in states], tokens, executor)
    for state, token, ok in zip(states, tokens, allowed):
        state._taken = (token, bool(ok))
        state._filled = False
    fill_masks([state for state, ok in zip(states, allowed) if ok], batch, ring)


_DISALLOWED_BITS: dict[torch.device, torch.Tensor] = {}


def disallowed_bits(bitmask: torch.Tensor) -> torch.Tensor:
    """[k, num_words] int32 -> [k, num_words * 32] bool, True where a token is NOT allowed
    (bit i of word w is token 32 * w + i). The words are read as little-endian bytes and
    each byte expands through a [256, 8] table: the only intermediate is one int32 index
    per byte, where shifting every word by 0..31 made a [k, words, 32] int32 (525 MB at
    1,024 rows of a 128k vocabulary)."""
    table = _DISALLOWED_BITS.get(bitmask.device)
    if table is None:
        byte = torch.arange(256, dtype=torch.int32).unsqueeze(1)
        table = ((byte >> torch.arange(8, dtype=torch.int32)) & 1) == 0  # [256, 8]: bit i clear
        table = _DISALLOWED_BITS[bitmask.device] = table.to(bitmask.device)
    k = bitmask.shape[0]
    as_bytes = bitmask.contiguous().view(torch.uint8).reshape(-1).int()  # little-endian, as x86 and CUDA
    return table.index_select(0, as_bytes).reshape(k, -1)


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[k, num_words] int32 -> [k, vocab] bool allowed; ids past the mask's words are not."""
    allowed = ~disallowed_bits(bitmask)
    if allowed.shape[1] >= vocab:
        return allowed[:, :vocab]
    padded = torch.zeros(bitmask.shape[0], vocab, dtype=torch.bool, device=bitmask.device)
    padded[:, : allowed.shape[1]] = allowed
    return padded


@torch.inference_mode()  # the model's logits are inference tensors: in-place edits need this mode
def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None) -> None:
    """-inf on the logits of disallowed tokens of the constrained rows, in place.

    logits [m, vocab] (a step's sampling rows); bitmask [k, num_words] int32 on the logits'
    device; rows [k] int64 the logits rows the masks belong to, or None when they are the
    first k rows in order (then one masked fill in place, no gather and scatter)."""
    vocab = logits.shape[1]
    k = bitmask.shape[0]
    disallowed = disallowed_bits(bitmask)
    covered = min(vocab, disallowed.shape[1])
    target = logits[:k] if rows is None else logits.index_select(0, rows)
    target[:, :covered].masked_fill_(disallowed[:, :covered], float("-inf"))
    if covered < vocab:  # ids past the mask's words are not allowed
        target[:, covered:] = float("-inf")
    if rows is not None:
        logits.index_copy_(0, rows, target)


def apply_step_bitmask(logits: torch.Tensor, masked_ids: list[str], bitmask, request_ids: list[str],
                       upload=None) -> None:
    """Apply the masks of `masked_ids` (rows of `bitmask`, [k, words] int32 NumPy) to
    `logits`, whose rows are `request_ids` (the runner's sampling order). `upload`: host
    array -> device tensor (the GPU runner's pinned staging); by default a plain copy to
    the logits' device."""
    if not masked_ids:
        return
    if masked_ids == request_ids[: len(masked_ids)]:  # the common case: the first rows, in order
        mask_rows, logit_rows = None, None
    else:
        index = {request_id: row for row, request_id in enumerate(request_ids)}
        pairs = [(k, index[rid]) for k, rid in enumerate(masked_ids) if rid in index]
        if not pairs:
            return
        mask_rows = np.fromiter((k for k, _ in pairs), np.int64, len(pairs))
        logit_rows = np.fromiter((row for _, row in pairs), np.int64, len(pairs))
        if len(pairs) == len(masked_ids):
            mask_rows = None  # every mask row, in order: the bitmask as it is
        if np.array_equal(logit_rows, np.arange(len(pairs))):
            logit_rows = None  # the first logits rows, in order: masked in place
    if upload is None:
        def upload(array):
            return torch.from_numpy(array).to(logits.device, non_blocking=True)
    # Uploaded whole (on the GPU runner it is already in pinned memory, see
    # `PinnedStaging.host_array`): a missing row is dropped on the device, not by a host copy.
    device_mask = upload(np.ascontiguousarray(bitmask, np.int32))
    if mask_rows is not None:
        device_mask = device_mask.index_select(0, upload(mask_rows))
    apply_token_bitmask(logits, device_mask, None if logit_rows is None else upload(logit_rows))
