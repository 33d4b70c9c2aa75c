"""A ``/v1/responses`` request translated onto the chat path: its input items as chat
messages, its fields as a :class:`ChatCompletionRequest`, and chat's errors renamed to the
Responses fields.

Translation (vLLM's ``serving_responses.py`` / ``responses_utils.py`` construct the same
conversation): ``instructions`` is a leading ``system`` message (never carried to a
follow-up turn, as OpenAI's reference says); a ``message`` item is a chat message with its
text parts joined; consecutive ``function_call`` items are one assistant turn's
``tool_calls`` (added to the assistant message just before them, if any), ``call_id`` as
the call's ``id``; a ``function_call_output`` is a ``tool`` message with that
``tool_call_id``; a ``reasoning`` item is the next assistant turn's reasoning. Flat function
tools become chat tools, ``text.format`` becomes ``response_format``,
``reasoning.effort`` the template variable ``reasoning_effort``.
"""

from __future__ import annotations

from jaxpaged.server.errors import APIError, bad_request
from jaxpaged.server.protocol import JsonSchemaFormat, ResponseFormat
from jaxpaged.server.protocol_chat import (ChatCompletionRequest, ChatMessage, ChatTool,
                                           FunctionCallIn, FunctionDefinition, NamedFunction,
                                           NamedToolChoice, ToolCallIn)
from jaxpaged.server.protocol_responses import (FunctionCallItem, FunctionCallOutputItem,
                                                FunctionToolChoice, InputItem, MessageItem,
                                                OutputItem, ReasoningItemIn, ResponsesRequest)

#: Chat's parameter names -> the Responses request's (for chat's 400s).
RENAMED_PARAMS = {"messages": "input", "max_completion_tokens": "max_output_tokens",
                  "max_tokens": "max_output_tokens", "response_format": "text",
                  "chat_template_kwargs": "reasoning"}


def input_items(body: ResponsesRequest) -> list[InputItem]:
    """The request's ``input`` as items (a string is one user message).

    Raises:
        APIError 400: an empty ``input``.
    """
    if isinstance(body.input, str):
        return [MessageItem(role="user", content=body.input)]
    if not body.input:
        raise bad_request("input must not be empty", "input")
    return list(body.input)


def output_as_input(items: list[OutputItem]) -> list[InputItem]:
    """A response's output items as the input items a follow-up turn reads them as."""
    kinds = {"message": MessageItem, "function_call": FunctionCallItem,
             "reasoning": ReasoningItemIn}
    return [kinds[item.type].model_validate(item.model_dump()) for item in items]


def _text(content) -> str:
    return content if isinstance(content, str) else "".join(p.text for p in content)


def chat_messages(items: list[InputItem], instructions: str | None) -> list[ChatMessage]:
    """The conversation as chat messages (see the module's translation rules)."""
    messages = [] if instructions is None else [ChatMessage(role="system",
                                                            content=instructions)]
    reasoning = None
    for item in items:
        if isinstance(item, ReasoningItemIn):
            reasoning = _text(item.content or item.summary)
        elif isinstance(item, MessageItem):
            message = ChatMessage(role=item.role, content=_text(item.content))
            if item.role == "assistant":
                message.reasoning, reasoning = reasoning, None
            messages.append(message)
        elif isinstance(item, FunctionCallItem):
            call = ToolCallIn(id=item.call_id, function=FunctionCallIn(name=item.name,
                                                                       arguments=item.arguments))
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant" and reasoning is None:
                last.tool_calls = [*(last.tool_calls or []), call]
            else:
                messages.append(ChatMessage(role="assistant", tool_calls=[call],
                                            reasoning=reasoning))
                reasoning = None
        elif isinstance(item, FunctionCallOutputItem):
            messages.append(ChatMessage(role="tool", tool_call_id=item.call_id,
                                        content=_text(item.output)))
    return messages


def _response_format(body: ResponsesRequest) -> ResponseFormat | None:
    fmt = body.text.format if body.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return ResponseFormat(type="json_object")
    if fmt.json_schema is None:
        raise bad_request("text.format of type json_schema needs schema", "text")
    return ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat.model_validate(
        {"name": fmt.name, "description": fmt.description, "schema": fmt.json_schema,
         "strict": fmt.strict}))


def chat_request(body: ResponsesRequest, items: list[InputItem]) -> ChatCompletionRequest:
    """The chat request that runs ``body`` over the conversation ``items``, streamed
    (the engine's outputs arrive as deltas, whether or not the client streams).

    Raises:
        APIError 400: ``max_output_tokens`` below 1, a ``json_schema`` format without a
            schema.
    """
    if body.max_output_tokens is not None and body.max_output_tokens < 1:
        raise bad_request(f"max_output_tokens must be an integer >= 1, got "
                          f"{body.max_output_tokens}", "max_output_tokens")
    tools = None if body.tools is None else [ChatTool(function=FunctionDefinition(
        name=t.name, description=t.description, parameters=t.parameters, strict=t.strict))
        for t in body.tools]
    choice = body.tool_choice
    if isinstance(choice, FunctionToolChoice):
        choice = NamedToolChoice(function=NamedFunction(name=choice.name))
    effort = body.reasoning.effort if body.reasoning is not None else None
    return ChatCompletionRequest(
        model=body.model, messages=chat_messages(items, body.instructions),
        max_completion_tokens=body.max_output_tokens, temperature=body.temperature,
        top_p=body.top_p, stream=True, tools=tools, tool_choice=choice,
        parallel_tool_calls=True if body.parallel_tool_calls is None else
        body.parallel_tool_calls,
        response_format=_response_format(body),
        chat_template_kwargs=None if effort is None else {"reasoning_effort": effort},
        top_k=body.top_k, min_p=body.min_p, repetition_penalty=body.repetition_penalty,
        seed=body.seed, stop=body.stop, ignore_eos=body.ignore_eos,
        request_id=body.request_id, priority=body.priority, cache_salt=body.cache_salt,
        user=body.user, thinking_token_budget=body.thinking_token_budget)


def renamed(e: APIError) -> APIError:
    """A chat-path error naming the Responses request's field instead of chat's."""
    if e.param in RENAMED_PARAMS:
        e.param = RENAMED_PARAMS[e.param]
        e.message = e.message.replace("max_completion_tokens", "max_output_tokens")
    return e
