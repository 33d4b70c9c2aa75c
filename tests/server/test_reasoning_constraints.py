"""Constrained output (``response_format``, forced tool calls) under ``--reasoning-parser``
and the forced calls' id format (issue 43, section 1): the grammar holds from the first token
where no think block is asked for, a thought cut by ``max_tokens`` is never an answer or a
call, a named call is announced when its arguments begin, and forced calls take the
``--tool-call-parser``'s ids."""

from __future__ import annotations

import json
import re

import pytest

from tests.server.test_tool_calling import (GRID_TOOLS, ask, client, force,  # noqa: F401
                                            joined, server)

SET_GRID = {"type": "function", "function": {"name": "set_grid"}}


@pytest.mark.parametrize("choice", ["required", "named"])
def test_forced_calls_take_the_tool_call_parsers_ids(server, client, monkeypatch, choice):
    args = '{"mode":"off","size":12}'
    text = f'[{{"name":"set_grid","parameters":{args}}}]' if choice == "required" else args
    n = force(monkeypatch, server, {"ids": text})["ids"]
    tool_choice = "required" if choice == "required" else SET_GRID
    common = dict(tools=GRID_TOOLS, tool_choice=tool_choice, parallel_tool_calls=False)
    if choice == "required":        # the array's items are re-serialized (json.dumps)
        args = json.dumps(json.loads(args))
    ids = {}
    for parser in ("mistral", "hermes"):
        with server.configured(tool_call_parser=parser):
            r = ask(client, "ids", n, **common)
            _, _, calls, _ = joined(client, "ids", n, **common)
        (call,) = r.choices[0].message.tool_calls
        assert (call.function.name, call.function.arguments) == ("set_grid", args)
        assert [c[2:] for c in calls.values()] == [["set_grid", args]]
        ids[parser] = [call.id, calls[0][0]]
    assert all(re.fullmatch("[A-Za-z0-9]{9}", i) for i in ids["mistral"]), ids
    assert all(re.fullmatch("chatcmpl-tool-[0-9a-f]{32}", i) for i in ids["hermes"]), ids
