"""Pieces per second through the ensemble: what the response path carries.

Every streamed piece costs a Python-backend response twice (engine, then
postprocessing). This benchmark starts the real tritonserver (perf/servers.py) and
streams requests over gRPC (perf/loadgen.py's inputs) at `stream_interval` 1, over a few
closed-loop concurrencies, and reports per point:
- pieces/s: token-bearing responses per second that the clients received, and tokens/s;
- how many tokens were coalesced (a stream that fell behind gets its pending tokens in one
  response: responses < tokens), and the largest piece;
- a check that every token was delivered: per completed request, the tokens of its pieces
  add up to its `num_output_tokens` and to `max_tokens`, and the concatenated text pieces
  equal the decode of the concatenated `output_ids`;
- postprocessing's average batch per `execute` call (Triton's statistics);
- the client processes' CPU (a share of one core each), so a reader can tell whether the
  client was the limit.

Series (`--series`):
- `dummy`: `profiles/dummy-engine-cpu.yaml`, the engine with no model compute: the
  response path alone;
- `dummy-batched`: the same with a dynamic batcher on postprocessing (a measurement switch
  of perf/servers.py: it loses cancellation relaying, see there), so that `execute` gets
  several pieces and decodes them in one tokenizer call;
- `smollm2`: `profiles/smollm2-cpu.yaml`, the real model: the response path under load.

Each point is bounded by a request count and a time limit (streams still open then are
cancelled and counted incomplete). Output: a table on stdout and
`perf/results/pieces-<tag>-<date>.json` / `.md`. The exit status is 1 when a point lost a token.

    .venv/bin/python -m perf.bench_pieces                 # all series, concurrency 1,16,64,256
    .venv/bin/python -m perf.bench_pieces --series dummy --concurrency 1,16 --max-seconds 5
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import multiprocessing
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from perf.loadgen import RESULTS_DIR, command_line, make_inputs, run_metadata  # noqa: E402


@dataclass(frozen=True)
class Series:
    name: str
    profile: str
    postprocessing_dynamic_batching: bool
    output_len: int  # tokens per request (max_tokens = min_tokens)
    requests_per_stream: int  # requests each concurrent stream sends (count bound)
    max_seconds: float  # time bound of one point
    description: str


SERIES = {
    "dummy": Series("dummy", "profiles/dummy-engine-cpu.yaml", False, 64, 8, 20.0,
                    "dummy engine (no model compute), postprocessing on Triton's default scheduler"),
    "dummy-batched": Series("dummy-batched", "profiles/dummy-engine-cpu.yaml", True, 64, 8, 20.0,
                            "dummy engine, postprocessing behind a dynamic batcher (measurement switch)"),
    "smollm2": Series("smollm2", "profiles/smollm2-cpu.yaml", False, 16, 1, 60.0,
                      "SmolLM2-135M on CPU (the real model), postprocessing on the default scheduler"),
}


# --- the client processes --------------------------------------------------------------------


def _prompt(index: int) -> str:
    return f"Request {index}: write a short story about the number {index * 7919 % 1000}."


async def _stream_one(client, index: int, output_len: int, deadline: float, record: dict) -> None:
    """One streamed request; fills `record` with what arrived."""
    finished = asyncio.Event()
    inputs = {"text_input": _prompt(index), "max_tokens": output_len, "min_tokens": output_len, "stream": True}

    async def request_iterator():
        yield {"model_name": "ensemble", "inputs": make_inputs(inputs), "request_id": str(index),
               "parameters": {"triton_enable_empty_final_response": True}}
        await finished.wait()

    responses = client.stream_infer(request_iterator())
    ids: list[int] = []
    texts: list[bytes] = []

    async def consume():
        async for result, error in responses:
            if error is not None:
                record["error"] = str(error)
                return
            if result.get_response().outputs:
                new = result.as_numpy("output_ids").reshape(-1).tolist()
                if new:
                    record["pieces"] += 1
                    record["max_piece"] = max(record["max_piece"], len(new))
                    ids.extend(new)
                    record["last_time"] = time.time()
                else:
                    record["empty"] += 1
                texts.append(result.as_numpy("text_output").reshape(-1)[0])
                record["num_output_tokens"] = int(result.as_numpy("num_output_tokens").reshape(-1)[0])
            if result.get_response().parameters["triton_final_response"].bool_param:
                record["completed"] = True
                return

    try:
        await asyncio.wait_for(consume(), timeout=max(deadline - time.time(), 0.001))
    except asyncio.TimeoutError:
        record["error"] = "incomplete: the point's time limit passed"
        responses.cancel()
    except Exception as error:  # a transport error fails this request only
        record["error"] = f"{type(error).__name__}: {error}"
        responses.cancel()
    finally:
        finished.set()
    record["tokens"] = len(ids)
    record["ids"] = ids
    record["text"] = b"".join(texts).decode("utf-8", errors="replace")


async def _client_main(url: str, indices: list[int], streams: int, output_len: int, start_at: float,
                       deadline: float) -> list[dict]:
    import tritonclient.grpc.aio as aio

    client = aio.InferenceServerClient(url)
    records: list[dict] = []
    queue = iter(indices)
    await asyncio.sleep(max(start_at - time.time(), 0.0))

    async def worker():
        for index in queue:
            if time.time() >= deadline:
                return
            record = {"index": index, "pieces": 0, "empty": 0, "max_piece": 0, "tokens": 0, "completed": False,
                      "error": None, "num_output_tokens": None, "last_time": None}
            records.append(record)
            await _stream_one(client, index, output_len, deadline, record)

    try:
        await asyncio.gather(*(worker() for _ in range(streams)))
    finally:
        await client.close()
    return records


def _client_process(url, indices, streams, output_len, start_at, deadline, tokenizer_dir, queue) -> None:
    """One client process: its streams, then the delivery check (outside the timed window)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    usage_before = resource.getrusage(resource.RUSAGE_SELF)
    records = asyncio.run(_client_main(url, indices, streams, output_len, start_at, deadline))
    usage_after = resource.getrusage(resource.RUSAGE_SELF)
    cpu_s = (usage_after.ru_utime - usage_before.ru_utime) + (usage_after.ru_stime - usage_before.ru_stime)
    for record in records:
        ids = record.pop("ids")
        text = record.pop("text")
        if record["completed"]:
            expected = tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
            record["delivered"] = (record["tokens"] == record["num_output_tokens"] == output_len
                                   and text == expected)
    queue.put({"records": records, "cpu_s": cpu_s})


