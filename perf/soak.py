"""Soak run: many requests of random lengths through the real server, some cancelled.

    OMP_NUM_THREADS=1 .venv/bin/python perf/soak.py --requests 5000 --concurrency 64 --cancel-fraction 0.2

Starts a tritonserver on the committed `model_repo/` (free loopback ports), then
`--concurrency` client threads each send one streaming gRPC request at a time through the
ensemble, chosen at random from a pool of prompts of random lengths (short and long,
some sharing prefixes) with a random `max_tokens`; about `--cancel-fraction` of them are
cancelled by the client after their first few pieces. Checks and prints:
- every completed request is correct: its text equals the engine's offline greedy output
  (the same engine run in this process, without Triton) for its prompt and max_tokens;
- after the drain every KV block is free and the queues are empty (engine metrics);
- the resident memory of tritonserver and its stubs after the run vs after warm-up.
Exits 1 if a check fails. Figures go to stdout and to perf/results/soak-<date>.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import sys
import threading
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

import tritonclient.grpc as grpcclient  # noqa: E402

from inflightllm.config import EngineConfig  # noqa: E402
from inflightllm.engine import Engine  # noqa: E402
from inflightllm.model_source import DEFAULT_MODEL, load_tokenizer, prepare  # noqa: E402
from inflightllm.sampling_params import SamplingParams  # noqa: E402
from tests.ensemble_client import make_inputs, metric, scrape_metrics, wait_for  # noqa: E402
from tools.server_launcher import TritonServer  # noqa: E402

WORDS = ("the cat sat on a mat while river stones glowed under seven quiet lanterns of autumn "
         "and merchants counted copper coins beside old harbour walls near the northern lighthouse").split()


def prompt_pool(rng: random.Random, size: int) -> list[str]:
    """Prompts of random lengths (3 to ~300 words); a third extend an earlier prompt."""
    pool: list[str] = []
    for _ in range(size):
        words = [rng.choice(WORDS) for _ in range(int(rng.choice([3, 8, 20, 60, 150, 300]) * rng.uniform(0.5, 1.0)))]
        if pool and rng.random() < 0.33:
            pool.append(rng.choice(pool) + " " + " ".join(words[:10]))
        else:
            pool.append(" ".join(words))
    return pool


def offline_outputs(tokenizer, pool: list[str], max_tokens: int) -> list[list[int]]:
    """Greedy output ids of each prompt from the engine itself (no Triton), up to max_tokens."""
    engine = Engine(DEFAULT_MODEL, EngineConfig(num_kv_blocks=4096, max_batch_size=64))
    for index, prompt in enumerate(pool):
        engine.add_request(str(index), tokenizer.encode(prompt), SamplingParams(max_tokens=max_tokens))
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for output in engine.step():
            outputs.setdefault(output.request_id, []).extend(output.new_token_ids)
    return [outputs[str(index)] for index in range(len(pool))]


def server_rss_kib(repository: Path) -> int:
    """Resident memory of every process whose command line names the repository."""
    total = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if str(repository) not in (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                continue
            for line in (entry / "status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            continue
    return total


class Client:
    """One concurrent client: one gRPC stream per request, cancelled after `cancel_after` pieces."""

    def __init__(self, url: str):
        self.client = grpcclient.InferenceServerClient(url)

    def run(self, request: dict, cancel_after: int | None, timeout: float = 600.0) -> dict:
        pieces: list[str] = []
        state = {"error": None, "finish_reason": "", "final": False}
        done = threading.Event()
        enough = threading.Event()

        def callback(result=None, error=None):
            if error is not None:
                state["error"] = str(error)
                done.set()
                return
            text = result.as_numpy("text_output")
            if text is not None:
                pieces.append(text.reshape(-1)[0].decode("utf-8"))
                if cancel_after is not None and len(pieces) >= cancel_after:
                    enough.set()
            reason = result.as_numpy("finish_reason")
            if reason is not None and reason.reshape(-1)[0]:
                state["finish_reason"] = reason.reshape(-1)[0].decode()
            if result.get_response().parameters["triton_final_response"].bool_param:
                state["final"] = True
                done.set()

        self.client.start_stream(callback=callback)
        self.client.async_stream_infer("ensemble", make_inputs(request), enable_empty_final_response=True)
        cancelled = False
        if cancel_after is not None:
            while not done.is_set() and not enough.wait(0.05):
                pass
            if not done.is_set():
                cancelled = True
        else:
            done.wait(timeout)
        self.client.stop_stream(cancel_requests=cancelled)
        return {"text": "".join(pieces), "cancelled": cancelled, **state}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--cancel-fraction", type=float, default=0.2)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--prompts", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    prepare(DEFAULT_MODEL)
    tokenizer = load_tokenizer(DEFAULT_MODEL)
    pool = prompt_pool(rng, args.prompts)
    started = time.monotonic()
    reference = offline_outputs(tokenizer, pool, args.max_tokens)
    print(f"offline references of {len(pool)} prompts in {time.monotonic() - started:.0f} s", flush=True)
    plan = [(rng.randrange(len(pool)), rng.randint(1, args.max_tokens),
             rng.randint(1, 3) if rng.random() < args.cancel_fraction else None) for _ in range(args.requests)]

    repository = REPO_ROOT / "model_repo"
    server = TritonServer(repository)
    server.start(timeout=600)
    try:
        warm = Client(server.grpc_url).run({"text_input": pool[0], "max_tokens": 4, "stream": True}, None)
        assert warm["error"] is None, warm
        rss_start = server_rss_kib(repository)
        results: list[dict | None] = [None] * len(plan)
        next_index = iter(range(len(plan)))
        lock = threading.Lock()

        def worker():
            client = Client(server.grpc_url)
            while True:
                with lock:
                    index = next(next_index, None)
                if index is None:
                    return
                prompt_index, max_tokens, cancel_after = plan[index]
                request = {"text_input": pool[prompt_index], "max_tokens": max_tokens, "stream": True}
                results[index] = client.run(request, cancel_after)

        started = time.monotonic()
        threads = [threading.Thread(target=worker) for _ in range(args.concurrency)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        elapsed = time.monotonic() - started

        def drained():
            values = scrape_metrics(server.metrics_url)
            return (metric(values, "inflightllm_kv_cache_blocks", state="used") == 0
                    and metric(values, "inflightllm_requests", state="running") == 0
                    and metric(values, "inflightllm_requests", state="waiting") == 0)

        is_drained = bool(wait_for(drained, timeout=120))
        values = scrape_metrics(server.metrics_url)
        rss_end = server_rss_kib(repository)
    finally:
        server.stop()

    completed = wrong = errors = cancelled = 0
    examples = []
    for (prompt_index, max_tokens, _), result in zip(plan, results):
        if result["cancelled"]:  # the client's own cancel ends its stream with a local CANCELLED error
            cancelled += 1
            continue
        if result["error"] is not None:
            errors += 1
            examples.append(result["error"])
            continue
        completed += 1
        expected = tokenizer.decode(reference[prompt_index][:max_tokens], skip_special_tokens=True)
        if result["text"] != expected:
            wrong += 1
            examples.append(f"prompt {prompt_index} max_tokens {max_tokens}: {result['text']!r} != {expected!r}")
    figures = {
        "date": datetime.date.today().isoformat(),
        "command": " ".join(sys.argv),
        "requests": len(plan),
        "concurrency": args.concurrency,
        "completed": completed,
        "completed_wrong": wrong,
        "cancelled_by_client": cancelled,
        "errors": errors,
        "elapsed_s": round(elapsed, 1),
        "requests_per_s": round(len(plan) / elapsed, 2),
        "drained_blocks_free_queues_empty": is_drained,
        "kv_blocks_used_after": metric(values, "inflightllm_kv_cache_blocks", state="used"),
        "finished_cancelled_metric": metric(values, "inflightllm_request_finished_total", finish_reason="cancelled"),
        "server_rss_mib_after_warmup": round(rss_start / 1024, 1),
        "server_rss_mib_after_run": round(rss_end / 1024, 1),
        "server_rss_growth_mib": round((rss_end - rss_start) / 1024, 1),
    }
    print(json.dumps(figures, indent=2))
    for example in examples[:5]:
        print("  ", example)
    out = REPO_ROOT / "perf" / "results" / f"soak-{figures['date']}.json"
    out.write_text(json.dumps(figures, indent=2) + "\n")
    ok = wrong == 0 and errors == 0 and is_drained
    print("soak", "passed" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
