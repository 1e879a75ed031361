"""Smoke test of perf/bench_pieces.py against real servers, tiny counts: every token of
every streamed request arrives (the pieces' tokens add up to num_output_tokens and
max_tokens, and the text pieces concatenate to the decode of the output ids). No timing
is asserted.

- SmolLM2 through the shared `model_repo_server` (the default ensemble, postprocessing
  on Triton's default scheduler);
- the dummy engine (`profiles/dummy-engine-cpu.yaml`) with postprocessing behind a
  dynamic batcher (perf/servers.py's measurement switch), so the batched decode runs in
  the real server: its streams fall behind and get coalesced pieces.
"""

from __future__ import annotations

import pytest

from inflightllm.model_source import DEFAULT_MODEL, prepare_tokenizer
from inflightllm.profile import REPO_ROOT, load_profile
from perf.bench_pieces import SERIES, Series, postprocessing_counts, run_point
from perf.servers import enable_postprocessing_dynamic_batching
from tools import render_configs

pytestmark = [pytest.mark.server, pytest.mark.slow]


def tiny(name: str, output_len: int, requests_per_stream: int) -> Series:
    series = SERIES[name]
    return Series(**{**series.__dict__, "output_len": output_len, "requests_per_stream": requests_per_stream,
                     "max_seconds": 240.0})


def check_point(point: dict, concurrency: int, series: Series) -> None:
    sent = concurrency * series.requests_per_stream
    assert point["errors"] == []
    assert (point["sent"], point["completed"]) == (sent, sent)
    assert point["tokens"] == sent * series.output_len
    assert point["requests_not_delivered"] == 0 and point["all_delivered"] is True
    assert point["pieces"] + point["tokens_coalesced"] == point["tokens"]


def test_every_token_arrives_through_the_default_ensemble(model_repo_server):
    series = tiny("smollm2", output_len=6, requests_per_stream=1)
    tokenizer_dir = str(prepare_tokenizer(DEFAULT_MODEL))
    point = run_point(model_repo_server.grpc_url, 3, 2, series, 0, tokenizer_dir)
    check_point(point, 3, series)
    assert point["client_processes"] == 2


@pytest.fixture(scope="module")
def dummy_batched_server(triton_server_factory, tmp_path_factory):
    profile = load_profile(REPO_ROOT / "profiles" / "dummy-engine-cpu.yaml")
    repository = tmp_path_factory.mktemp("dummy-batched-repo")
    render_configs.render(profile, repository)
    enable_postprocessing_dynamic_batching(repository)
    return triton_server_factory(repository, timeout=600.0)


def test_every_token_arrives_from_the_dummy_engine_through_batched_postprocessing(dummy_batched_server):
    series = tiny("dummy-batched", output_len=48, requests_per_stream=2)
    tokenizer_dir = str(prepare_tokenizer(DEFAULT_MODEL))
    before = postprocessing_counts(dummy_batched_server.grpc_url)
    point = run_point(dummy_batched_server.grpc_url, 8, 2, series, 0, tokenizer_dir)
    after = postprocessing_counts(dummy_batched_server.grpc_url)
    check_point(point, 8, series)
    # Every token-bearing response went through postprocessing (plus empty final ones).
    assert after[0] - before[0] >= point["pieces"]
