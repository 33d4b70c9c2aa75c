"""A two-turn tool conversation (a call, its result) rendered by the chat handler with Qwen2's
real tokenizer and chat template."""

from __future__ import annotations

import os
from types import SimpleNamespace

from jaxpaged.server.protocol_chat import ChatCompletionRequest
from jaxpaged.server.serving import ServerConfig
from jaxpaged.server.serving_chat import OpenAIServingChat
from jaxpaged.server.tool_calls import template_tools
from jaxpaged.tokenizer import load_tokenizer
from tests.conftest import TOKENIZERS
from tests.server.test_tool_parsers import TOOLS

CONVERSATION = [
    {"role": "user", "content": "weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "chatcmpl-tool-1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "chatcmpl-tool-1", "content": "sunny, 21 C"},
    {"role": "assistant", "content": "It is sunny."},
    {"role": "user", "content": "and tomorrow?"}]


def test_two_turn_tool_conversation_renders_with_the_qwen2_template():
    tok = load_tokenizer(os.path.join(TOKENIZERS, "qwen2"), False)
    engine = SimpleNamespace(model_info=SimpleNamespace(max_model_len=4096))   # an AsyncEngine
    chat = OpenAIServingChat(engine, ServerConfig(["qwen"]), tok)
    body = ChatCompletionRequest.model_validate({"messages": CONVERSATION, "tools": TOOLS})
    ids = chat.render(body.messages, tools=template_tools(body))
    # Qwen2's template shows neither tools nor calls: the call turn renders empty, the
    # result as a "tool" turn
    assert tok.decode(ids) == (
        "<|im_start|>system\nYou are a helpful assistant<|im_end|>\n"
        "<|im_start|>user\nweather in Paris?<|im_end|>\n"
        "<|im_start|>assistant\n<|im_end|>\n"
        "<|im_start|>tool\nsunny, 21 C<|im_end|>\n"
        "<|im_start|>assistant\nIt is sunny.<|im_end|>\n"
        "<|im_start|>user\nand tomorrow?<|im_end|>\n"
        "<|im_start|>assistant\n")
    assert ids == tok.encode(tok.decode(ids), add_special_tokens=False)
