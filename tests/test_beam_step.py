"""The batched beam step and what it costs the runner (docs/SEQUENCE-GROUPS.md, issue 29):

- `step_searches` (all groups of an engine step scored together with tensor ops) equals,
  group by group, the one-group rule written out plainly below (`rule_step`: transformers'
  beam scoring as beam_search.py's docstring states it), over random groups with ties,
  repeated ids, stop hits, every early_stopping and several length penalties;
- on the real engine over the stub runner (which checks every context slot it attends):
  after a group's first beam step no beam sequence is sent to the runner whole; beams that
  fork take the sequence of a dead beam (a row copy in the runner: `beam_updates`), blocks
  rewritten by copy-on-write reach the runner as a new table; the beams equal the search
  run alone, and the blocks and sequences are all given back.
"""

from __future__ import annotations

import random

from inflightllm.beam_search import BeamSearch, Hypothesis, step_searches
from inflightllm.sampling_params import SamplingParams
from inflightllm.sequence_group import GroupParams
from tests.stub_model import stub_engine
from tests.test_engine_fuzz import check_invariants, reference_beams


def rule_step(search: BeamSearch, beam_tokens, top_ids, top_logprobs, max_len_reached):
    """One step of one search, candidate by candidate: (next beams as (parent, token, cum)),
    updating `search` as transformers does (GenerationMixin._beam_search)."""
    keep, width = search.candidates_per_beam, search.beam_width
    scored = []
    for beam, (ids, values) in enumerate(zip(top_ids, top_logprobs, strict=True)):
        for rank, (token, value) in enumerate(zip(ids[:keep], values[:keep], strict=True)):
            scored.append((search.running_scores[beam] + value, beam, rank, token))
    scored.sort(key=lambda item: (-item[0], item[1], item[2]))
    candidates = scored[:keep]
    length = search.num_generated + 1
    hits = [token in search.stop_token_ids or length >= search.max_tokens or max_len_reached
            for _, _, _, token in candidates]
    if search.improvable and not (len(search.finished) == width and search.early_stopping is True):
        for (score, beam, _, token), hit in zip(candidates[:width], hits[:width], strict=True):
            if hit:
                search.finished.append(Hypothesis(beam_tokens[beam] + [token], score / length ** search.length_penalty,
                                                  score))
        search.finished.sort(key=lambda hyp: -hyp.score)
        del search.finished[width:]
    order = sorted(range(len(candidates)), key=lambda i: (hits[i], i))[:width]
    search.running_scores = [candidates[i][0] - (1e9 if hits[i] else 0.0) for i in order]
    search.num_generated = length
    if search.improvable and len(search.finished) == width:
        best_length = search.max_tokens if search.early_stopping == "never" and search.length_penalty > 0 else length
        search.improvable = search.running_scores[0] / best_length ** search.length_penalty > search.finished[-1].score
    if not search.improvable or (len(search.finished) == width and search.early_stopping is True) or all(hits):
        search.done = True
        return []
    return [(candidates[i][1], candidates[i][3], candidates[i][0]) for i in order]


def test_step_searches_equals_the_rule_group_by_group():
    rng = random.Random(0)
    steps = 0
    for _ in range(400):
        settings = dict(max_tokens=rng.randint(1, 8), stop_token_ids=frozenset(rng.sample(range(12), rng.randint(0, 2))),
                        num_eos=rng.choice([1, 2]), length_penalty=rng.choice([1.0, 0.0, -0.5, 2.0]),
                        early_stopping=rng.choice([True, False, "never"]))
        widths = [rng.choice([2, 3, 4]) for _ in range(rng.randint(1, 6))]  # several shapes in one step
        batched = [BeamSearch(width, **settings) for width in widths]
        alone = [BeamSearch(width, **settings) for width in widths]
        live = [[[]] for _ in widths]
        while not all(search.done for search in alone):
            active = [g for g, search in enumerate(alone) if not search.done]
            tops = {}
            for g in active:
                keep = alone[g].candidates_per_beam
                # Few distinct values: equal scores (ties) are common.
                rows = [(rng.sample(range(12), keep) if rng.random() < 0.7 else [rng.randrange(12) for _ in range(keep)],
                         sorted((rng.choice([-0.5, -1.0, -1.5, -rng.random() * 3]) for _ in range(keep)), reverse=True))
                        for _ in live[g]]
                tops[g] = rows
            at_max = {g: rng.random() < 0.05 for g in active}
            results = step_searches([batched[g] for g in active], [[ids for ids, _ in tops[g]] for g in active],
                                    [[values for _, values in tops[g]] for g in active], [at_max[g] for g in active],
                                    lambda index, beam, live=live, active=active: live[active[index]][beam])
            for g, result in zip(active, results, strict=True):
                expected = rule_step(alone[g], live[g], [ids for ids, _ in tops[g]], [v for _, v in tops[g]], at_max[g])
                assert list(zip(result.parents, result.token_ids, result.cum_logprobs)) == expected
                assert batched[g].done == alone[g].done
                assert batched[g].running_scores == alone[g].running_scores
                assert batched[g].finished == alone[g].finished
                live[g] = [live[g][parent] + [token] for parent, token, _ in expected] or live[g]
                steps += 1
    assert steps > 2000


