"""A ``/v1/messages`` request translated onto the chat path: its conversation as chat
messages, its fields as a :class:`ChatCompletionRequest`, and chat's errors renamed to the
Messages fields.

Translation (vLLM's ``vllm/entrypoints/anthropic/serving.py`` builds the same conversation):
``system`` (a string or text blocks) is a leading ``system`` message; a message's text blocks
are its content parts (joined as chat joins parts); an assistant's ``tool_use`` blocks are its
``tool_calls`` (``id``, ``name``, ``input`` as the arguments) and its ``thinking`` blocks its
reasoning; each ``tool_result`` block of a user message is a ``tool`` message with that
``tool_call_id``, in the order the blocks come (text before or after a result is a user message
of its own). A conversation that ends with an assistant message is continued (Anthropic's
prefill: ``continue_final_message``, no generation prompt). Custom tools become chat function
tools (``input_schema`` as ``parameters``); ``tool_choice`` ``auto`` / ``none`` keep their
names, ``any`` is chat's ``required`` and ``tool`` a named function, so the same forced-call
grammars hold; ``disable_parallel_tool_use`` is ``parallel_tool_calls: false``. ``thinking``
sets the template variables ``enable_thinking`` and ``thinking`` (``disabled``: false) and
``output_config.effort`` the variable ``reasoning_effort``, under the request's
``chat_template_kwargs``; ``output_config.format`` is chat's ``json_schema``
``response_format``. ``thinking.budget_tokens`` (``enabled``) is chat's
``thinking_token_budget``: after that many reasoning tokens ``</think>`` is forced.
``stop_sequences`` are chat's ``stop``, ``metadata.user_id`` its ``user``.
"""

from __future__ import annotations

from jaxpaged.server.errors import APIError, bad_request
from jaxpaged.server.protocol import JsonSchemaFormat, ResponseFormat
from jaxpaged.server.protocol_anthropic import (CountTokensRequest, MessagesRequest,
                                                RedactedThinkingBlock, TextBlock,
                                                ThinkingBlock, ToolResultBlock, ToolUseBlock,
                                                ConversationFields)
from jaxpaged.server.protocol_chat import (ChatCompletionRequest, ChatMessage, ChatTool,
                                           FunctionCallIn, FunctionDefinition, NamedFunction,
                                           NamedToolChoice, TextPart, ToolCallIn)

#: Chat's parameter names -> the Messages request's (for chat's 400s).
RENAMED_PARAMS = {"max_completion_tokens": "max_tokens", "stop": "stop_sequences",
                  "response_format": "output_config",
                  "thinking_token_budget": "thinking.budget_tokens"}


def _parts(blocks: list[TextBlock]) -> list[TextPart]:
    return [TextPart(type="text", text=b.text) for b in blocks]


def chat_messages(body: ConversationFields) -> list[ChatMessage]:
    """The conversation as chat messages (see the module's translation rules)."""
    messages = []
    if body.system is not None:
        messages.append(ChatMessage(role="system", content=body.system if isinstance(
            body.system, str) else _parts(body.system)))
    for m in body.messages:
        if isinstance(m.content, str):
            messages.append(ChatMessage(role=m.role, content=m.content))
        elif m.role == "assistant":
            messages.append(_assistant(m.content))
        else:
            messages += _user(m.content)
    return messages


def _assistant(blocks: list) -> ChatMessage:
    texts, calls, thoughts = [], [], []
    for b in blocks:
        if isinstance(b, TextBlock):
            texts.append(b)
        elif isinstance(b, ToolUseBlock):
            calls.append(ToolCallIn(id=b.id, function=FunctionCallIn(name=b.name,
                                                                     arguments=b.input)))
        elif isinstance(b, ThinkingBlock):
            thoughts.append(b.thinking)
        elif isinstance(b, ToolResultBlock):
            raise bad_request("a tool_result block belongs in a user message, not an "
                              "assistant's", "messages")
    return ChatMessage(role="assistant", content=_parts(texts) if texts or not calls else None,
                       tool_calls=calls or None,
                       reasoning="".join(thoughts) if thoughts else None)


def _user(blocks: list) -> list[ChatMessage]:
    out, texts = [], []
    for b in blocks:
        if isinstance(b, TextBlock):
            texts.append(b)
        elif isinstance(b, ToolResultBlock):
            if texts:
                out.append(ChatMessage(role="user", content=_parts(texts)))
                texts = []
            content = b.content if isinstance(b.content, str) else _parts(b.content or [])
            out.append(ChatMessage(role="tool", tool_call_id=b.tool_use_id, content=content))
        elif not isinstance(b, RedactedThinkingBlock):
            raise bad_request(f"a {b.type} block belongs in an assistant message, not a "
                              "user's", "messages")
    if texts or not out:
        out.append(ChatMessage(role="user", content=_parts(texts)))
    return out


