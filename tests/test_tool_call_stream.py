"""Streaming tool calls without a model: `ToolCallStream` (tool_choice required: each call's
id and name once its name is complete, then its arguments as they grow) and the auto
mode's splitter (content until a call may begin, then held), fed every way of cutting
an output into pieces."""

from __future__ import annotations

import itertools
import json

import pytest

from inflightllm.guided.tools import ToolCallStream
from inflightllm.openai_frontend.app import _AutoToolText

ONE = '{"name":"get_weather","arguments":{"city":"Pa\\\\ris \\"x\\"","unit":"celsius","n":[1,{"a":"}"}]}}'
LIST = '[{"name":"get_weather","arguments":{"city":"Paris","unit":"celsius"}},{"name":"get_time","arguments":{}}]'


def cuts(text: str, size: int) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


def fed(pieces: list[str]) -> list[dict]:
    ids = itertools.count()
    stream = ToolCallStream(lambda: f"call-{next(ids)}")
    return [delta for piece in pieces for delta in stream.feed(piece)]


@pytest.mark.parametrize("size", [1, 2, 3, 5, 8, 1000])
@pytest.mark.parametrize("text, expected", [
    (ONE, [("get_weather", '{"city":"Pa\\\\ris \\"x\\"","unit":"celsius","n":[1,{"a":"}"}]}')]),
    (LIST, [("get_weather", '{"city":"Paris","unit":"celsius"}'), ("get_time", "{}")]),
])
def test_calls_stream_whatever_the_cuts(text, expected, size):
    deltas = fed(cuts(text, size))
    calls: dict[int, list] = {}
    for delta in deltas:
        if delta["index"] not in calls:
            assert delta == {"index": delta["index"], "id": f"call-{len(calls)}", "type": "function",
                             "function": {"name": expected[len(calls)][0], "arguments": ""}}
            calls[delta["index"]] = [delta["function"]["name"], ""]
        else:
            assert set(delta) == {"index", "function"} and set(delta["function"]) == {"arguments"}
            assert delta["function"]["arguments"]
            calls[delta["index"]][1] += delta["function"]["arguments"]
    assert [tuple(calls[i]) for i in sorted(calls)] == expected
    for _, arguments in expected:
        json.loads(arguments)


def test_arguments_stream_before_the_call_is_complete():
    ids = itertools.count()
    stream = ToolCallStream(lambda: f"call-{next(ids)}")
    assert stream.feed('{"name":"get_w') == []  # the name is not complete yet
    assert stream.feed('eather","argu') == [{"index": 0, "id": "call-0", "type": "function",
                                              "function": {"name": "get_weather", "arguments": ""}}]
    assert stream.feed('ments":{"ci') == [{"index": 0, "function": {"arguments": '{"ci'}}]
    assert stream.feed('ty":"P"') == [{"index": 0, "function": {"arguments": 'ty":"P"'}}]
    assert stream.feed('}}') == [{"index": 0, "function": {"arguments": "}"}}]  # not the call's own brace
    assert stream.feed("") == []


def test_a_cut_output_streams_what_it_has():
    deltas = fed([LIST[:40]])
    assert [d["function"].get("name") for d in deltas] == ["get_weather", None]
    assert deltas[1]["function"]["arguments"] == LIST[35:40]


def auto(pieces: list[str]) -> tuple[str, str]:
    splitter = _AutoToolText()
    content = "".join(splitter.feed(piece) for piece in pieces)
    return content, splitter.held


@pytest.mark.parametrize("size", [1, 2, 4, 100])
def test_auto_streams_content_and_holds_from_a_marker(size):
    text = 'Let me check < that. <tool_call>{"name":"get_time","arguments":{}}</tool_call>'
    content, held = auto(cuts(text, size))
    assert (content, held) == ("Let me check < that. ", '<tool_call>{"name":"get_time","arguments":{}}</tool_call>')
    assert auto(cuts("Plain text, <b>no</b> call.", size)) == ("Plain text, <b>no</b> call.", "")


@pytest.mark.parametrize("text", [' {"name":"get_time","arguments":{}}', '[{"name":"x"}]', "<tool_call>"])
def test_auto_holds_an_output_that_may_be_a_call_from_its_start(text):
    for size in (1, 3, 100):
        assert auto(cuts(text, size)) == ("", text)


def test_auto_keeps_back_only_a_possible_marker_prefix():
    assert auto(["Hello <tool"]) == ("Hello ", "<tool")
    assert auto(["Hello <tool", "box>"]) == ("Hello <toolbox>", "")
