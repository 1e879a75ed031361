"""Perplexity of a model over a shipped public-domain text, per quantization variant.

Variants (one process, the same tokens, the same chunking):
- `base`: the model in its dtype (bf16 by default);
- `fp8`: FP8 e4m3 weights (per-channel scales) with per-token activation scales;
- `fp8-kv`: the same plus an FP8 KV cache;
- `fp8-smooth`, `fp8-kv-smooth`: those two with SmoothQuant (alpha 0.5) folded into the
  weights before they are quantized (`model.fp8_smoothing`, inflightllm.quantization.smoothing);
- each fp8 variant with `-lmh`: the LM head in FP8 too (`model.fp8_lm_head`), read weight-only
  by one-token steps; its logits are computed a row at a time so that every position takes
  that path (the others compute a chunk's logits at once, as prefill does).
  `--lm-head-int8`: the `-lmh` variants' LM head in int8 instead (`model.int8_lm_head`: per-row
  scales, amax / 127; the same bytes as e4m3), and `base-lmh` is the 16-bit model with it.

The text (perf/inputs/coriolanus.txt: the opening of Shakespeare's Coriolanus, public
domain, ~2,400 SmolLM2 tokens) is fed through the engine's own runner and paged KV cache
in chunks of `--chunk` tokens (chunked prefill), so every chunk after the first attends
to K/V read back from the cache: an FP8 cache is exercised as decoding would. Reported
per variant: perplexity, its ratio to `base`, and the greedy top-1 agreement with `base`
(the share of positions whose argmax equals base's).

    python -m perf.perplexity                                   # CPU: SmolLM2, emulated FP8
    python -m perf.perplexity --device gpu --out $OUT/ppl.json  # GPU kernels

Prints a table; `--out` saves the figures as JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from pathlib import Path

import numpy as np
import torch

from inflightllm.config import EngineConfig
from inflightllm.model_source import DEFAULT_MODEL, ModelSpec, load_tokenizer

TEXT = Path(__file__).resolve().parent / "inputs" / "coriolanus.txt"
# name -> (quantization, kv_cache_dtype, SmoothQuant alpha or None); a name ending in -lmh
# adds model.fp8_lm_head (int8_lm_head with --lm-head-int8), its logits computed a row at a
# time (as one-token steps read them).
VARIANTS = {"base": (None, "auto", None), "fp8": ("fp8", "auto", None), "fp8-kv": ("fp8", "fp8", None),
            "fp8-smooth": ("fp8", "auto", 0.5), "fp8-kv-smooth": ("fp8", "fp8", 0.5)}
VARIANTS.update({f"{name}-lmh": value for name, value in VARIANTS.items()})  # base-lmh: --lm-head-int8 only
DEFAULT_VARIANTS = ("base", "fp8", "fp8-kv")


def _logits(model, hidden: torch.Tensor, by_row: bool, **kwargs) -> torch.Tensor:
    """The chunk's logits at once, or a row at a time (the one-token steps' LM head path)."""
    if not by_row:
        return model.compute_logits(hidden, **kwargs)
    return torch.cat([model.compute_logits(hidden[row : row + 1], **kwargs) for row in range(hidden.shape[0])])


def _chunk_logits_cpu(runner, token_ids: list[int], chunk: int, by_row: bool = False):
    """Per chunk: float32 logits of every position, through the CPU runner's cache."""
    from inflightllm.attention import SequenceSlice

    blocks = -(-len(token_ids) // runner.attention.block_size)
    table = tuple(range(blocks))
    for start in range(0, len(token_ids), chunk):
        end = min(start + chunk, len(token_ids))
        ids = torch.tensor(token_ids[start:end], dtype=torch.int64)
        metadata = runner.attention.build_metadata(
            [SequenceSlice(query_start=0, query_len=end - start, context_len=end, block_table=table)], runner.device
        )
        hidden = runner.model(ids, runner.attention, metadata)
        yield _logits(runner.model, hidden, by_row)


def _chunk_logits_gpu(runner, token_ids: list[int], chunk: int, by_row: bool = False):
    """Per chunk: float32 logits of every position, through the CUDA runner's cache."""
    from inflightllm.gpu import ops

    blocks = -(-len(token_ids) // runner.block_size)
    runner.block_table[0, :blocks] = np.arange(blocks)
    for start in range(0, len(token_ids), chunk):
        end = min(start + chunk, len(token_ids))
        count = end - start
        metadata = runner._metadata_from_host(
            rows=np.array([0]), query_lens=np.array([count]), num_computed=np.array([start]), num_decodes=0,
            input_ids=np.asarray(token_ids[start:end], np.int64),
        )
        with ops.torch_stream():
            hidden = runner.model.forward(runner.input_ids[:count], runner.positions[:count], runner.attention, metadata)
            logits = _logits(runner.model, hidden, by_row, dtype=torch.float32)
        yield logits


def evaluate(spec: ModelSpec, config: EngineConfig, token_ids: list[int], chunk: int) -> dict:
    """Negative log-likelihood of each next token and each position's argmax."""
    from inflightllm.engine import Engine

    engine = Engine(spec, config)
    runner = engine.runner
    stream = _chunk_logits_gpu if config.device == "gpu" else _chunk_logits_cpu
    nll, argmax = [], []
    started = time.perf_counter()
    with torch.inference_mode():
        position = 0
        for logits in stream(runner, token_ids, chunk, by_row=spec.lm_head_kind() is not None):
            count = logits.shape[0]
            logprobs = torch.log_softmax(logits.float(), dim=-1)
            targets = torch.tensor(token_ids[position + 1 : position + count + 1], device=logprobs.device)
            scored = min(count, len(targets))
            nll.append(-logprobs[torch.arange(scored, device=logprobs.device), targets[:scored]].double().cpu())
            argmax.append(logits[:scored].argmax(dim=-1).cpu())
            position += count
    seconds = time.perf_counter() - started
    nll_all = torch.cat(nll)
    del engine, runner
    if config.device == "gpu":
        torch.cuda.empty_cache()
    return {"nll": nll_all, "argmax": torch.cat(argmax), "seconds": seconds}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--chunk", type=int, default=256, help="tokens per prefill chunk")
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), help=f"comma-separated of {', '.join(VARIANTS)}")
    parser.add_argument("--max-tokens", type=int, default=0, help="use only the first N tokens (0: all)")
    parser.add_argument("--out", type=Path, default=None, help="save the figures as JSON here")
    parser.add_argument("--lm-head-int8", action="store_true",
                        help="the -lmh variants' LM head in int8 (model.int8_lm_head) instead of e4m3")
    args = parser.parse_args(argv)
    if args.device == "cpu":
        torch.set_num_threads(max(1, torch.get_num_threads()))
    text = TEXT.read_text()
    tokenizer = load_tokenizer(DEFAULT_MODEL)
    token_ids = tokenizer(text)["input_ids"]
    if args.max_tokens:
        token_ids = token_ids[: args.max_tokens]
    config = EngineConfig(
        device=args.device, max_num_tokens=max(args.chunk, 256), max_batch_size=8,
        max_input_length=len(token_ids) + 16, max_output_len=16, num_kv_blocks=-(-len(token_ids) // 16) + 8,
        cuda_graphs=False,
    )
    head_key = "int8_lm_head" if args.lm_head_int8 else "fp8_lm_head"
    if "base-lmh" in args.variants.split(",") and not args.lm_head_int8:
        parser.error("--variants base-lmh: only with --lm-head-int8 (the e4m3 head needs FP8 linears)")
    results = {}
    base = None
    for name in args.variants.split(","):
        if name not in VARIANTS:
            parser.error(f"--variants: {name!r} is not a variant; allowed: {', '.join(VARIANTS)}")
        quantization, kv_cache_dtype, smoothing = VARIANTS[name]
        spec = dataclasses.replace(DEFAULT_MODEL, dtype=args.dtype, quantization=quantization, fp8_smoothing=smoothing,
                                   **{head_key: True if name.endswith("-lmh") else None})
        figures = evaluate(spec, dataclasses.replace(config, kv_cache_dtype=kv_cache_dtype), token_ids, args.chunk)
        ppl = math.exp(float(figures["nll"].mean()))
        entry = {"perplexity": ppl, "tokens": int(figures["nll"].numel()), "seconds": figures["seconds"]}
        if base is None:
            base = (ppl, figures["argmax"])
        entry["ratio_to_base"] = ppl / base[0]
        entry["top1_agreement_with_base"] = float((figures["argmax"] == base[1]).double().mean())
        results[name] = entry
    print(f"SmolLM2-135M, {len(token_ids)} tokens of {TEXT.name}, {args.device}, {args.dtype}, chunks of {args.chunk}")
    print(f"{'variant':<18} {'perplexity':>11} {'vs base':>8} {'top-1 agree':>12} {'seconds':>8}")
    for name, entry in results.items():
        print(f"{name:<18} {entry['perplexity']:>11.4f} {entry['ratio_to_base']:>8.4f} "
              f"{entry['top1_agreement_with_base']:>12.4f} {entry['seconds']:>8.1f}")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"device": args.device, "dtype": args.dtype, "chunk": args.chunk,
                                        "lm_head": "int8" if args.lm_head_int8 else "e4m3",
                                        "text": TEXT.name, "results": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
