"""Chat prompts: conversations rendered with the tokenizer's (or a given) Jinja chat template.

The rendering itself is transformers' ``apply_chat_template``; this module only fixes the
rules around it, shared by ``LLM.chat`` and the server: a missing template is an error that
says how to supply one, a template's own ``raise_exception`` message is passed on unchanged,
and the rendered text is encoded without adding special tokens again (the template writes
any BOS itself).
"""

from __future__ import annotations

import jinja2


class ChatTemplateError(ValueError):
    """The conversation cannot be rendered; the message is the template's own (or says that
    there is no template)."""


def render_chat(tokenizer, conversation: list[dict], chat_template: str | None = None,
                add_generation_prompt: bool = True, continue_final_message: bool = False,
                template_kwargs: dict | None = None) -> str:
    """Render one conversation to prompt text.

    Args:
        tokenizer: a Hugging Face tokenizer.
        conversation: ``[{"role": ..., "content": str}, ...]``, at least one message.
        chat_template: Jinja source used instead of the tokenizer's template.
        add_generation_prompt: end with the opening of the assistant's turn.
        continue_final_message: leave the last (assistant) message open (exclusive with
            ``add_generation_prompt``).
        template_kwargs: extra variables for the template.

    Raises:
        ChatTemplateError: no template, the template raised (its message, unchanged), or it
            could not render these messages.
        ValueError: an empty conversation, or both ``add_generation_prompt`` and
            ``continue_final_message``.
    """
    if not conversation:
        raise ValueError("the conversation has no messages")
    if add_generation_prompt and continue_final_message:
        raise ValueError("add_generation_prompt and continue_final_message are exclusive")
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError(
            "this model's tokenizer has no chat template; supply one (a Jinja template: "
            "--chat-template FILE for the server, chat_template= for LLM.chat)")
    try:
        return tokenizer.apply_chat_template(
            conversation, chat_template=chat_template, tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, **(template_kwargs or {}))
    except jinja2.TemplateError as e:
        raise ChatTemplateError(str(e)) from e
    except (ValueError, TypeError, KeyError, IndexError, ArithmeticError, RecursionError) as e:
        # ArithmeticError: the sandbox's range limit (OverflowError); RecursionError: a
        # template that recurses without end
        raise ChatTemplateError(f"the chat template cannot render these messages: {e}") from e


def encode_chat(tokenizer, text: str) -> list[int]:
    """Token ids of rendered chat text (no special tokens added: the template wrote them)."""
    return tokenizer.encode(text, add_special_tokens=False)
