"""A stub model for driving the real Engine, Scheduler and BlockManager without weights.

`StubRunner` implements the runner interface (`execute(StepDescription) -> SampledTokens`)
over a paged "KV cache" in which every slot records the token prefix it was computed
from. Before a step computes a chunk it checks that every context slot of the request
holds exactly the prefix it stands for, so a wrong block table, a wrong prefix-cache hit,
a lost swap or a block reused while still in use is seen at once (`violations`).
The next token is a function of the whole prefix (`next_token`), so the output of a
request is known offline (`reference_output`) whatever the schedule was.
"""

from __future__ import annotations

from types import SimpleNamespace

from inflightllm.config import EngineConfig
from inflightllm.engine import Engine
from inflightllm.model_runner import RequestStates
from inflightllm.model_source import DEFAULT_MODEL
from inflightllm.step import SampledTokens, StepDescription

VOCAB = 97
EOS = 0


def next_token(tokens: list[int]) -> int:
    """The stub model: the next token as a function of the whole prefix."""
    return (sum((i + 1) * t for i, t in enumerate(tokens[-8:])) + 7 * len(tokens)) % VOCAB


def stub_candidates(tokens: list[int], count: int) -> tuple[list[int], list[float]]:
    """The stub's top `count` next tokens and their log probs, best first (what a runner
    returns as top log probs; beam search reads them): distinct ids around `next_token`,
    log probs 0.3 apart plus a little that depends on the prefix (never out of order)."""
    base = next_token(tokens)
    ids = [(base + 7 * rank) % VOCAB for rank in range(count)]
    wobble = sum(tokens[-8:]) + len(tokens)
    values = [-0.1 - 0.3 * rank - ((wobble * (rank + 1)) % 13) * 0.01 for rank in range(count)]
    return ids, values


def reference_output(prompt: list[int], max_tokens: int, model=next_token, eos: int | None = EOS) -> list[int]:
    """What the engine must produce for a greedy request (EOS ends it and is dropped)."""
    tokens = list(prompt)
    for _ in range(max_tokens):
        token = model(tokens)
        if token == eos:
            break
        tokens.append(token)
    return tokens[len(prompt):]


class StubRunner:
    """The runner interface over slot records; see the module docstring."""

    def __init__(self, num_blocks: int, block_size: int, model=next_token, num_host_blocks: int = 0):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.model = model
        self.slots: list[tuple[int, ...] | None] = [None] * (num_blocks * block_size)
        # The host KV tier's slots (engine.host_kv_cache_bytes), records like `slots`.
        self.num_host_blocks = num_host_blocks
        self.host_slots: list[tuple[int, ...] | None] = [None] * (num_host_blocks * block_size)
        self.host_copies = 0  # blocks copied either way
        self.states = RequestStates()
        self.swapped: dict[str, list] = {}
        self.violations: list[str] = []
        self.seen_request_ids: set[str] = set()
        self.steps: list[StepDescription] = []
        self.contexts_checked = 0  # slots verified before being attended
        self.tokens_reused = 0  # context tokens computed in an earlier step or another request

    def _slot(self, block_table: list[int], position: int) -> int:
        return block_table[position // self.block_size] * self.block_size + position % self.block_size

    def _block_slots(self, block_ids: list[int]) -> list[int]:
        return [b * self.block_size + i for b in block_ids for i in range(self.block_size)]

    def execute(self, step: StepDescription) -> SampledTokens:
        self.steps.append(step)
        for request_id, block_ids in step.swap_out:
            self.swapped[request_id] = [self.slots[s] for s in self._block_slots(block_ids)]
        size = self.block_size
        for block, slot in step.kv_offloads:  # host tier: before anything in the step writes
            self.host_slots[slot * size : (slot + 1) * size] = self.slots[block * size : (block + 1) * size]
        self.host_copies += len(step.kv_offloads) + len(step.kv_onloads)
        for source, destination in step.block_copies:  # copy-on-write
            for offset in range(self.block_size):
                self.slots[destination * self.block_size + offset] = self.slots[source * self.block_size + offset]
        for request_id, block_ids in step.swap_in:
            for slot, record in zip(self._block_slots(block_ids), self.swapped.pop(request_id), strict=True):
                self.slots[slot] = record
        for slot, block in step.kv_onloads:
            self.slots[block * size : (block + 1) * size] = self.host_slots[slot * size : (slot + 1) * size]
        for request_id in step.finished_request_ids:
            self.swapped.pop(request_id, None)
        self.states.update(step)
        result = SampledTokens()
        for request_id, num_new in step.scheduled:
            self.seen_request_ids.add(request_id)
            state = self.states[request_id]
            tokens = state.token_ids
            start, end = state.num_computed_tokens, state.num_computed_tokens + num_new
            if end > len(state.block_table) * self.block_size:
                self.violations.append(f"{request_id}: {end} tokens do not fit {len(state.block_table)} blocks")
                continue
            for position in range(start):
                self.contexts_checked += 1
                record = self.slots[self._slot(state.block_table, position)]
                if record != tuple(tokens[: position + 1]):
                    self.violations.append(
                        f"{request_id}: slot of position {position} holds {record}, expected the prefix "
                        f"{tuple(tokens[: position + 1])}"
                    )
                    break
            self.tokens_reused += start
            for position in range(start, end):
                self.slots[self._slot(state.block_table, position)] = tuple(tokens[: position + 1])
            if end == len(tokens):
                count = state.params.top_logprobs
                top_ids, top_values = stub_candidates(tokens, count) if count else ([], [])
                token = self.model(tokens)
                tokens.append(token)
                result.request_ids.append(request_id)
                result.token_ids.append(token)
                result.logprobs.append(None)
                result.top_ids.append(top_ids)
                result.top_logprobs.append(top_values)
        return result


def stub_engine(num_blocks: int = 64, block_size: int = 4, model=next_token, max_model_len: int = 4096,
                num_host_blocks: int = 0, **config) -> Engine:
    """The real Engine (scheduler, block manager) over a StubRunner."""
    loaded = SimpleNamespace(
        arch=SimpleNamespace(vocab_size=VOCAB, max_position_embeddings=max_model_len),
        eos_token_ids=frozenset({EOS}),
    )
    runner = StubRunner(num_blocks, block_size, model, num_host_blocks)
    config.setdefault("max_input_length", 1024)
    return Engine(DEFAULT_MODEL, EngineConfig(num_kv_blocks=num_blocks, block_size=block_size, **config),
                  loaded=loaded, runner=runner)