def _tools(body: ConversationFields) -> dict:
    """The chat request's ``tools``, ``tool_choice`` and ``parallel_tool_calls``.

    Raises:
        APIError 400: ``tool_choice`` ``tool`` without a ``name``.
    """
    tools = None if body.tools is None else [ChatTool(function=FunctionDefinition(
        name=t.name, description=t.description, parameters=t.input_schema))
        for t in body.tools]
    choice, parallel = body.tool_choice, True
    if choice is not None:
        parallel = not choice.disable_parallel_tool_use
        if choice.type == "tool":
            if not choice.name:
                raise bad_request("tool_choice of type 'tool' needs the tool's name",
                                  "tool_choice")
            choice = NamedToolChoice(function=NamedFunction(name=choice.name))
        else:
            choice = {"any": "required"}.get(choice.type, choice.type)
    return {"tools": tools, "tool_choice": choice, "parallel_tool_calls": parallel}


def _rendering(body: ConversationFields) -> dict:
    """The rendering fields: template variables (``thinking`` under the request's
    ``chat_template_kwargs``) and the prefill rule."""
    kwargs = {}
    if body.thinking is not None:
        on = body.thinking.type != "disabled"
        kwargs = {"enable_thinking": on, "thinking": on}
    output = getattr(body, "output_config", None)
    if output is not None and output.effort is not None:
        kwargs["reasoning_effort"] = output.effort
    kwargs.update(body.chat_template_kwargs or {})
    prefill = bool(body.messages) and body.messages[-1].role == "assistant"
    return {"chat_template_kwargs": kwargs or None, "continue_final_message": prefill,
            "add_generation_prompt": not prefill}


def chat_request(body: MessagesRequest) -> ChatCompletionRequest:
    """The chat request that runs ``body``, streamed (the engine's outputs arrive as deltas,
    whether or not the client streams).

    Raises:
        APIError 400: ``max_tokens`` below 1, an empty ``messages``, a block in the wrong
            role's message, ``tool_choice`` ``tool`` without a name.
    """
    if body.max_tokens < 1:
        raise bad_request(f"max_tokens must be an integer >= 1, got {body.max_tokens}",
                          "max_tokens")
    if not body.messages:
        raise bad_request("messages must not be empty", "messages")
    user = body.metadata.user_id if body.metadata is not None else None
    output = body.output_config
    fmt = None if output is None or output.format is None else ResponseFormat(
        type="json_schema", json_schema=JsonSchemaFormat.model_validate(
            {"name": "output", "schema": output.format.json_schema}))
    return ChatCompletionRequest(
        model=body.model, messages=chat_messages(body), max_completion_tokens=body.max_tokens,
        stop=body.stop_sequences, temperature=body.temperature, top_p=body.top_p,
        top_k=body.top_k, min_p=body.min_p, repetition_penalty=body.repetition_penalty,
        seed=body.seed, ignore_eos=body.ignore_eos, user=user, stream=True,
        response_format=fmt, thinking_token_budget=_thinking_budget(body), **_tools(body),
        **_rendering(body))


def _thinking_budget(body: MessagesRequest) -> int | None:
    """``thinking.budget_tokens`` of an ``enabled`` thinking config: chat's
    ``thinking_token_budget`` (None: the server's ``--reasoning-budget``)."""
    thinking = body.thinking
    if thinking is None or thinking.type == "disabled":
        return None
    return thinking.budget_tokens


def count_request(body: CountTokensRequest) -> ChatCompletionRequest:
    """The chat request whose rendered prompt ``count_tokens`` counts (the one
    :func:`chat_request` runs for the same conversation, tools and thinking).

    Raises:
        APIError 400: as :func:`chat_request`.
    """
    if not body.messages:
        raise bad_request("messages must not be empty", "messages")
    return ChatCompletionRequest(model=body.model, messages=chat_messages(body),
                                 **_tools(body), **_rendering(body))


def renamed(e: APIError) -> APIError:
    """A chat-path error naming the Messages request's field instead of chat's."""
    if e.param in RENAMED_PARAMS:
        e.message = e.message.replace(e.param, RENAMED_PARAMS[e.param])
        e.param = RENAMED_PARAMS[e.param]
    return e