def test_beams_move_runner_rows_instead_of_sending_sequences_whole():
    engine = stub_engine(num_blocks=256, block_size=4, max_batch_size=64, max_beam_width=8)
    prompts = [[5 + i, 9, 13, 21, 7 + i] for i in range(5)]
    groups = [GroupParams(beam_width=w, length_penalty=lp, early_stopping=es)
              for w, lp, es in [(2, 1.0, False), (3, 0.0, True), (4, 2.0, "never"), (8, 1.0, False), (4, 1.0, True)]]
    for index, (prompt, group) in enumerate(zip(prompts, groups, strict=True)):
        engine.add_request(f"r{index}", prompt, SamplingParams(max_tokens=12), group=group)
    finals = {}
    while engine.has_unfinished():
        for output in engine.step():
            assert output.error is None, output.error
            if output.finished:
                finals[output.request_id] = output.beam_token_ids
        check_invariants(engine)
    runner = engine.runner
    assert runner.violations == []
    for index, (prompt, group) in enumerate(zip(prompts, groups, strict=True)):
        assert finals[f"r{index}"] == reference_beams(prompt, group, 12), index
    # Sent whole: each group's first sequence, then the beams made at its first beam step.
    assert sum(len(step.new_requests) for step in runner.steps) == sum(group.beam_width for group in groups)
    assert not any(step.preempted_request_ids for step in runner.steps)
    moved = [(target, source) for step in runner.steps for target, source, _ in step.beam_updates if target != source]
    assert moved, "no beam took another's sequence"
    assert any(cached.block_ids is not None for step in runner.steps for cached in step.cached_requests)
    assert engine.block_manager.num_used_blocks == 0 and not engine.requests and not engine.groups


def test_gpu_runner_beam_updates_copy_rows_on_its_host_arrays():
    """GpuModelRunner's `beam_updates` (host arrays only, so it runs without a GPU): a beam
    that continues itself gets its last token replaced; one that takes another's sequence
    gets that row's tokens, table and counts, then its own last token; every source is read
    before any row is written."""
    from types import SimpleNamespace

    import numpy as np

    from inflightllm.gpu.runner import GpuModelRunner

    rows = {"a": 0, "b": 1, "c": 2, "d": 3}
    runner = SimpleNamespace(
        rows=rows, token_ids=np.zeros((4, 32), np.int64), num_tokens=np.array([10, 10, 10, 7]),
        num_computed=np.array([9, 9, 9, 6]), prompt_lens=np.array([5, 5, 5, 5]),
        block_table=np.zeros((4, 8), np.int32), states={})
    for name, row in rows.items():
        count = int(runner.num_tokens[row])
        runner.token_ids[row, :count] = np.arange(count) + 100 * row
        runner.block_table[row, :3] = [10 * row + i for i in range(3)]
        runner.states[name] = SimpleNamespace(token_ids=runner.token_ids[row, :count].tolist(),
                                              block_table=runner.block_table[row, :3].tolist())
    # a continues itself and is copied into b; c continues itself and is copied into d.
    GpuModelRunner._apply_beam_updates(runner, [("a", "a", 7), ("b", "a", 8), ("c", "c", 9), ("d", "c", 6)])
    expected_tokens = {"a": list(range(9)) + [7], "b": list(range(9)) + [8],
                       "c": list(range(200, 209)) + [9], "d": list(range(200, 209)) + [6]}
    expected_tables = {"a": [0, 1, 2], "b": [0, 1, 2], "c": [20, 21, 22], "d": [20, 21, 22]}
    for name, row in rows.items():
        assert runner.token_ids[row, :10].tolist() == expected_tokens[name], name
        assert runner.states[name].token_ids == expected_tokens[name], name
        assert runner.block_table[row, :3].tolist() == expected_tables[name], name
        assert runner.states[name].block_table == expected_tables[name], name
    assert runner.num_tokens.tolist() == [10, 10, 10, 10] and runner.num_computed.tolist() == [9, 9, 9, 9]
