"""`StructuredOutputsParams`: the grammar one request's output must match (vLLM's class of the
same name; ``SamplingParams.structured_outputs`` holds it). Data and type checks only: the
grammar itself is validated by :func:`jaxpaged.structured_output.grammar.validate`.
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxpaged.errors import check_param as _check

@dataclass(slots=True)
class StructuredOutputsParams:
    """A grammar the output must match (vLLM's ``StructuredOutputsParams``,
    ``vllm/sampling_params.py``); exactly one of the first five fields is set.

    Attributes:
        json: a JSON schema (a dict, or its JSON text): the output is one JSON value valid
            under it.
        regex: a regular expression (Rust ``regex`` syntax) the whole output matches.
        choice: the output is exactly one of these strings.
        grammar: a context-free grammar in Lark syntax (llguidance's dialect) or GBNF.
        json_object: True: the output is any JSON object (``response_format``
            ``json_object``).
        disable_any_whitespace: JSON without whitespace between tokens (llguidance's
            ``whitespace_flexible`` off): the default, unlike vLLM's, as a small or cold
            model let free fills ``max_tokens`` with blank lines inside ``{ }``. False opts
            in to flexible whitespace (any amount of JSON whitespace between tokens).
        disable_additional_properties: objects of the schema that do not say otherwise get
            ``additionalProperties: false``.
        whitespace_pattern: a regex for the whitespace allowed between JSON tokens
            (overrides ``disable_any_whitespace``).

    The grammar is compiled by llguidance (``jaxpaged.structured_output``); its validity is
    checked when the owning :class:`SamplingParams` is verified.

    Raises:
        SamplingParamsError (a ValueError): none or more than one of the five kinds is set,
            or a field of the wrong type; its ``param`` is ``structured_outputs.<field>``.
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = True
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        self.verify()

    @property
    def kind(self) -> str:
        """The name of the one grammar field set (``"json"``, ``"regex"``, ...)."""
        return next(k for k in _STRUCTURED_KINDS if getattr(self, k) not in (None, False))

    def verify(self) -> None:
        """Check the fields' types and that exactly one kind is set (not the grammar itself:
        ``jaxpaged.structured_output.grammar.validate`` compiles it).

        Raises:
            SamplingParamsError: naming the field.
        """
        name = "structured_outputs"
        kinds = [k for k in _STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        _check(len(kinds) == 1, name, f"must set exactly one of {list(_STRUCTURED_KINDS)}, "
                                      f"got {kinds or 'none'}")
        _check(self.json is None or isinstance(self.json, (str, dict)), f"{name}.json",
               f"must be a JSON schema (an object or its JSON text), got {self.json!r}")
        for field_ in ("regex", "grammar", "whitespace_pattern"):
            value = getattr(self, field_)
            _check(value is None or isinstance(value, str), f"{name}.{field_}",
                   f"must be a string, got {value!r}")
        _check(self.choice is None or (isinstance(self.choice, (list, tuple)) and self.choice
                                       and all(isinstance(c, str) for c in self.choice)),
               f"{name}.choice", f"must be a non-empty list of strings, got {self.choice!r}")
        for field_ in ("json_object", "disable_any_whitespace", "disable_additional_properties"):
            value = getattr(self, field_)
            _check(value is None or isinstance(value, bool), f"{name}.{field_}",
                   f"must be a bool, got {value!r}")


#: The grammar kinds of :class:`StructuredOutputsParams`, in vLLM's order.
_STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")
