"""The client CLI (`python -m inflightllm.client`), its library function and the demo.

Server tests use the shared `model_repo_server` (the whole default ensemble); the demo
test starts its own server (marked slow).
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from inflightllm.client import (
    GenerationStats,
    GenerationTimeoutError,
    RequestRejectedError,
    ServerUnavailableError,
    build_inputs,
    chat_messages,
    stream_generate,
)
from tools.server_launcher import free_port

REPO_ROOT = Path(__file__).resolve().parent.parent
QUESTION = "What is the capital of France?"
ANSWER = "The capital of France is Paris."  # SmolLM2-135M-Instruct's greedy answer (7 tokens)
STATS_LINE = re.compile(
    r"^\[stats\] TTFT (?P<ttft>[\d.]+) ms \| output tokens (?P<tokens>\d+) \(input \d+, cached \d+\)"
    r" \| decode (?:[\d.]+ tok/s|n/a) \| overall [\d.]+ tok/s \| total [\d.]+ ms"
    r" \| finish_reason (?P<reason>\w+)$",
    re.MULTILINE,
)


def run_cli(*args: str, timeout: float = 120.0) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run(
        [sys.executable, "-m", "inflightllm.client", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO_ROOT,
        env=env,
    )


# ---------------------------------------------------------------- no server


def test_build_inputs_shapes_types_and_defaults():
    inputs = build_inputs(
        messages=chat_messages("Hi 😀", system="Be brief."),
        max_tokens=9,
        stop=["Paris", "."],
        temperature=0.5,
        seed=2**64 - 1,
        top_k=None,  # None: left out, the server's default applies
    )
    by_name = {tensor.name(): tensor for tensor in inputs}
    assert list(by_name) == [
        "messages", "max_tokens", "stream", "exclude_input_in_output", "stop_words", "temperature", "seed"
    ]
    assert {name: (t.datatype(), t.shape()) for name, t in by_name.items()} == {
        "messages": ("BYTES", [1, 1]),
        "max_tokens": ("INT32", [1, 1]),
        "stream": ("BOOL", [1, 1]),
        "exclude_input_in_output": ("BOOL", [1, 1]),
        "stop_words": ("BYTES", [1, 2]),
        "temperature": ("FP32", [1, 1]),
        "seed": ("UINT64", [1, 1]),
    }
    assert chat_messages("Hi 😀", system="Be brief.") == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi 😀"},
    ]
    with pytest.raises(ValueError, match="exactly one of prompt and messages"):
        build_inputs("a", messages=chat_messages("b"))
    with pytest.raises(ValueError, match="unknown input 'temprature'"):
        build_inputs("a", temprature=1.0)


def test_generation_stats_rates_and_line():
    stats = GenerationStats(
        text="x", finish_reason="length", num_input_tokens=5, num_output_tokens=11, num_cached_tokens=0,
        num_responses=11, first_token_s=0.5, first_token_count=1, total_s=2.5,
    )
    assert stats.ttft_ms == 500.0
    assert stats.decode_tokens_per_s == 5.0  # 10 tokens after the first, in 2 s
    assert stats.overall_tokens_per_s == 4.4  # 11 tokens in 2.5 s
    line = stats.summary_line()
    assert line == (
        "[stats] TTFT 500.0 ms | output tokens 11 (input 5, cached 0) | decode 5.0 tok/s"
        " | overall 4.4 tok/s | total 2500.0 ms | finish_reason length"
    )
    assert STATS_LINE.search(line)
    one_response = GenerationStats("x", "stop", 5, 7, 0, 1, 0.7, 7, 0.7)
    assert one_response.decode_tokens_per_s is None  # nothing after the first response
    assert "decode n/a" in one_response.summary_line()


def test_cli_wrong_url_exits_2_with_a_clear_message():
    url = f"127.0.0.1:{free_port()}"  # nothing listens there
    result = run_cli("--chat", QUESTION, "--url", url, timeout=60)
    assert result.returncode == 2, result
    assert result.stdout == ""
    assert f"cannot reach the server at {url}" in result.stderr
    with pytest.raises(ServerUnavailableError):
        stream_generate(url, "hi", max_tokens=1)


def test_cli_usage_errors():
    result = run_cli("--system", "Be brief.", "hi")
    assert result.returncode == 2 and "--system needs --chat" in result.stderr
    result = run_cli("--max-tokens", "0", "hi")
    assert result.returncode == 2 and "--max-tokens" in result.stderr


class _SilentServer:
    """A gRPC server that says it is live and then never answers a streamed request, as a
    server busy generating would; it records whether the client cancelled the stream."""

    def __init__(self, hold_s: float = 20.0):
        import threading
        from concurrent import futures

        import grpc
        from tritonclient.grpc import service_pb2, service_pb2_grpc

        self.requests_seen = threading.Event()
        self.cancelled_by_client = threading.Event()
        outer = self

        class Servicer(service_pb2_grpc.GRPCInferenceServiceServicer):
            def ServerLive(self, request, context):
                return service_pb2.ServerLiveResponse(live=True)

            def ModelStreamInfer(self, request_iterator, context):
                deadline = time.monotonic() + hold_s
                try:
                    for _request in request_iterator:
                        outer.requests_seen.set()
                except Exception:  # the client cancelled while we were reading
                    pass
                # Keep the stream open (responses "pending") until the client cancels it.
                while context.is_active() and time.monotonic() < deadline:
                    time.sleep(0.02)
                if not context.is_active():
                    outer.cancelled_by_client.set()
                return iter(())

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(Servicer(), self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def stop(self):
        self.server.stop(grace=None)


def test_timeout_cancels_the_request_and_exits_3():
    # A fake server, not the real one: cancelling a streaming ensemble request leaves
    # Triton 2.51 counting an in-flight inference, which delays the shared server's
    # shutdown by its whole exit timeout (docs/CLIENTS.md).
    silent = _SilentServer()
    try:
        url = f"127.0.0.1:{silent.port}"
        with pytest.raises(GenerationTimeoutError, match="within 0.3 s"):
            stream_generate(url, messages=chat_messages(QUESTION), max_tokens=8, timeout=0.3)
        assert silent.requests_seen.is_set()
        assert silent.cancelled_by_client.wait(10)  # it did not wait for the pending responses
        result = run_cli("--chat", QUESTION, "--url", url, "--timeout", "0.3", timeout=60)
        assert result.returncode == 3, result
        assert result.stdout == ""
        assert f"error: no complete answer from {url} within 0.3 s (request cancelled)" in result.stderr
    finally:
        silent.stop()


# ---------------------------------------------------------------- against the server


@pytest.mark.server
def test_cli_streams_the_greedy_answer_and_prints_stats(model_repo_server):
    result = run_cli("--chat", QUESTION, "--max-tokens", "32", "--url", model_repo_server.grpc_url)
    assert result.returncode == 0, result.stderr
    assert result.stdout == ANSWER + "\n"
    match = STATS_LINE.search(result.stderr)
    assert match, result.stderr
    assert (match["tokens"], match["reason"]) == ("7", "stop")
    assert float(match["ttft"]) > 0


@pytest.mark.server
def test_cli_no_stream_gives_the_same_text(model_repo_server):
    result = run_cli("--chat", QUESTION, "--max-tokens", "32", "--no-stream", "--url", model_repo_server.grpc_url)
    assert result.returncode == 0, result.stderr
    assert result.stdout == ANSWER + "\n"
    match = STATS_LINE.search(result.stderr)
    assert match and (match["tokens"], match["reason"]) == ("7", "stop"), result.stderr


@pytest.mark.server
def test_cli_reports_the_servers_rejection_with_exit_1(model_repo_server):
    result = run_cli("--chat", QUESTION, "--temperature", "-1", "--url", model_repo_server.grpc_url)
    assert result.returncode == 1, result
    assert result.stdout == ""
    assert "error: in ensemble 'ensemble', input 'temperature': -1.0 is out of range" in result.stderr
    assert "[stats]" not in result.stderr


@pytest.mark.server
def test_cli_stop_word_and_max_tokens(model_repo_server):
    url = model_repo_server.grpc_url
    result = run_cli("--chat", QUESTION, "--stop", "Paris", "--stop", "Rome", "--url", url)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "The capital of France is\n"
    assert STATS_LINE.search(result.stderr)["reason"] == "stop"
    result = run_cli("--chat", QUESTION, "--max-tokens", "3", "--url", url)
    assert result.stdout == "The capital of\n"
    assert STATS_LINE.search(result.stderr)["reason"] == "length"


@pytest.mark.server
def test_stream_generate_pieces_and_counts(model_repo_server):
    pieces: list[str] = []
    stats = stream_generate(
        model_repo_server.grpc_url, messages=chat_messages(QUESTION), max_tokens=32, on_text=pieces.append
    )
    assert pieces == ["The", " capital", " of", " France", " is", " Paris", "."]
    assert stats.text == ANSWER
    assert (stats.finish_reason, stats.num_output_tokens, stats.first_token_count) == ("stop", 7, 1)
    assert stats.num_responses == 8  # one per token, then the final empty one with finish_reason
    assert stats.num_input_tokens == 37
    assert 0 < stats.first_token_s <= stats.total_s

    pieces.clear()
    single = stream_generate(
        model_repo_server.grpc_url, messages=chat_messages(QUESTION), max_tokens=32, stream=False,
        on_text=pieces.append,
    )
    assert pieces == [ANSWER]
    assert (single.text, single.num_responses, single.num_output_tokens) == (ANSWER, 1, 7)


@pytest.mark.server
def test_stream_generate_seed_makes_sampling_repeatable(model_repo_server):
    def sample(seed: int) -> str:
        return stream_generate(
            model_repo_server.grpc_url, messages=chat_messages("Tell me a story."), max_tokens=16,
            temperature=1.0, seed=seed,
        ).text

    assert sample(7) == sample(7)
    assert {sample(seed) for seed in (1, 2, 3)} != {sample(7)}


@pytest.mark.server
def test_stream_generate_raises_the_servers_message(model_repo_server):
    with pytest.raises(RequestRejectedError, match=r"input 'max_tokens': 5000 is out of range"):
        stream_generate(model_repo_server.grpc_url, "hi", max_tokens=5000)
    with pytest.raises(RequestRejectedError, match="unknown model"):
        stream_generate(model_repo_server.grpc_url, "hi", max_tokens=4, model="no_such_model")


# ---------------------------------------------------------------- demo (its own server)


@pytest.mark.server
@pytest.mark.slow
def test_demo_answers_and_stops_its_server():
    if not (REPO_ROOT / "build" / "tritonserver" / "bin" / "tritonserver").exists():
        pytest.skip("build/tritonserver is missing: run `make install`")
    result = subprocess.run(
        [sys.executable, "tools/demo.py", "--profile", "profiles/smollm2-cpu.yaml"],
        capture_output=True, text=True, timeout=900, cwd=REPO_ROOT,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"assistant: {ANSWER}\n" in result.stdout
    assert STATS_LINE.search(result.stdout)["reason"] == "stop"
    assert result.stdout.rstrip().endswith("stopping tritonserver")
    grpc_port = int(re.search(r"gRPC 127\.0\.0\.1:(\d+)", result.stdout)[1])
    with socket.socket() as sock:  # the server is gone: nothing listens on its port
        assert sock.connect_ex(("127.0.0.1", grpc_port)) != 0



def test_demo_picks_model_repo_for_the_default_profile_and_renders_others(tmp_path):
    from inflightllm.profile import load_profile
    from tools.serve import repository_for

    assert repository_for(load_profile(REPO_ROOT / "profiles" / "smollm2-cpu.yaml"), tmp_path) == REPO_ROOT / "model_repo"
    assert list(tmp_path.iterdir()) == []
    rendered = repository_for(load_profile(REPO_ROOT / "profiles" / "llama3-8b-h200.yaml"), tmp_path)
    assert rendered == tmp_path / "model_repo-llama3-8b-h200"
    for model in ("ensemble", "preprocessing", "engine", "postprocessing"):
        assert (rendered / model / "config.pbtxt").is_file(), model
    assert "llama3-8b-h200.yaml" in (rendered / "engine" / "config.pbtxt").read_text()


def test_serve_refuses_a_gpu_profile_before_starting_triton_on_a_machine_without_cuda():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    result = subprocess.run(
        [sys.executable, "tools/serve.py", "--profile", "profiles/llama3-8b-h200.yaml", "--http-port", "1"],
        capture_output=True, text=True, timeout=120, cwd=REPO_ROOT,
    )
    assert result.returncode == 2, result
    assert result.stderr.strip().endswith(
        "profiles/llama3-8b-h200.yaml: device.kind: 'gpu' needs CUDA, and this machine has none "
        "(torch.cuda.is_available() is False); serve a cpu profile here (e.g. profiles/smollm2-cpu.yaml)"
    )
    assert "starting tritonserver" not in result.stdout


def test_serve_warns_when_listening_beyond_loopback():
    from tools.serve_openai import loopback_warning

    assert loopback_warning("127.0.0.1", "x") is None and loopback_warning("localhost", "x") is None
    assert loopback_warning("0.0.0.0", "tritonserver").startswith(
        "warning: tritonserver listens on 0.0.0.0: anyone who can reach this address can use it")
