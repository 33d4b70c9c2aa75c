"""``--tool-call-parser mistral``: Mistral's ``[TOOL_CALLS]`` marker (a control token)
followed by a JSON array of ``{"name", "arguments"}`` objects (or one object), or, from
tokenizer v11 on, by ``name[ARGS]{...}`` (one call per marker); content before the marker
kept. Ids are 9 alphanumeric characters, as Mistral's templates require.

Format: vLLM's ``vllm/entrypoints/openai/tool_parsers/mistral_tool_parser.py``
(``MistralToolCall.generate_random_id``) and mistral-common's tool-call encoding.
"""

from __future__ import annotations

import json
import re
import secrets
import string

from jaxpaged.server.tool_parsers.base import MarkedCallParser, call_from_json

_ID_ALPHABET = string.ascii_letters + string.digits
#: Length of a Mistral tool-call id.
MISTRAL_ID_LENGTH = 9
ARGS = "[ARGS]"
#: ``name[ARGS]`` of the v11 format, from the start of a call's body.
_NAMED = re.compile(r"\s*([A-Za-z0-9_.-]+)" + re.escape(ARGS))


class MistralToolParser(MarkedCallParser):
    """``[TOOL_CALLS]`` then a JSON array (or object) of calls; the body ends where the
    JSON value does."""

    name = "mistral"
    start = "[TOOL_CALLS]"

    @staticmethod
    def make_id() -> str:
        """A new call's id: :data:`MISTRAL_ID_LENGTH` random letters and digits."""
        return "".join(secrets.choice(_ID_ALPHABET) for _ in range(MISTRAL_ID_LENGTH))

    def body_end(self, body: str) -> int | None:
        named = _NAMED.match(body)
        start = named.end() if named else len(body) - len(body.lstrip())
        try:
            _, end = json.JSONDecoder().raw_decode(body, start)
        except ValueError:
            return None
        return end

    def parse_body(self, body: str) -> list[tuple[str, dict]] | None:
        named = _NAMED.match(body)
        try:
            value = json.loads(body[named.end():] if named else body)
        except ValueError:
            return None
        if named:
            return [(named.group(1), value)] if isinstance(value, dict) else None
        calls = [call_from_json(v, ("arguments",))
                 for v in (value if isinstance(value, list) else [value])]
        return None if not calls or None in calls else calls