def run_point(url: str, concurrency: int, processes: int, series: Series, first_index: int,
              tokenizer_dir: str) -> dict:
    """One closed-loop point over `processes` client processes; the streams are split
    between them."""
    processes = max(1, min(processes, concurrency))
    total = concurrency * series.requests_per_stream
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    start_at = time.time() + 8.0  # every process has imported and loaded its tokenizer by then
    deadline = start_at + series.max_seconds
    workers = []
    for rank in range(processes):
        streams = concurrency // processes + (1 if rank < concurrency % processes else 0)
        indices = list(range(first_index + rank, first_index + total, processes))
        process = context.Process(target=_client_process, args=(url, indices, streams, series.output_len,
                                                                start_at, deadline, tokenizer_dir, queue))
        process.start()
        workers.append(process)
    results = [queue.get(timeout=series.max_seconds + 300) for _ in workers]
    for process in workers:
        process.join(timeout=30)
    records = [record for result in results for record in result["records"]]
    ends = [record["last_time"] for record in records if record["last_time"]]
    window = (max(ends) - start_at) if ends else series.max_seconds
    completed = [record for record in records if record["completed"]]
    pieces = sum(record["pieces"] for record in records)
    tokens = sum(record["tokens"] for record in records)
    return {
        "concurrency": concurrency,
        "client_processes": processes,
        "sent": len(records),
        "completed": len(completed),
        "incomplete_or_failed": len(records) - len(completed),
        "errors": sorted({record["error"] for record in records if record["error"]})[:5],
        "window_s": round(window, 3),
        "pieces": pieces,
        "tokens": tokens,
        "empty_responses": sum(record["empty"] for record in records),
        "pieces_per_s": round(pieces / window, 1),
        "tokens_per_s": round(tokens / window, 1),
        "tokens_coalesced": tokens - pieces,
        "max_tokens_in_one_piece": max((record["max_piece"] for record in records), default=0),
        "all_delivered": bool(completed) and all(record.get("delivered") for record in completed),
        "requests_not_delivered": sum(1 for record in completed if not record.get("delivered")),
        "client_cpu_share_of_one_core": [round(result["cpu_s"] / window, 2) for result in results],
    }


# --- Triton's statistics ---------------------------------------------------------------------


