"""Structured output's cost (issue 28's goals), engine-only, in one run on one engine:

- throughput: 1,024 requests of 128/128 (random prompts, `ignore_eos`), submitted at once,
  three times: none constrained; half under one JSON schema; all under it. Output tok/s
  and the ratios to the unconstrained run (goals: half >= 0.90x, all >= 0.80x);
- compiles: N requests, each with a schema never seen before (cold compiles), submitted
  at once beside N unconstrained ones: compile ms per schema (p50/max, the compile
  thread's own timing) and the queue wait it causes (time to first token of the
  constrained requests against the unconstrained ones of the same burst);
- a burst (`--burst`, issue 28's server goal measured at the engine): long unconstrained
  requests decode while B requests arrive, once with B distinct schemas and once with no
  schema; the long requests' decode rate (their tokens/s during the burst) compared.

`--server`: the burst through the real tritonserver for the profile (the whole ensemble;
`--bundle` etc. as in perf/servers.py): S long unconstrained streams decode (stream=true,
max_tokens = min_tokens) while a burst of B requests arrives, once with a schema each
(`burst_schema`: distinct, short outputs) and once unconstrained (the same max_tokens);
the streams' tokens/s during each burst (from the responses' arrival times) compared,
against the goal "within 10%", with their rate before any burst as a reference.

How tokens are counted: every request must generate exactly its `max_tokens` (the bench
fails otherwise). The schema is a JSON list of at least `osl / 4 + 1` records of six typed
fields (integer, bounded string, enum, number, a short list of strings, boolean): no
output can complete within `osl` tokens, so a constrained request never ends early
(the grammar would end it with EOS, which `ignore_eos` does not override) and both
runs generate the same number of tokens; the mask still does a real schema's work
(keys forced, typed values, string and number states).

The vocabulary: a random-weight shape uses SmolLM2's tokenizer (49,152 ids; inflightllm's
random shapes), padded with never-allowed ids to the shape's vocabulary (128,256 for
llama3-8b): the masks are that size, the grammar works over SmolLM2's tokens.

    python -m perf.bench_guided --out $OUT/guided.json                                  # H200
    python -m perf.bench_guided --server --bundle ~/inflightllm-bundle --out $OUT/guided-server.json
    python -m perf.bench_guided --profile profiles/smollm2-random-cpu.yaml --shape tiny-llama3 \\
        --requests 8 --isl 16 --osl 8 --schemas 4 --burst 4 --max-batch-size 16         # CPU check

Prints the figures and saves them as JSON (`--out`).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import statistics
import time
from pathlib import Path

import torch

from inflightllm.engine import Engine
from inflightllm.guided import json_schema_spec
from inflightllm.profile import load_profile
from inflightllm.request import FinishReason
from inflightllm.sampling_params import SamplingParams
from perf.bench_gpu import prompts_of, sync

GOALS = {"half": 0.90, "all": 0.80}


def record_schema(osl: int, variant: int | None = None) -> dict:
    """A list of at least osl/4 + 1 records (no output completes within `osl` tokens).
    `variant` renames the fields and bounds, so each variant is a schema never compiled."""
    suffix = "" if variant is None else f"_{variant}"
    record = {
        "type": "object",
        "properties": {
            f"id{suffix}": {"type": "integer", "minimum": 0},
            f"name{suffix}": {"type": "string", "maxLength": 16 + (variant or 0) % 8},
            f"kind{suffix}": {"enum": ["alpha", "beta", "gamma"]},
            f"score{suffix}": {"type": "number"},
            f"tags{suffix}": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
            f"active{suffix}": {"type": "boolean"},
        },
    }
    record["required"] = list(record["properties"])
    return {"type": "array", "items": record, "minItems": osl // 4 + 1}


def burst_schema(index: int) -> dict:
    """A schema never seen before (its key and values name the index); a short output
    (about a dozen tokens: `{"k7":"v7","n":3}`)."""
    return {"type": "object", "properties": {f"k{index}": {"enum": [f"v{index}", "w"]},
                                             "n": {"type": "integer", "minimum": 0, "maximum": 9}},
            "required": [f"k{index}", "n"]}


def percentiles(values: list[float]) -> dict:
    if not values:
        return {"p50": None, "max": None}
    return {"p50": round(statistics.median(values), 2), "max": round(max(values), 2)}


def drive(engine: Engine, requests: list[tuple[str, list[int], SamplingParams]], osl: int | None = None,
          watch: set[str] | None = None) -> dict:
    """Submit every request at once and step until they finish. Returns wall seconds,
    output tokens, steps, each request's time to first token (s), and, for `watch` (streaming
    requests already running), their tokens generated meanwhile. `osl`: every request must generate exactly that."""
    sync()
    start = time.perf_counter()
    tracked = {rid: engine.add_request(rid, prompt, params) for rid, prompt, params in requests}
    generated = dict.fromkeys(tracked, 0)
    steps_before = engine.stats().num_steps_total
    watched_tokens = 0
    while any(not r.is_finished for r in tracked.values()):
        for output in engine.step():
            if output.error is not None:
                raise RuntimeError(f"{output.request_id}: {output.error}")
            if output.request_id in generated:
                generated[output.request_id] += len(output.new_token_ids)
                if output.finished and osl is not None and output.finish_reason is not FinishReason.LENGTH:
                    raise RuntimeError(f"{output.request_id}: ended {output.finish_reason} after "
                                       f"{generated[output.request_id]} tokens, before max_tokens {osl}")
            elif watch and output.request_id in watch:
                watched_tokens += len(output.new_token_ids)
    sync()
    seconds = time.perf_counter() - start
    if osl is not None:
        short = {rid: n for rid, n in generated.items() if n != osl}
        if short:
            raise RuntimeError(f"{len(short)} requests did not generate {osl} tokens: {dict(list(short.items())[:4])}")
    tokens = sum(generated.values())
    # The engine's own times (monotonic): from add_request to the step that sampled the first token.
    first_token_s = {rid: r.first_token_time - r.arrival_time for rid, r in tracked.items()}
    return {"seconds": seconds, "output_tokens": tokens, "output_tok_s": tokens / seconds,
            "steps": engine.stats().num_steps_total - steps_before, "first_token_s": first_token_s,
            "watched_tokens": watched_tokens}


def host_ms_per_step(before: dict, after: dict, steps: int) -> dict:
    """The engine's host ms per step by part over a run of `steps` steps (`Engine.host_seconds`
    deltas; schedule, launch, wait and emit are timed under asynchronous scheduling only):
    where a constrained step's host time goes. `masks` (the launched
    step's masks: fill, gather, upload) and `advance` (the tokens into the matchers, next
    masks filled; part of `emit`) run while the GPU computes the step; `wait` is the GPU
    time the host work did not hide."""
    return {key: round((value - before.get(key, 0.0)) * 1e3 / max(1, steps), 3)
            for key, value in after.items() if key != "steps"} | {"steps": steps}


def throughput_runs(engine: Engine, args, spec) -> dict:
    """none / half / all, the constrained runs once per `--mask-threads` value (the first
    value's are `half` and `all`; the others `half@N`, `all@N`)."""
    vocab = engine.vocab_size
    free = SamplingParams(max_tokens=args.osl, ignore_eos=True)
    guided = SamplingParams(max_tokens=args.osl, ignore_eos=True, guided=spec)
    pool = engine.grammar_compiler()
    runs = {}
    plan = [("none", 0, None)]
    for position, threads in enumerate(args.mask_threads):
        tag = "" if position == 0 else f"@{threads}"
        plan += [("half" + tag, 2, threads), ("all" + tag, 1, threads)]
    for position, (name, constrained_every, threads) in enumerate(plan):
        if threads is not None:
            pool.mask_threads = threads
        # Prompts of their own each run: with the same prompts, every run after the first found
        # them in the prefix cache and skipped their prefill (a constrained run then measured
        # up to 1.2x the unconstrained one).
        prompts = prompts_of(args.requests, args.isl, vocab, seed=1000 + position)
        requests = [(f"{name}-{i}", prompt, guided if constrained_every and i % constrained_every == 0 else free)
                    for i, prompt in enumerate(prompts)]
        host_before = dict(engine.host_seconds)
        result = drive(engine, requests, osl=args.osl)
        runs[name] = {"constrained": sum(r[2] is guided for r in requests), "seconds": round(result["seconds"], 3),
                      "output_tok_s": round(result["output_tok_s"], 1), "steps": result["steps"],
                      "host_ms_per_step": host_ms_per_step(host_before, engine.host_seconds, result["steps"])}
        if threads is not None:
            runs[name]["mask_threads"] = threads
        print(f"{name:8s}: {runs[name]['constrained']:5d} of {args.requests} constrained: "
              f"{runs[name]['output_tok_s']:10.1f} output tok/s ({result['seconds']:.2f} s, {result['steps']} steps"
              + (f", mask_threads {threads})" if threads is not None else ")"), flush=True)
        print(f"          host ms per step: {runs[name]['host_ms_per_step']}", flush=True)
    for name in runs:
        goal = GOALS.get(name.split("@")[0])
        if goal is None:
            continue
        runs[name]["ratio_to_none"] = round(runs[name]["output_tok_s"] / runs["none"]["output_tok_s"], 3)
        runs[name]["goal"] = f">= {goal:.2f}"
        print(f"{name}: {runs[name]['ratio_to_none']:.3f}x the unconstrained throughput (goal >= {goal:.2f})",
              flush=True)
    pool.mask_threads = args.mask_threads[0]
    return runs


def compile_run(engine: Engine, args, first_variant: int) -> dict:
    """N new schemas at once beside N unconstrained requests: compile ms and queue wait."""
    vocab = engine.vocab_size
    length = min(args.osl, 16)
    prompts = prompts_of(2 * args.schemas, args.isl, vocab, seed=13)
    pool = engine.grammar_compiler()
    compiled_before = len(pool.compile_seconds)
    requests = []
    for index in range(args.schemas):
        spec = json_schema_spec(record_schema(length, first_variant + index))
        requests.append((f"schema-{index}", prompts[2 * index], SamplingParams(max_tokens=length, ignore_eos=True,
                                                                              guided=spec)))
        requests.append((f"free-{index}", prompts[2 * index + 1], SamplingParams(max_tokens=length, ignore_eos=True)))
    result = drive(engine, requests, osl=length)
    compile_ms = [s * 1000 for s in pool.compile_seconds[compiled_before:]]
    if len(compile_ms) != args.schemas:
        raise RuntimeError(f"{len(compile_ms)} compiles for {args.schemas} new schemas")
    ttft = result["first_token_s"]
    constrained = [ttft[f"schema-{i}"] * 1000 for i in range(args.schemas)]
    unconstrained = [ttft[f"free-{i}"] * 1000 for i in range(args.schemas)]
    report = {
        "new_schemas": args.schemas, "max_tokens": length,
        "compile_ms": percentiles(compile_ms),
        "first_token_ms_constrained": percentiles(constrained),
        "first_token_ms_unconstrained": percentiles(unconstrained),
        "queue_wait_ms": {"p50": round(statistics.median(constrained) - statistics.median(unconstrained), 2),
                          "max": round(max(constrained) - max(unconstrained), 2)},
        "note": "one compile thread: the k-th new schema of a burst waits for the k-1 before it",
    }
    print(f"compile: {args.schemas} new schemas, {report['compile_ms']['p50']} ms p50 / "
          f"{report['compile_ms']['max']} ms max each; first token {report['first_token_ms_constrained']} ms "
          f"constrained vs {report['first_token_ms_unconstrained']} ms unconstrained "
          f"(queue wait p50 {report['queue_wait_ms']['p50']} ms)", flush=True)
    return report


def burst_run(engine: Engine, args, first_variant: int) -> dict:
    """Long unconstrained requests decode while a burst arrives: with B distinct schemas
    and with none. Their tokens per second meanwhile, per request."""
    vocab = engine.vocab_size
    length = min(args.osl, 32)
    background_count = max(1, min(args.burst_background, args.max_batch_size // 2))
    rates = {}
    # Prompts of their own each time (the second burst would find the first's in the prefix cache).
    for run, (label, with_schemas) in enumerate((("no_schema", False), ("distinct_schemas", True))):
        background = [f"{label}-bg-{i}" for i in range(background_count)]
        long_tokens = args.osl * 8
        for i, prompt in enumerate(prompts_of(background_count, args.isl, vocab, seed=17 + 100 * run)):
            engine.add_request(background[i], prompt, SamplingParams(max_tokens=long_tokens, ignore_eos=True),
                               streaming=True)
        for _ in range(4):  # prefill them; the burst then meets them decoding
            engine.step()
        burst = []
        for index, prompt in enumerate(prompts_of(args.burst, args.isl, vocab, seed=19 + 100 * run)):
            spec = json_schema_spec(record_schema(length, first_variant + index)) if with_schemas else None
            burst.append((f"{label}-burst-{index}", prompt, SamplingParams(max_tokens=length, ignore_eos=True,
                                                                           guided=spec)))
        result = drive(engine, burst, osl=length, watch=set(background))
        rates[label] = {"burst_seconds": round(result["seconds"], 3), "burst_steps": result["steps"],
                        "background_tok_s_per_request": round(result["watched_tokens"] / background_count
                                                              / result["seconds"], 2),
                        "steps_per_s": round(result["steps"] / result["seconds"], 2)}
        for request_id in background:
            engine.abort(request_id)
        while engine.has_unfinished():
            engine.step()
    ratio = rates["distinct_schemas"]["background_tok_s_per_request"] / rates["no_schema"]["background_tok_s_per_request"]
    report = {"burst": args.burst, "background_requests": background_count, "burst_max_tokens": length, **rates,
              "background_rate_ratio": round(ratio, 3), "goal": ">= 0.90 (within 10%)"}
    print(f"burst of {args.burst}: the {background_count} long requests decode at "
          f"{rates['distinct_schemas']['background_tok_s_per_request']} tok/s each beside distinct schemas, "
          f"{rates['no_schema']['background_tok_s_per_request']} beside unconstrained requests: "
          f"ratio {ratio:.3f} (goal >= 0.90)", flush=True)
    return report


# --- through the server ------------------------------------------------------------------------


async def _stream(client, values: dict, arrivals: list, done: asyncio.Event, stop: asyncio.Event,
                  errors: list) -> None:
    """One request on its own gRPC stream; `arrivals` gets (monotonic time, tokens) per
    response with tokens. Ends at the final response, or when `stop` is set (cancelled)."""
    from perf.loadgen import make_inputs

    async def request_iterator():
        yield {"model_name": "ensemble", "inputs": make_inputs(values),
               "parameters": {"triton_enable_empty_final_response": True}}
        await stop.wait()

    responses = client.stream_infer(request_iterator())
    try:
        async for result, error in responses:
            if error is not None:
                errors.append(str(error))
                break
            response = result.get_response()
            if response.outputs:
                ids = result.as_numpy("output_ids")
                if ids is not None and ids.size:
                    arrivals.append((time.monotonic(), int(ids.size)))
            if response.parameters["triton_final_response"].bool_param:
                break
    finally:
        done.set()
        stop.set()


async def _server_bursts(url: str, args) -> dict:
    import tritonclient.grpc.aio as aio

    client = aio.InferenceServerClient(url)
    await client.is_server_ready()
    long_tokens = args.server_stream_tokens
    stop_background = asyncio.Event()
    background: list[list] = [[] for _ in range(args.server_streams)]
    errors: list[str] = []
    tasks = [asyncio.create_task(_stream(client, {"text_input": f"Stream {i}: once upon a time", "max_tokens": long_tokens,
                                                  "min_tokens": long_tokens, "stream": True},
                                         background[i], asyncio.Event(), stop_background, errors))
             for i in range(args.server_streams)]
    while not all(background) and not errors:  # every stream decoding
        await asyncio.sleep(0.05)

    def rate(start: float, end: float) -> float:
        tokens = sum(n for arrivals in background for t, n in arrivals if start <= t < end)
        return tokens / (end - start) / len(background)

    # One constrained request first: the server loads the vocabulary for grammars once, on
    # the first one (a one-off cost, not the burst's).
    warm_errors: list[str] = []
    await _stream(client, {"text_input": "Reply in JSON:", "max_tokens": args.server_burst_tokens, "stream": True,
                           "guided_decoding_guide_type": "json_schema",
                           "guided_decoding_guide": json.dumps(burst_schema(args.server_first_schema - 1))},
                  [], asyncio.Event(), asyncio.Event(), warm_errors)
    if warm_errors:
        raise RuntimeError(f"the first constrained request failed: {warm_errors[0]}")
    quiet_start = time.monotonic()
    await asyncio.sleep(args.server_quiet_s)
    report: dict = {"streams": args.server_streams, "burst": args.burst, "burst_max_tokens": args.server_burst_tokens,
                    "quiet_tok_s_per_stream": round(rate(quiet_start, time.monotonic()), 2)}
    for label, with_schemas in (("no_schema", False), ("distinct_schemas", True)):
        dones, burst_errors = [], []
        start = time.monotonic()
        burst_tasks = []
        for index in range(args.burst):
            values = {"text_input": "Reply in JSON:", "max_tokens": args.server_burst_tokens, "stream": True}
            if with_schemas:
                values |= {"guided_decoding_guide_type": "json_schema",
                           "guided_decoding_guide": json.dumps(burst_schema(args.server_first_schema + index))}
            else:
                values["min_tokens"] = args.server_burst_tokens
            done = asyncio.Event()
            dones.append(done)
            burst_tasks.append(asyncio.create_task(_stream(client, values, [], done, asyncio.Event(), burst_errors)))
        await asyncio.gather(*burst_tasks)
        end = time.monotonic()
        report[label] = {"burst_seconds": round(end - start, 3), "errors": len(burst_errors),
                         "stream_tok_s_per_stream": round(rate(start, end), 2)}
        print(f"[server] burst of {args.burst} ({label}): {end - start:.2f} s; the {args.server_streams} long streams "
              f"decode at {report[label]['stream_tok_s_per_stream']} tok/s each (quiet: "
              f"{report['quiet_tok_s_per_stream']})", flush=True)
        if burst_errors:
            raise RuntimeError(f"{len(burst_errors)} burst requests failed, e.g. {burst_errors[0]}")
        if any(task.done() for task in tasks):
            raise RuntimeError("a long stream ended during the bursts: raise --server-stream-tokens")
    stop_background.set()
    await asyncio.gather(*tasks)
    await client.close()
    if errors:
        raise RuntimeError(f"{len(errors)} long streams failed, e.g. {errors[0]}")
    report["ratio"] = round(report["distinct_schemas"]["stream_tok_s_per_stream"]
                            / report["no_schema"]["stream_tok_s_per_stream"], 3)
    report["goal"] = ">= 0.90 (within 10% of the burst without schemas)"
    print(f"[server] the streams' rate beside {args.burst} distinct schemas: {report['ratio']:.3f}x their rate "
          f"beside {args.burst} unconstrained requests (goal >= 0.90)", flush=True)
    return report


def server_main(args) -> dict:
    from perf import servers

    options = servers.server_options(args)
    started = time.perf_counter()
    with servers.serve_profile(Path(args.profile), suffix="guided", options=options, timeout=900) as served:
        report = {"server": {**served.describe(), "start_s": round(time.perf_counter() - started, 1)}}
        print(f"[server] ready in {report['server']['start_s']} s (gRPC {served.server.grpc_url})", flush=True)
        report["server_burst"] = asyncio.run(_server_bursts(served.server.grpc_url, args))
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", default="profiles/llama3-8b-h200.yaml")
    parser.add_argument("--shape", default=None, help="replace the profile's random shape (CPU checks: tiny-llama3)")
    parser.add_argument("--requests", type=int, default=1024)
    parser.add_argument("--isl", type=int, default=128)
    parser.add_argument("--osl", type=int, default=128)
    parser.add_argument("--schemas", type=int, default=64, help="new schemas compiled cold in the compile run")
    parser.add_argument("--burst", type=int, default=200, help="requests of the burst run (0: no burst run)")
    parser.add_argument("--burst-background", type=int, default=64, help="long unconstrained requests beside the burst")
    parser.add_argument("--max-batch-size", type=int, default=1024)
    parser.add_argument("--max-num-tokens", type=int, default=16384)
    parser.add_argument("--mask-threads", default=None,
                        help="comma-separated threads that fill a step's masks together (0: rows one by one); "
                             "the constrained runs repeat for each (default: the engine's, "
                             "inflightllm.guided.compiler.default_mask_threads)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--server", action="store_true", help="the burst through the real tritonserver (only)")
    parser.add_argument("--server-streams", type=int, default=64, help="long unconstrained streams beside the bursts")
    parser.add_argument("--server-stream-tokens", type=int, default=4096)
    parser.add_argument("--server-burst-tokens", type=int, default=16)
    parser.add_argument("--server-quiet-s", type=float, default=3.0, help="seconds measured before any burst")
    parser.add_argument("--server-first-schema", type=int, default=1,
                        help="first burst_schema index (a server that saw them already has them compiled)")
    from perf import servers

    servers.add_server_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    if args.server:
        report = {"profile": args.profile, "date": time.strftime("%Y-%m-%d"), **server_main(args)}
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(report, indent=2))
        return 0
    profile = load_profile(args.profile)
    spec = profile.model if args.shape is None else dataclasses.replace(profile.model, shape=args.shape)
    config = dataclasses.replace(
        profile.engine, max_batch_size=args.max_batch_size, max_num_tokens=args.max_num_tokens,
        max_input_length=max(profile.engine.max_input_length, args.isl),
        max_output_len=max(profile.engine.max_output_len, args.osl * 8))
    started = time.perf_counter()
    engine = Engine(spec, config, sampler_seed=0)
    report: dict = {"profile": args.profile, "shape": spec.shape, "date": time.strftime("%Y-%m-%d"),
                    "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
                    "async_scheduling": config.async_scheduling, "isl": args.isl, "osl": args.osl,
                    "requests": args.requests, "vocab_size": engine.vocab_size}
    # The vocabulary loads once (the first constrained request's cost, reported apart).
    loading = time.perf_counter()
    pool = engine.grammar_compiler()
    try:
        args.mask_threads = ([int(t) for t in args.mask_threads.split(",")] if args.mask_threads
                             else [pool.mask_threads])
    except ValueError:
        raise SystemExit(f"--mask-threads: {args.mask_threads!r} is not a comma-separated list of integers") from None
    pool.mask_threads = args.mask_threads[0]
    report["mask_threads"] = args.mask_threads
    pool.submit(json_schema_spec({"type": "object"})).result()
    report["vocabulary_load_s"] = round(time.perf_counter() - loading, 3)
    schema = json_schema_spec(record_schema(args.osl))
    pool.submit(schema).result()  # compiled once before the runs: they measure the masks
    report["schema_compile_ms"] = round(pool.compile_seconds[-1] * 1000, 2)
    warm = prompts_of(64, 16, engine.vocab_size, seed=1)
    drive(engine, [(f"warm-{i}", p, SamplingParams(max_tokens=8, ignore_eos=True, guided=schema if i % 2 else None))
                   for i, p in enumerate(warm)], osl=8)
    # One unmeasured run of the throughput workload's size first: measured first, the
    # unconstrained run paid the first full-size steps (on an H200 a constrained run then
    # came out at up to 1.09x of it, which it cannot be).
    full = prompts_of(args.requests, args.isl, engine.vocab_size, seed=2)
    drive(engine, [(f"warm-full-{i}", p, SamplingParams(max_tokens=args.osl, ignore_eos=True))
                   for i, p in enumerate(full)], osl=args.osl)
    report["engine_start_s"] = round(time.perf_counter() - started, 1)
    print(json.dumps({k: v for k, v in report.items()}), flush=True)

    def save() -> None:
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(report, indent=2))

    report["throughput"] = throughput_runs(engine, args, schema)
    save()
    report["compile"] = compile_run(engine, args, first_variant=1000)
    save()
    if args.burst:
        report["burst"] = burst_run(engine, args, first_variant=100000)
        save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
