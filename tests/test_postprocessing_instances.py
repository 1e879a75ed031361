"""Several postprocessing instances (`instances.postprocessing: 4`) in a real tritonserver, with
the dummy engine (profiles/dummy-engine-cpu.yaml: deterministic tokens, every step at once, so
the streams' pieces crowd postprocessing). Postprocessing is then decoupled and marks each
piece's ticket after sending it on; the engine keeps one piece of a stream in flight. Each
stream's pieces must arrive in order, and a cancellation must still reach the engine."""

from __future__ import annotations

import pytest
import yaml

from inflightllm.profile import REPO_ROOT, load_profile
from tests.ensemble_client import (
    cancel_after_pieces,
    metric,
    run_stream_requests,
    scrape_metrics,
    wait_for,
)
from tools import render_configs

pytestmark = pytest.mark.server

INSTANCES = 4
PROMPTS = [f"Request {index}: tell me about the number {index * 7919 % 1000}." for index in range(32)]


@pytest.fixture(scope="module")
def server(triton_server_factory, tmp_path_factory):
    folder = tmp_path_factory.mktemp("postprocessing-instances")
    data = yaml.safe_load((REPO_ROOT / "profiles" / "dummy-engine-cpu.yaml").read_text())
    data["name"] = "dummy-engine-cpu-postprocessing-4"
    data["instances"]["postprocessing"] = INSTANCES
    profile_path = folder / "profile.yaml"
    profile_path.write_text(yaml.safe_dump(data, sort_keys=False))
    profile = load_profile(profile_path)
    repository = folder / "repo"
    render_configs.render(profile, repository)
    config = (repository / "postprocessing" / "config.pbtxt").read_text()
    assert f"count: {INSTANCES}\n" in config and "decoupled: true" in config
    return triton_server_factory(repository, timeout=600.0)


def ids_of(result) -> list[list[int]]:
    return [response.as_numpy("output_ids").reshape(-1).tolist() for response in result.responses
            if response.as_numpy("output_ids") is not None and response.as_numpy("output_ids").size]


def test_each_stream_s_pieces_arrive_in_order(server):
    requests = [{"text_input": prompt, "max_tokens": 128, "min_tokens": 128, "stream": stream, "exclude_input_in_output": True}
                for stream in (False, True) for prompt in PROMPTS]
    results = run_stream_requests(server.grpc_url, requests, num_streams=4, timeout=300.0)
    whole, streamed = results[:len(PROMPTS)], results[len(PROMPTS):]
    pieces = 0
    for prompt, one, many in zip(PROMPTS, whole, streamed, strict=True):
        assert one.error is None and many.error is None, (one.error, many.error)
        expected = [token for piece in ids_of(one) for token in piece]
        assert len(expected) == 128
        got = ids_of(many)
        pieces += len(got)
        # The dummy engine's tokens depend on the prompt alone: a piece out of order shows here.
        assert [token for piece in got for token in piece] == expected, prompt
        assert many.text == one.text
    assert pieces > len(PROMPTS)  # streamed in several pieces each, not one
    # Every piece's ticket was marked: none waited for the write-off (ResponseSender).
    assert "unanswered by postprocessing" not in server.log_text()


def test_a_cancelled_stream_still_reaches_the_engine(server):
    before = metric(scrape_metrics(server.metrics_url), "inflightllm_request_finished_total", finish_reason="cancelled")
    request = {"text_input": "A long one.", "max_tokens": 1000, "min_tokens": 1000, "stream": True}
    cancel_after_pieces(server.grpc_url, request)

    def freed():
        values = scrape_metrics(server.metrics_url)
        return (metric(values, "inflightllm_kv_cache_blocks", state="used") == 0
                and metric(values, "inflightllm_request_finished_total", finish_reason="cancelled") == before + 1)

    assert wait_for(freed, timeout=30), scrape_metrics(server.metrics_url)