def postprocessing_counts(url: str) -> tuple[int, int]:
    """(inference_count, execution_count) of postprocessing, from Triton's statistics."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url)
    try:
        stats = client.get_inference_statistics(model_name="postprocessing", as_json=True)
    finally:
        client.close()
    model = stats["model_stats"][0]
    return int(model.get("inference_count", 0)), int(model.get("execution_count", 0))


# --- the run --------------------------------------------------------------------------------------


def run_series(series: Series, concurrencies: list[int], processes: int) -> dict:
    from inflightllm.model_source import prepare_tokenizer
    from perf.servers import serve_profile

    points = []
    with serve_profile(REPO_ROOT / series.profile, timeout=600.0,
                       postprocessing_dynamic_batching=series.postprocessing_dynamic_batching) as served:
        spec = served.profile.model
        tokenizer_dir = str(prepare_tokenizer(spec))  # a random shape's folder holds its tokenizer
        url = served.server.grpc_url
        first_index = 0
        for concurrency in concurrencies:
            before = postprocessing_counts(url)
            point = run_point(url, concurrency, 1 if concurrency == 1 else processes, series, first_index,
                              tokenizer_dir)
            after = postprocessing_counts(url)
            executions = after[1] - before[1]
            point["postprocessing_avg_batch"] = round((after[0] - before[0]) / executions, 2) if executions else None
            first_index += point["sent"] + 1000
            points.append(point)
            print(_row(series.name, point), flush=True)
            # Let streams cancelled at the time limit drain before the next point.
            time.sleep(2.0)
        described = served.describe()
    return {"name": series.name, "description": series.description, "server": described,
            "output_len": series.output_len, "requests_per_stream": series.requests_per_stream,
            "max_seconds": series.max_seconds, "points": points}


HEADER = ("| series | concurrency | clients | done | pieces/s | tokens/s | coalesced tokens | max piece | "
          "post. batch | all delivered | client CPU (cores) |\n"
          "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|")


def _row(name: str, point: dict) -> str:
    cpu = " + ".join(f"{share:.2f}" for share in point["client_cpu_share_of_one_core"])
    batch = point["postprocessing_avg_batch"]
    return (f"| {name} | {point['concurrency']} | {point['client_processes']} | "
            f"{point['completed']}/{point['sent']} | {point['pieces_per_s']:,.0f} | {point['tokens_per_s']:,.0f} | "
            f"{point['tokens_coalesced']:,} of {point['tokens']:,} | {point['max_tokens_in_one_piece']} | "
            f"{'—' if batch is None else batch} | {'yes' if point['all_delivered'] else 'NO'} | {cpu} |")


def markdown(result: dict) -> str:
    meta = result["meta"]
    lines = [f"# Pieces per second through the ensemble ({result['tag']})", "",
             f"{meta['date_utc']} UTC, commit `{meta['commit']}`, {meta['machine']}, load average at start "
             f"{meta['load_average_1m_at_start']}", "", f"Command: `{meta['command']}`", ""]
    for series in result["series"]:
        lines.append(f"- `{series['name']}`: {series['description']}; {series['output_len']} tokens per request "
                     f"(stream_interval {series['server']['stream_interval']}), {series['requests_per_stream']} "
                     f"request(s) per stream, at most {series['max_seconds']:g} s per point")
    lines += ["", "pieces/s: token-bearing responses the clients received per second; coalesced tokens: tokens "
              "that arrived in a response with others (tokens − pieces); post. batch: postprocessing's average "
              "requests per execute call; all delivered: per completed request, token count = "
              "num_output_tokens = max_tokens and the text pieces = the decode of the output ids; client CPU: "
              "CPU seconds per window second of each client process.", "", HEADER]
    lines += [_row(series["name"], point) for series in result["series"] for point in series["points"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--series", default="dummy,dummy-batched,smollm2",
                        help=f"comma-separated, of {', '.join(SERIES)}")
    parser.add_argument("--concurrency", default="1,16,64,256")
    parser.add_argument("--client-processes", type=int, default=2,
                        help="client processes for concurrency > 1 (the streams are split between them)")
    parser.add_argument("--max-seconds", type=float, default=None, help="override every series' time bound")
    parser.add_argument("--requests-per-stream", type=int, default=None, help="override every series' count")
    parser.add_argument("--tag", default="cpu", help="names the output: perf/results/pieces-<tag>-<date>.{json,md}")
    parser.add_argument("--date", default=datetime.datetime.now(datetime.timezone.utc).date().isoformat())
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    names = [name.strip() for name in args.series.split(",") if name.strip()]
    unknown = [name for name in names if name not in SERIES]
    if unknown:
        parser.error(f"--series: unknown {', '.join(unknown)}; known: {', '.join(SERIES)}")
    concurrencies = [int(value) for value in args.concurrency.split(",") if value.strip()]
    if not concurrencies or min(concurrencies) < 1:
        parser.error("--concurrency: positive integers, e.g. 1,16,64,256")
    result = {"tag": args.tag, "meta": run_metadata(command_line("perf.bench_pieces", argv)), "series": []}
    print(HEADER, flush=True)
    for name in names:
        series = SERIES[name]
        changes = {}
        if args.max_seconds is not None:
            changes["max_seconds"] = args.max_seconds
        if args.requests_per_stream is not None:
            changes["requests_per_stream"] = args.requests_per_stream
        series = Series(**{**series.__dict__, **changes})
        result["series"].append(run_series(series, concurrencies, args.client_processes))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    out = args.out_dir / f"pieces-{args.tag}-{args.date}"
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(result))
    print(f"wrote {out}.json and {out}.md")
    failed = [point for series in result["series"] for point in series["points"] if not point["all_delivered"]]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
