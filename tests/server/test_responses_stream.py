"""The Responses output builder without a server: reasoning, text and two calls fed the way
the chat output parser splits a real output, the exact event sequence they make, and the
final items a non-streaming answer gets from the same deltas."""

from __future__ import annotations

import json

from jaxpaged.server.chat_output import ChoiceDelta
from jaxpaged.server.responses_stream import EventCounter, OutputBuilder
from jaxpaged.server.tool_parsers import ToolCallDelta

DELTAS = [ChoiceDelta(reasoning="think "), ChoiceDelta(reasoning="hard"),
          ChoiceDelta(content="Call"), ChoiceDelta(content="ing.", calls=[
              ToolCallDelta(0, "call_a", "f", '{"x": '), ToolCallDelta(0, None, None, "1}")]),
          ChoiceDelta(calls=[ToolCallDelta(1, "call_b", "g", "{}")])]


def test_events_and_items_of_reasoning_text_and_calls():
    builder = OutputBuilder()
    events = [e for d in DELTAS for e in builder.add(d)] + builder.finish("completed")
    assert [(e["type"].removeprefix("response."), e["output_index"]) for e in events] == [
        ("output_item.added", 0), ("content_part.added", 0), ("reasoning_text.delta", 0),
        ("reasoning_text.delta", 0), ("reasoning_text.done", 0), ("content_part.done", 0),
        ("output_item.done", 0),
        ("output_item.added", 1), ("content_part.added", 1), ("output_text.delta", 1),
        ("output_text.delta", 1), ("output_text.done", 1), ("content_part.done", 1),
        ("output_item.done", 1),
        ("output_item.added", 2), ("function_call_arguments.delta", 2),
        ("function_call_arguments.delta", 2), ("function_call_arguments.done", 2),
        ("output_item.done", 2),
        ("output_item.added", 3), ("function_call_arguments.delta", 3),
        ("function_call_arguments.done", 3), ("output_item.done", 3)]
    assert events[0]["item"]["content"] == [] and events[0]["item"]["status"] == "in_progress"
    assert events[4]["text"] == "think hard" and events[11]["text"] == "Calling."
    assert events[17]["arguments"] == '{"x": 1}' and events[17]["name"] == "f"
    items = [i.model_dump() for i in builder.items]
    assert [e["item"] for e in events if e["type"] == "response.output_item.done"] == items
    assert [i["type"] for i in items] == ["reasoning", "message", "function_call",
                                          "function_call"]
    assert [i["call_id"] for i in items[2:]] == ["call_a", "call_b"]
    assert {i["status"] for i in items} == {"completed"}
    whole = OutputBuilder()     # the non-streaming answer: one delta of everything
    merged = ChoiceDelta()
    for d in DELTAS:
        merged.extend(d)
    whole.add(merged)
    whole.finish("completed")
    assert [{k: v for k, v in i.model_dump().items() if k != "id"} for i in whole.items] == \
        [{k: v for k, v in i.items() if k != "id"} for i in items]


def test_empty_output_is_an_empty_incomplete_message_and_events_are_numbered():
    builder = OutputBuilder()
    events = builder.finish("incomplete")
    assert [e["type"] for e in events][-1] == "response.output_item.done"
    assert builder.items[0].model_dump()["content"][0]["text"] == ""
    assert builder.items[0].status == "incomplete"
    counter = EventCounter()
    frames = [counter.sse(e) for e in events]
    assert [json.loads(f.split("data: ", 1)[1])["sequence_number"] for f in frames] == \
        list(range(len(events)))
    assert frames[0].startswith("event: response.output_item.added\ndata: ")
