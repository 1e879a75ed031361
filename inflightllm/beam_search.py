"""Beam search scoring and stopping, as `transformers`' `generate(num_beams=...)` does it.

The runner does the per-beam part on the device: the top `candidates_per_beam` log probs
of each live beam's row (its top log probs, computed like any request's). `BeamSearch.step`
does the per-group part on those few candidates, with `transformers`' semantics
(GenerationMixin._beam_search, transformers 5):

- candidates: every (beam, token) with score = the beam's cumulative log prob + the
  token's log prob; the best `candidates_per_beam` = max(2, 1 + number of EOS ids) *
  beam_width of all of them are kept, best first;
- a candidate *hits a stop* when its token is a stop token or it reaches max_tokens;
- the next live beams: the best `beam_width` candidates that do not hit a stop (those that
  do fill in after them, as transformers' -1e9 penalty leaves them);
- finished hypotheses: a candidate among the first `beam_width` that hits a stop scores
  its cumulative log prob / (generated length incl. the stop token) ** length_penalty and
  joins the `beam_width` best finished, unless they are all there and early_stopping is
  True, or no running beam can improve on them any more;
- the search ends when no running beam can improve on the finished ones (early_stopping
  False: at its current length; "never": at max_tokens when length_penalty > 0), when all
  `beam_width` finished slots are filled and early_stopping is True, or when every
  candidate hits a stop.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
import torch


def token_logprobs_of(cum_history: list[float]) -> list[float]:
    """Per-token log probs from the cumulative log prob after each token (what a beam's
    sequence keeps in `Request.logprobs`)."""
    return [value - (cum_history[i - 1] if i else 0.0) for i, value in enumerate(cum_history)]


@dataclass
class Hypothesis:
    """A finished beam: its generated ids (with the stop token), score and cum log prob;
    `token_logprobs`: each generated token's log prob (when the beams' histories were given)."""

    token_ids: list[int]
    score: float
    cum_logprob: float
    token_logprobs: list[float] = field(default_factory=list)


@dataclass
class NextBeam:
    """A live beam after a step: the index of the beam it continues, its new token, and
    its cumulative log prob."""

    parent: int
    token_id: int
    cum_logprob: float


@dataclass
class BeamSearch:
    beam_width: int
    max_tokens: int
    stop_token_ids: frozenset[int]
    num_eos: int = 1
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    finished: list[Hypothesis] = field(default_factory=list)  # best first, at most beam_width
    running_scores: list[float] = field(default_factory=lambda: [0.0])  # cum log prob per live beam
    num_generated: int = 0
    improvable: bool = True  # transformers' is_early_stop_heuristic_unsatisfied
    done: bool = False

    def __post_init__(self) -> None:
        self.stop_key = tuple(sorted(self.stop_token_ids))  # groups with equal stops share one test
        self.candidates_per_beam = max(2, 1 + self.num_eos) * self.beam_width

    def step(self, beam_tokens: list[list[int]], top_ids: list[list[int]],
             top_logprobs: list[list[float]], max_len_reached: bool = False,
             beam_cum_histories: list[list[float]] | None = None) -> list[NextBeam]:
        """One step over the live beams: `beam_tokens[b]` is beam b's generated ids so far,
        `top_ids[b]`/`top_logprobs[b]` its best candidates (best first). Returns the next
        live beams (empty when the search is done). `beam_cum_histories[b]`, when given, is
        beam b's cumulative log prob after each of its tokens: a hypothesis finished now
        keeps its per-token log probs. One group of `step_searches`."""
        histories = None if beam_cum_histories is None else (lambda _, beam: beam_cum_histories[beam])
        result = step_searches([self], [top_ids], [top_logprobs], [max_len_reached],
                               lambda _, beam: beam_tokens[beam], histories)[0]
        return [NextBeam(parent, token, cum) for parent, token, cum in
                zip(result.parents, result.token_ids, result.cum_logprobs, strict=True)]


@dataclass(slots=True)
class StepResult:
    """The next live beams of one search, in beam order (all empty when it is done): the
    index of the live beam each continues, its new token and its cumulative log prob."""

    parents: list[int]
    token_ids: list[int]
    cum_logprobs: list[float]


def step_searches(searches: list[BeamSearch], top_ids: list[list[list[int]]],
                  top_logprobs: list[list[list[float]]], max_len_reached: list[bool],
                  beam_tokens, beam_cum_histories=None) -> list[StepResult]:
    """One step of many beam searches at once (one engine step's groups).

    `top_ids[i][b]`, `top_logprobs[i][b]`: live beam b of search i, its best candidates
    (best first, at least `candidates_per_beam` of them); `beam_tokens(i, b)` its generated
    ids so far and `beam_cum_histories(i, b)` (optional; None for a search that does not
    keep them) its cumulative log prob after each token, for a finished hypothesis's
    per-token log probs (both asked only for a beam whose candidate finishes a hypothesis). The scoring
    (candidates, their order, stop hits, the next beams) runs as tensor ops over all the
    searches of one (beam_width, candidates) shape together; what stays per search is
    constant work, and a loop over the candidates only where one finishes a hypothesis.
    Scores are float64 as Python floats are, so the result equals the one-group rule of
    the module docstring exactly (ties: by beam, then rank, as a stable sort gives)."""
    results: list[StepResult | None] = [None] * len(searches)
    buckets: dict[tuple[int, int], list[int]] = {}
    for index, search in enumerate(searches):
        buckets.setdefault((search.beam_width, search.candidates_per_beam), []).append(index)
    for (width, keep), indexes in buckets.items():
        _step_bucket(searches, indexes, width, keep, top_ids, top_logprobs, max_len_reached, beam_tokens,
                     beam_cum_histories, results)
    return results


def _candidate_arrays(indexes, width, keep, top_ids, top_logprobs, searches):
    """[G, width, keep] ids and log probs (float64), [G, width] cumulative log probs; a
    search with fewer live beams (its first step) is padded with -inf beams."""
    groups = len(indexes)
    rows_ids = [row for i in indexes for row in top_ids[i]]
    if len(rows_ids) == groups * width and all(len(row) == keep for row in rows_ids):
        # The usual case (every group has all its beams, each row `keep` candidates): one
        # flat conversion of each part.
        chain = itertools.chain.from_iterable
        ids = np.fromiter(chain(rows_ids), np.int64, groups * width * keep).reshape(groups, width, keep)
        values = np.fromiter(chain(row for i in indexes for row in top_logprobs[i]), np.float64,
                             groups * width * keep).reshape(groups, width, keep)
        cum = np.fromiter(chain(searches[i].running_scores for i in indexes), np.float64,
                          groups * width).reshape(groups, width)
        return ids, values, cum
    ids = np.zeros((groups, width, keep), np.int64)
    values = np.full((groups, width, keep), -np.inf)
    cum = np.full((groups, width), -np.inf)
    for position, i in enumerate(indexes):
        for beam, (row_ids, row_values) in enumerate(zip(top_ids[i], top_logprobs[i], strict=True)):
            count = min(keep, len(row_ids))
            ids[position, beam, :count] = row_ids[:count]
            values[position, beam, :count] = row_values[:count]
        running = searches[i].running_scores
        cum[position, : len(running)] = running
    return ids, values, cum


def _step_bucket(searches, indexes, width, keep, top_ids, top_logprobs, max_len_reached, beam_tokens,
                 beam_cum_histories, results) -> None:
    groups = len(indexes)
    ids, values, cum = _candidate_arrays(indexes, width, keep, top_ids, top_logprobs, searches)
    # [G, width * keep] scores; the best `keep` of each group, ties by (beam, rank) as the
    # flattened order has them.
    scores = torch.from_numpy(cum[:, :, None] + values).view(groups, width * keep)
    sorted_scores, order = torch.sort(scores, dim=1, descending=True, stable=True)
    cand_scores = sorted_scores[:, :keep]
    order = order[:, :keep]
    cand_beams = order // keep
    cand_tokens = torch.from_numpy(ids).view(groups, width * keep).gather(1, order)
    cand_values = torch.from_numpy(values).view(groups, width * keep).gather(1, order)  # their own log probs
    # A candidate hits a stop: a stop token, max_tokens, or the model's length.
    lengths = [searches[i].num_generated + 1 for i in indexes]
    ends = torch.tensor([length >= searches[i].max_tokens or bool(max_len_reached[i])
                         for length, i in zip(lengths, indexes, strict=True)])
    stop_keys = {searches[i].stop_key for i in indexes}
    if len(stop_keys) == 1:
        hits = torch.isin(cand_tokens, torch.tensor(next(iter(stop_keys)), dtype=torch.int64))
    else:
        longest = max(len(key) for key in stop_keys)
        stops = torch.full((groups, max(1, longest)), -1, dtype=torch.int64)
        for position, i in enumerate(indexes):
            key = searches[i].stop_key
            stops[position, : len(key)] = torch.tensor(key, dtype=torch.int64)
        hits = (cand_tokens[:, :, None] == stops[:, None, :]).any(-1)
    hits |= ends[:, None]
    # The next live beams: the first `width` candidates, stop hits after the others.
    chosen = torch.sort(hits.to(torch.int8), dim=1, stable=True).indices[:, :width]
    next_hits = hits.gather(1, chosen)
    next_scores = cand_scores.gather(1, chosen)
    running = next_scores - torch.where(next_hits, 1e9, 0.0)
    next_parents = cand_beams.gather(1, chosen).tolist()
    next_tokens = cand_tokens.gather(1, chosen).tolist()
    next_cums = next_scores.tolist()
    running = running.tolist()
    first_hits = hits[:, :width].any(1).tolist()
    all_hit = hits.all(1).tolist()
    head = None  # the first `width` candidates as lists, made when a group needs them
    for position, i in enumerate(indexes):
        search = searches[i]
        length = lengths[position]
        # Finished hypotheses from the first beam_width candidates that hit a stop.
        full_and_early = len(search.finished) == width and search.early_stopping is True
        if first_hits[position] and search.improvable and not full_and_early:
            if head is None:
                head = (cand_scores[:, :width].tolist(), cand_beams[:, :width].tolist(),
                        cand_tokens[:, :width].tolist(), hits[:, :width].tolist(),
                        cand_values[:, :width].tolist())
            penalty = length ** search.length_penalty
            for score, beam, token, hit, value in zip(*(part[position] for part in head), strict=True):
                if hit:
                    history = beam_cum_histories(i, beam) if beam_cum_histories is not None else None
                    token_logprobs = [] if history is None else token_logprobs_of(history) + [value]
                    search.finished.append(Hypothesis(beam_tokens(i, beam) + [token], score / penalty, score,
                                                      token_logprobs))
            search.finished.sort(key=lambda hyp: -hyp.score)  # stable: earlier ones first on ties
            del search.finished[width:]
        search.running_scores = running[position]
        search.num_generated = length
        # Can a running beam still beat the worst finished one?
        if search.improvable and len(search.finished) == width:
            if search.early_stopping == "never" and search.length_penalty > 0.0:
                best_length = search.max_tokens
            else:
                best_length = length
            best_running = search.running_scores[0] / (best_length ** search.length_penalty)
            search.improvable = best_running > search.finished[-1].score
        full = len(search.finished) == width and search.early_stopping is True
        if not search.improvable or full or all_hit[position]:
            search.done = True
            results[i] = StepResult([], [], [])
        else:
            results[i] = StepResult(next_parents[position], next_tokens[position], next_cums[position])
