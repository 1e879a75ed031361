"""Cost of one decode step: this engine vs `transformers`, and the GEMM floor under both.

    .venv/bin/python perf/bench_step.py            # batches 1, 8, 32

Prints milliseconds per decode step for `Engine.step()` (40-token prompts, all
requests decoding) and for `transformers` `generate` (difference of a 45- and a
5-token generation over 40 steps), and the time of the 30 layers' projection GEMMs
alone (fresh random weights, so nothing stays in cache) for the same row counts.
"""

from __future__ import annotations

import argparse
import time

import torch

from inflightllm.config import EngineConfig
from inflightllm.engine import Engine
from inflightllm.model_source import DEFAULT_MODEL, prepare
from inflightllm.models.loader import load_model
from inflightllm.sampling_params import SamplingParams


def engine_step_ms(loaded, batch: int, steps: int = 20) -> float:
    engine = Engine(DEFAULT_MODEL, EngineConfig(num_kv_blocks=1024, max_batch_size=64), loaded=loaded)
    for i in range(batch):
        engine.add_request(f"r{i}", [100 + i + j for j in range(40)], SamplingParams(max_tokens=200, ignore_eos=True))
    for _ in range(4):  # prefill, then warm decodes
        engine.step()
    started = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return (time.perf_counter() - started) / steps * 1000


def transformers_step_ms(model, batch: int) -> float:
    ids = torch.randint(100, 1000, (batch, 40))
    mask = torch.ones_like(ids)

    def run(tokens: int) -> float:
        started = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=tokens, min_new_tokens=tokens,
                           do_sample=False, pad_token_id=2)
        return time.perf_counter() - started

    return (run(45) - run(5)) / 40 * 1000


def gemm_ms(rows: int, repeats: int = 5) -> float:
    shapes = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]
    layers = [[torch.randn(out, inp) for out, inp in shapes] for _ in range(30)]
    inputs = {576: torch.randn(rows, 576), 1536: torch.randn(rows, 1536)}

    def run():
        for layer in layers:
            for weight in layer:
                torch.nn.functional.linear(inputs[weight.shape[1]], weight)

    run()
    started = time.perf_counter()
    for _ in range(repeats):
        run()
    return (time.perf_counter() - started) / repeats * 1000


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,8,32")
    args = parser.parse_args(argv)
    from transformers import AutoModelForCausalLM

    loaded = load_model(DEFAULT_MODEL)
    hf_model = AutoModelForCausalLM.from_pretrained(prepare(DEFAULT_MODEL), dtype=torch.float32).eval()
    print(f"torch threads {torch.get_num_threads()}")
    print(f"{'batch':>5s} {'engine ms/step':>15s} {'transformers ms/step':>21s} {'layer GEMMs ms':>15s}")
    for batch in (int(b) for b in args.batches.split(",")):
        print(f"{batch:5d} {engine_step_ms(loaded, batch):15.1f} {transformers_step_ms(hf_model, batch):21.1f} "
              f"{gemm_ms(batch):15.1f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
