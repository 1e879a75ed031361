"""Host cost of the engine's bookkeeping: time per step at 256 running and 5,000 waiting.

    OMP_NUM_THREADS=1 .venv/bin/python perf/bench_bookkeeping.py [--running 256] [--waiting 5000]

The model is a null runner (one constant token per sampling request, no tensors), so the
figures are the engine's own host time: scheduling, block accounting, stop and hold-back
checks, outputs. Printed: milliseconds per decode step (all running requests decode;
the waiting queue stays full), per decode step late in long outputs (a cost that grows
with the output length would show here), and per abort of a request deep in the queue.
"""

from __future__ import annotations

import argparse
import time
from types import SimpleNamespace

import inflightllm.engine as engine_module
from inflightllm.config import EngineConfig
from inflightllm.engine import Engine
from inflightllm.model_source import DEFAULT_MODEL
from inflightllm.sampling_params import SamplingParams
from inflightllm.step import SampledTokens


class NullRunner:
    """The runner interface with no model: every sampling request gets token 7."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.tokens: dict[str, int] = {}

    def execute(self, step) -> SampledTokens:
        result = SampledTokens()
        for new in step.new_requests:
            self.tokens[new.request_id] = len(new.prompt_token_ids) + len(new.output_token_ids)
        for request_id in step.finished_request_ids:
            self.tokens.pop(request_id, None)
        for request_id, _ in step.scheduled:
            result.request_ids.append(request_id)
            result.token_ids.append(7)
            result.logprobs.append(-0.5)
            result.top_ids.append([])
            result.top_logprobs.append([])
        return result


def make_engine(running: int, waiting: int, prompt_len: int, max_tokens: int) -> Engine:
    block_size = 16
    blocks_per_request = -(-(prompt_len + max_tokens) // block_size)
    num_blocks = running * blocks_per_request + 8
    config = EngineConfig(max_batch_size=running, max_num_tokens=running * prompt_len, num_kv_blocks=num_blocks,
                          block_size=block_size, max_output_len=max_tokens, enable_kv_cache_reuse=True)
    loaded = SimpleNamespace(arch=SimpleNamespace(vocab_size=49152, max_position_embeddings=prompt_len + max_tokens),
                             eos_token_ids=frozenset({2}), config=None)
    # Built the way the engine builds its runner, so this runs on older engines too.
    engine_module.make_model_runner = lambda *args: NullRunner(num_blocks)
    engine_module.ModelDims.from_config = staticmethod(lambda config: None)
    engine = Engine(DEFAULT_MODEL, config, loaded=loaded)
    # Stop words make the stop and hold-back checks do work on every token.
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, logprobs=True,
                            stop_sequences=((11, 12, 13), (21, 22)))
    for index in range(running + waiting):
        prompt = [100 + (index * 31 + j) % 40000 for j in range(prompt_len)]
        engine.add_request(f"r{index}", prompt, params, streaming=True)
    return engine


def ms_per_step(engine: Engine, steps: int) -> float:
    started = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return (time.perf_counter() - started) / steps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--running", type=int, default=256)
    parser.add_argument("--waiting", type=int, default=5000)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    engine = make_engine(args.running, args.waiting, args.prompt_len, args.max_tokens)
    engine.step()  # prefill of the first batch
    stats = engine.stats()
    print(f"running {stats.num_running}, waiting {stats.num_waiting}, blocks used {stats.num_blocks_used}")
    early = ms_per_step(engine, args.steps)
    for _ in range(args.max_tokens - 2 * args.steps - 10):  # far into the outputs
        engine.step()
    late = ms_per_step(engine, args.steps)
    stats = engine.stats()
    assert stats.num_running == args.running and stats.num_waiting == args.waiting, stats
    aborts = 200
    started = time.perf_counter()
    for index in range(aborts):  # from the back of the queue: the deepest entries
        engine.abort(f"r{args.running + args.waiting - 1 - index}")
    abort_ms = (time.perf_counter() - started) / aborts * 1e3
    print(f"host time per decode step, {args.running} running, {args.waiting} waiting: "
          f"{early:.2f} ms (outputs ~{args.steps} tokens), {late:.2f} ms (outputs ~{args.max_tokens - args.steps} tokens)")
    print(f"host time per abort of a request at the back of a {args.waiting}-deep queue: {abort_ms * 1e3:.1f} us")


if __name__ == "__main__":
    main()
