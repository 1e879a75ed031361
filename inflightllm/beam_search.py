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

from dataclasses import dataclass, field


def token_logprobs_of(cum_history: list[float]) -> list[float]:
    """Per-token log probs from the cumulative log prob after each token (what a beam's
    sequence keeps in `Request.logprobs`)."""
    return [value - (cum_history[i - 1] if i else 0.0) for i, value in enumerate(cum_history)]


@dataclass
class Hypothesis:
    """A finished beam: its generated ids (with the stop token), score and cum log prob;
    `token_logprobs`: each generated token's log prob (when `step` was given the beams')."""

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

    @property
    def candidates_per_beam(self) -> int:
        return max(2, 1 + self.num_eos) * self.beam_width

    def step(self, beam_tokens: list[list[int]], top_ids: list[list[int]],
             top_logprobs: list[list[float]], max_len_reached: bool = False,
             beam_cum_histories: list[list[float]] | None = None) -> list[NextBeam]:
        """One step over the live beams: `beam_tokens[b]` is beam b's generated ids so far,
        `top_ids[b]`/`top_logprobs[b]` its best candidates (best first). Returns the next
        live beams (empty when the search is done). `beam_cum_histories[b]`, when given, is
        beam b's cumulative log prob after each of its tokens: a hypothesis finished now
        keeps its per-token log probs (TensorRT-LLM's `output_log_probs` per beam), worked
        out only then (a step costs nothing per generated token)."""
        keep = self.candidates_per_beam
        scored = []  # (score, beam, rank in its row, token, its log prob)
        for beam, (ids, values) in enumerate(zip(top_ids, top_logprobs, strict=True)):
            base = self.running_scores[beam]
            for rank, (token, value) in enumerate(zip(ids[:keep], values[:keep], strict=True)):
                scored.append((base + value, beam, rank, token, value))
        # Best first; ties by beam then rank, as a top-k over the flattened [beam, vocab] would.
        scored.sort(key=lambda item: (-item[0], item[1], item[2]))
        candidates = scored[:keep]
        length = self.num_generated + 1
        hits = [token in self.stop_token_ids or length >= self.max_tokens or max_len_reached
                for _, _, _, token, _ in candidates]
        # Finished hypotheses from the first beam_width candidates that hit a stop.
        full_and_early = len(self.finished) == self.beam_width and self.early_stopping is True
        if self.improvable and not full_and_early:
            for (score, beam, _, token, value), hit in zip(candidates[: self.beam_width], hits, strict=False):
                if hit:
                    token_logprobs = [] if beam_cum_histories is None else \
                        token_logprobs_of(beam_cum_histories[beam]) + [value]
                    self.finished.append(Hypothesis(beam_tokens[beam] + [token],
                                                    score / (length ** self.length_penalty), score, token_logprobs))
            self.finished.sort(key=lambda hyp: -hyp.score)  # stable: earlier ones first on ties
            del self.finished[self.beam_width:]
        # The next live beams: stop hits go after the others.
        order = sorted(range(len(candidates)), key=lambda i: (hits[i], i))[: self.beam_width]
        next_beams = [NextBeam(candidates[i][1], candidates[i][3], candidates[i][0]) for i in order]
        self.running_scores = [beam.cum_logprob if not hits[i] else beam.cum_logprob - 1e9
                               for i, beam in zip(order, next_beams, strict=True)]
        self.num_generated = length
        # Can a running beam still beat the worst finished one?
        if self.improvable and len(self.finished) == self.beam_width:
            if self.early_stopping == "never" and self.length_penalty > 0.0:
                best_length = self.max_tokens
            else:
                best_length = self.num_generated
            best_running = self.running_scores[0] / (best_length ** self.length_penalty)
            self.improvable = best_running > self.finished[-1].score
        all_hit = all(hits)
        full = len(self.finished) == self.beam_width and self.early_stopping is True
        if not self.improvable or full or all_hit:
            self.done = True
            return []
        return next_beams
