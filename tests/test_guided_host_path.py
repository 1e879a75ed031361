"""The constrained step's host path (issue 28): the pieces that replaced copies must give
the answers of the code they replaced, exactly.

- `disallowed_bits` / `unpack_bitmask` (a [256, 8] byte table) against shifting each word
  by 0..31, and `apply_token_bitmask` in place (rows None) against gather and scatter;
- `apply_step_bitmask`'s cases (rows in order, permuted, a mask row whose request does not
  sample) against the old host-side row selection;
- `GuidedState.allows_only`'s precheck against the old masked copy;
- `gather_masks` (one copy per batch array) against np.stack of the rows;
- `GrammarCompilerPool` with several compile threads: one compile per distinct spec under
  concurrent submits, a failed compile forgotten, `compile_seconds` one entry per compile.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from inflightllm.guided.matcher import (
    GuidedState,
    apply_step_bitmask,
    apply_token_bitmask,
    gather_masks,
    unpack_bitmask,
)


def shift_unpack(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """The unpack these replaced: every word shifted by 0..31 ([k, words, 32] int32)."""
    shifts = torch.arange(32, dtype=torch.int32)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().reshape(bitmask.shape[0], -1)
    if allowed.shape[1] >= vocab:
        return allowed[:, :vocab]
    padded = torch.zeros(bitmask.shape[0], vocab, dtype=torch.bool)
    padded[:, : allowed.shape[1]] = allowed
    return padded


def old_apply(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    allowed = shift_unpack(bitmask, logits.shape[1])
    selected = logits.index_select(0, rows).masked_fill_(~allowed, float("-inf"))
    logits.index_copy_(0, rows, selected)


def old_apply_step(logits, masked_ids, bitmask, request_ids) -> None:
    index = {request_id: row for row, request_id in enumerate(request_ids)}
    pairs = [(k, index[rid]) for k, rid in enumerate(masked_ids) if rid in index]
    if not pairs:
        return
    mask_rows = np.array([k for k, _ in pairs], np.int64)
    logit_rows = torch.tensor([row for _, row in pairs], dtype=torch.int64)
    old_apply(logits, torch.from_numpy(np.ascontiguousarray(np.asarray(bitmask, np.int32)[mask_rows])), logit_rows)


def random_words(rng, rows: int, words: int) -> np.ndarray:
    return rng.integers(-(2**31), 2**31, (rows, words), dtype=np.int64).astype(np.int32)


@pytest.mark.parametrize("vocab", [96, 100, 128 + 22, 49152, 1000 * 32 + 7])
def test_byte_table_unpack_equals_the_shift_unpack(vocab):
    rng = np.random.default_rng(vocab)
    words = (vocab + 31) // 32
    masks = random_words(rng, 6, words)
    masks[1] = 0
    masks[2] = -1
    bitmask = torch.from_numpy(masks)
    for width in (vocab, words * 32, words * 32 + 40):  # the logits may be wider than the mask
        assert torch.equal(unpack_bitmask(bitmask, width), shift_unpack(bitmask, width))


@pytest.mark.parametrize("vocab", [100, 150, 256])
def test_in_place_apply_equals_gather_and_scatter(vocab):
    rng = np.random.default_rng(1)
    words = (vocab + 31) // 32
    bitmask = torch.from_numpy(random_words(rng, 4, words))
    for width in (vocab, words * 32 + 9):
        logits = torch.randn(6, width, generator=torch.Generator().manual_seed(vocab))
        expected = logits.clone()
        old_apply(expected, bitmask, torch.arange(4))
        ours = logits.clone()
        apply_token_bitmask(ours, bitmask, None)  # the first 4 rows, in place
        assert torch.equal(ours, expected)
        expected = logits.clone()
        rows = torch.tensor([5, 0, 3, 2])
        old_apply(expected, bitmask, rows)
        ours = logits.clone()
        apply_token_bitmask(ours, bitmask, rows)
        assert torch.equal(ours, expected)


@pytest.mark.parametrize("masked_ids, request_ids", [
    (["a", "b", "c"], ["a", "b", "c"]),  # every row constrained, in order (the common case)
    (["a", "b"], ["a", "b", "c", "d"]),  # the first rows, in order
    (["c", "a"], ["a", "b", "c", "d"]),  # permuted
    (["a", "x", "c"], ["a", "b", "c"]),  # a masked request that does not sample this step
    (["x", "a", "b"], ["a", "b"]),  # ... the rest then the first rows, in order
    (["x"], ["a", "b"]),  # none samples
])
def test_apply_step_bitmask_equals_the_host_row_selection(masked_ids, request_ids):
    rng = np.random.default_rng(2)
    vocab = 100
    bitmask = random_words(rng, len(masked_ids), (vocab + 31) // 32)
    logits = torch.randn(len(request_ids), vocab, generator=torch.Generator().manual_seed(3))
    expected = logits.clone()
    old_apply_step(expected, masked_ids, bitmask, request_ids)
    ours = logits.clone()
    apply_step_bitmask(ours, masked_ids, bitmask, request_ids)
    assert torch.equal(ours, expected)


def state_with(mask: np.ndarray, vocab: int, rows: np.ndarray | None = None, row: int = 0) -> GuidedState:
    """A GuidedState whose next mask is `mask` (row `row` of `rows` when given), no grammar."""
    state = GuidedState.__new__(GuidedState)
    state.vocab_size = vocab
    state.num_words = (vocab + 31) // 32
    if rows is None:
        rows, row = np.array(mask, np.int32).reshape(1, -1), 0
    state._own = torch.zeros(1, state.num_words, dtype=torch.int32)
    state._own_rows = state._own.numpy()
    state._rows, state._row = rows, row
    state._filled = True
    state._taken = None
    return state


def old_allows_only(mask: np.ndarray, vocab: int, token_ids) -> bool:
    words = mask.view(np.uint32).copy()
    tail = vocab % 32
    if tail:
        words[-1] &= np.uint32((1 << tail) - 1)
    for token in token_ids:
        if 0 <= token < vocab:
            words[token >> 5] &= np.uint32(~(1 << (token & 31)) & 0xFFFFFFFF)
    return not words.any()


@pytest.mark.parametrize("vocab", [64, 100, 49152 + 5])
def test_allows_only_precheck_equals_the_masked_copy(vocab):
    rng = np.random.default_rng(vocab)
    words = (vocab + 31) // 32
    eos_sets = [[2], [31], [vocab - 1], [2, 33], [vocab + 5], [-1, 2], []]
    cases = [np.zeros(words, np.int32), np.full(words, -1, np.int32), random_words(rng, 1, words)[0]]
    for eos in ([2], [31], [vocab - 1], [2, 33]):
        only = np.zeros(words, np.int32)  # nothing but the eos bits
        for token in eos:
            only[token >> 5] |= np.int32(np.uint32(1 << (token & 31)).view(np.int32))
        cases.append(only)
        with_one_more = only.copy()
        with_one_more[0] |= np.int32(1 << 7)
        cases.append(with_one_more)
    tail_only = np.zeros(words, np.int32)  # bits past the vocabulary alone: no token allowed
    if vocab % 32:
        tail_only[-1] = np.uint32(0xFFFFFFFF << (vocab % 32) & 0xFFFFFFFF).view(np.int32)
    cases.append(tail_only)
    sign_bit = np.zeros(words, np.int32)
    sign_bit[0] = np.int32(-(2**31))  # token 31 (a word's sign bit)
    cases.append(sign_bit)
    for mask in cases:
        for eos in eos_sets:
            assert state_with(mask, vocab).allows_only(eos) == old_allows_only(mask, vocab, eos), (mask[:2], eos)


def test_gather_masks_equals_np_stack():
    rng = np.random.default_rng(4)
    vocab = 200
    words = (vocab + 31) // 32
    first, second = random_words(rng, 5, words), random_words(rng, 3, words)
    states = [state_with(None, vocab, first, row) for row in range(5)]
    states += [state_with(None, vocab, second, row) for row in (2, 0)]
    states += [state_with(random_words(rng, 1, words)[0], vocab)]  # its own one-row array
    orders = [
        list(range(5)),  # one whole batch array, in order: one copy
        [1, 3, 4],  # rows of one batch array into consecutive targets
        [0, None, 6, 2, 7, 5, None, 1],  # batch arrays interleaved, ended rows, an own row
        [4, 3, 2, 1, 0],
        [0, 2, 1, 3, 4],  # the whole batch array, its ends in place, the middle not
    ]
    for order in orders:
        chosen = [None if i is None else states[i] for i in order]
        expected = np.stack([np.full(words, -1, np.int32) if s is None else s.next_mask() for s in chosen])
        assert np.array_equal(gather_masks(chosen), expected)
        out = np.full((len(chosen), words), 7, np.int32)
        assert gather_masks(chosen, out) is out and np.array_equal(out, expected)


def test_gather_after_a_batched_fill_equals_np_stack(smollm2_tokenizer):
    xgr = pytest.importorskip("xgrammar")
    import json

    from inflightllm.guided.matcher import fill_masks
    from tests.guided_cases import SCHEMAS

    vocab = 49152
    info = xgr.TokenizerInfo.from_huggingface(smollm2_tokenizer, vocab_size=vocab, stop_token_ids=[2])
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    grammars = [compiler.compile_json_schema(json.dumps(schema), any_whitespace=False) for schema in SCHEMAS[:3]]
    states = [GuidedState(grammar, vocab) for grammar in grammars for _ in range(3)]
    fill_masks(states[:6], xgr.BatchGrammarMatcher(max_threads=2))  # the last three: filled one by one
    chosen = [states[i] for i in (8, 0, 1, 2, 3, 4, 5, 7)] + [None]
    expected = np.stack([np.full(states[0].num_words, -1, np.int32) if s is None else s.next_mask() for s in chosen])
    assert np.array_equal(gather_masks(chosen), expected)


def test_several_compile_threads_compile_each_spec_once(smollm2_tokenizer):
    pytest.importorskip("xgrammar")
    from inflightllm.guided import choice_spec
    from inflightllm.guided.compiler import GrammarCompilerPool, default_compile_threads
    from inflightllm.guided.spec import GuidedSpec

    assert default_compile_threads() >= 1
    with pytest.raises(ValueError, match="compile_threads: 0"):
        GrammarCompilerPool(None, 49152, [2], tokenizer=smollm2_tokenizer, compile_threads=0)
    pool = GrammarCompilerPool(None, 49152, [2], tokenizer=smollm2_tokenizer, compile_threads=4)
    specs = [choice_spec([f"yes{i}", f"no{i}"]) for i in range(6)] + [GuidedSpec("regex", r"[0-9]{3}")]
    futures: dict[int, list] = {i: [] for i in range(len(specs))}
    start = threading.Barrier(8)

    def submitter(seed: int) -> None:
        start.wait()
        for i in np.random.default_rng(seed).permutation(len(specs) * 3) % len(specs):
            futures[int(i)].append(pool.submit(specs[int(i)]))

    threads = [threading.Thread(target=submitter, args=(seed,)) for seed in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for i in futures:
        assert len({id(future) for future in futures[i]}) == 1  # one Future (one compile) per spec
        assert futures[i][0].result() is not None
    assert pool.num_compiled == len(specs)
    assert len(pool.compile_seconds) == len(specs) and all(s > 0 for s in pool.compile_seconds)

    broken = GuidedSpec("regex", "(unclosed")  # a failed compile is forgotten: the next submit retries
    failed = pool.submit(broken)
    assert failed.exception() is not None
    retried = pool.submit(broken)
    assert retried is not failed and retried.exception() is not None
    pool.close()


def test_check_spec_checks_a_spec_once_and_a_bad_one_every_time(monkeypatch):
    """A burst under one schema parses it once (it cost ~4-6 ms a request); a spec that fails
    is refused every time with its field named; the memory of checked specs is bounded."""
    from inflightllm.guided import spec as spec_module
    from inflightllm.guided.spec import GuidedSpec, GuidedSpecError, check_spec, json_schema_spec

    calls = []
    real = spec_module._check_meta_schema
    monkeypatch.setattr(spec_module, "_check_meta_schema", lambda schema, field: (calls.append(field),
                                                                               real(schema, field)))
    monkeypatch.setattr(spec_module, "_checked_specs", type(spec_module._checked_specs)())
    good = json_schema_spec({"type": "object", "properties": {"once_checked": {"type": "integer"}}})
    for _ in range(3):
        check_spec(good)
    assert len(calls) == 1
    bad = json_schema_spec({"type": "object", "properties": {"x": {"type": "no-such-type"}}})
    for _ in range(2):
        with pytest.raises(GuidedSpecError, match="guided_json"):
            check_spec(bad)
    assert len(calls) == 3
    regex_bad = GuidedSpec("regex", "(unclosed")
    for _ in range(2):
        with pytest.raises(GuidedSpecError, match="guided_regex"):
            check_spec(regex_bad)
    monkeypatch.setattr(spec_module, "CHECKED_SPECS_MAX", 2)
    others = [json_schema_spec({"type": "object", "properties": {f"k{i}": {"type": "string"}}}) for i in range(3)]
    for other in others:
        check_spec(other)
    assert len(spec_module._checked_specs) == 2 and good not in spec_module._checked_specs
    check_spec(good)  # forgotten: checked again
    assert len(calls) == 3 + 3 + 1
