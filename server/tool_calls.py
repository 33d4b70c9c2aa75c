"""Tool calling on ``/v1/chat/completions``, the request side: the checks on ``tools`` /
``tool_choice``, the conversation as the chat template reads it, the output parser a request
gets, and the JSON Schema that ``required`` / a named choice are enforced with.

Contract: vLLM's ``ChatCompletionRequest.check_tool_usage`` and
``_get_json_schema_from_tool`` (``vllm/entrypoints/openai/protocol.py``),
``OpenAIServingChat.create_chat_completion`` (the ``"auto"`` flags check) and
``chat_utils.py`` (assistant ``tool_calls`` arguments parsed to dicts before rendering, as
Hugging Face templates iterate them).
"""

from __future__ import annotations

import dataclasses
import json

from jaxpaged.sampling_params import SamplingParams, SamplingParamsError, StructuredOutputsParams
from jaxpaged.server.config import ServerConfig
from jaxpaged.server.errors import bad_request
from jaxpaged.server.protocol_chat import ChatCompletionRequest, ChatMessage, NamedToolChoice
from jaxpaged.server.tool_parsers import TOOL_PARSERS, ToolParser
from jaxpaged.server.tool_parsers.forced import NamedToolParser, RequiredToolParser
from jaxpaged.structured_output.grammar import validate


def tool_choice_of(body: ChatCompletionRequest, config: ServerConfig) -> str | NamedToolChoice:
    """The request's effective ``tool_choice`` (``"auto"`` when it sends tools without one,
    else ``"none"``), checked.

    Raises:
        APIError 400: a ``tool_choice`` other than ``"none"`` without ``tools``; a named
            function not in ``tools``; ``"auto"`` on a server started without
            ``--enable-auto-tool-choice`` and ``--tool-call-parser`` (vLLM's messages).
    """
    choice = body.tool_choice
    if choice is None:
        choice = "auto" if body.tools else "none"
    if choice != "none" and not body.tools:
        raise bad_request("When using `tool_choice`, `tools` must be set.", "tool_choice")
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if name not in {t.function.name for t in body.tools}:
            raise bad_request(f"Tool '{name}' has not been passed in `tools`.", "tool_choice")
    if choice == "auto" and not (config.enable_auto_tool_choice and config.tool_call_parser):
        raise bad_request('"auto" tool choice requires --enable-auto-tool-choice and '
                          '--tool-call-parser to be set', "tool_choice")
    return choice


def tool_parser_for(body: ChatCompletionRequest, choice: str | NamedToolChoice,
                    config: ServerConfig) -> ToolParser | None:
    """A fresh output parser for one choice of the request (None: no tool parsing). Forced
    calls (``required``, a named function) get their ids in the ``--tool-call-parser``'s
    format, as its own calls do."""
    max_calls = None if body.parallel_tool_calls else 1
    make_id = TOOL_PARSERS[config.tool_call_parser].make_id if config.tool_call_parser \
        else None
    if isinstance(choice, NamedToolChoice):
        return NamedToolParser(choice.function.name, make_id)
    if choice == "required":
        return RequiredToolParser(max_calls, make_id)
    if choice == "auto":
        return TOOL_PARSERS[config.tool_call_parser](max_calls)
    return None


def forced_call_schema(body: ChatCompletionRequest, choice: str | NamedToolChoice
                       ) -> dict | None:
    """The JSON Schema the output must follow for ``required`` (an array of at least one
    ``{"name", "parameters"}``, each name with its own parameters' schema; at most one item
    without ``parallel_tool_calls``) or a named function (its parameters' schema), else None.
    ``$defs`` of the tools' schemas are lifted to the top, where their ``#/$defs/`` refs
    point.

    Raises:
        APIError 400: two tools define the same ``$defs`` name differently.
    """
    if isinstance(choice, NamedToolChoice):
        tool = next(t for t in body.tools if t.function.name == choice.function.name)
        return tool.function.parameters or {"type": "object"}
    if choice != "required":
        return None
    defs, items = {}, []
    for tool in body.tools:
        params = dict(tool.function.parameters or {"type": "object"})
        for key, value in params.pop("$defs", {}).items():
            if defs.setdefault(key, value) != value:
                raise bad_request(f"tools define $defs {key!r} differently: they cannot be "
                                  "combined for tool_choice='required'", "tools")
        items.append({"type": "object",
                      "properties": {"name": {"type": "string", "enum": [tool.function.name]},
                                     "parameters": params},
                      "required": ["name", "parameters"], "additionalProperties": False})
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if not body.parallel_tool_calls:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def with_forced_call(params: SamplingParams, schema: dict) -> SamplingParams:
    """``params`` with the structured output that enforces a forced call's schema
    (:func:`forced_call_schema`), as vLLM enforces ``tool_choice`` ``required`` and named
    functions with guided JSON (it replaces any ``response_format`` the request had). The
    call is written without optional whitespace (``disable_any_whitespace``): its arguments
    are read by a program, and a model that does not know the format would otherwise spend
    its tokens on blank space inside the JSON (seen with the bundled story model).

    Raises:
        APIError 400: the tools' parameters do not make a valid JSON Schema (the grammar
            compiler's message, naming ``tools``).
    """
    try:
        constraint = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
        validate(constraint)    # here, to name ``tools`` (the engine checks it again, cached)
        return dataclasses.replace(params, structured_outputs=constraint)
    except SamplingParamsError as e:
        raise bad_request(f"the tools' parameters are not a usable JSON Schema: {e}",
                          "tools") from None


def template_tools(body: ChatCompletionRequest) -> list[dict] | None:
    """``tools`` as the chat template reads them (OpenAI's shape, unset fields left out)."""
    if not body.tools:
        return None
    return [t.model_dump(exclude_none=True) for t in body.tools]


def conversation_message(m: ChatMessage, index: int) -> dict:
    """One message as the chat template reads it: text parts joined, an assistant's
    ``tool_calls`` with their ``arguments`` decoded to dicts, ``tool_call_id`` of a tool
    result, an earlier turn's reasoning as ``reasoning_content``.

    Raises:
        APIError 400: ``arguments`` that are not a JSON object.
    """
    content = m.content if isinstance(m.content, str) or m.content is None else \
        "".join(part.text for part in m.content)
    message = {"role": m.role, "content": content or ""}
    if m.name is not None:
        message["name"] = m.name
    if m.tool_call_id is not None:
        message["tool_call_id"] = m.tool_call_id
    reasoning = m.reasoning if m.reasoning is not None else m.reasoning_content
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    if m.tool_calls:
        calls = []
        for j, call in enumerate(m.tool_calls):
            args = call.function.arguments
            if isinstance(args, str):
                try:
                    args = json.loads(args)
                except ValueError:
                    args = None
            if not isinstance(args, dict):
                raise bad_request(f"messages[{index}].tool_calls[{j}].function.arguments must "
                                  "be a JSON object (as a string)", "messages")
            entry = {"type": "function",
                     "function": {"name": call.function.name, "arguments": args}}
            if call.id is not None:
                entry["id"] = call.id
            calls.append(entry)
        message["tool_calls"] = calls
    return message
