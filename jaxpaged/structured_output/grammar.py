"""`StructuredOutputsParams` -> an llguidance grammar, and its validation.

The mapping follows vLLM's guidance backend (``vllm/v1/structured_output/backend_guidance.py``,
``serialize_guidance_grammar``): a JSON schema goes through llguidance's JSON compiler
(``LLMatcher.grammar_from_json_schema``; compact, llguidance's ``whitespace_flexible``
off, unless a request sets ``disable_any_whitespace`` false, which jaxpaged defaults to true
where vLLM defaults to false), ``json_object`` is the schema ``{"type": "object"}``, and regex,
choice and grammar go through ``llguidance.grammar_from``. llguidance's grammar syntax:
https://github.com/guidance-ai/llguidance/blob/main/docs/syntax.md.
"""

from __future__ import annotations

import copy
import functools
import json
import re

from jaxpaged.errors import SamplingParamsError
from jaxpaged.structured_output.params import StructuredOutputsParams

#: Keys of a JSON schema that hold maps of sub-schemas, and those that hold sub-schemas.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_ITEMS = ("additionalProperties", "items", "prefixItems", "allOf", "anyOf", "oneOf",
                 "not", "if", "then", "else", "contains")


def _close_objects(schema) -> None:
    """Set ``additionalProperties: false`` (in place) on every object schema with
    ``properties`` that does not say otherwise (``disable_additional_properties``)."""
    if isinstance(schema, list):
        for item in schema:
            _close_objects(item)
        return
    if not isinstance(schema, dict):
        return
    for key in _SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            for sub in schema[key].values():
                _close_objects(sub)
    for key in _SCHEMA_ITEMS:
        if isinstance(schema.get(key), (dict, list)):
            _close_objects(schema[key])
    if isinstance(schema.get("properties"), dict):
        schema.setdefault("additionalProperties", False)


def cache_key(params: StructuredOutputsParams) -> str:
    """A string naming the grammar ``params`` describe (equal specs, equal keys): what
    compiled grammars are cached by."""
    return json.dumps([params.kind, getattr(params, params.kind), params.disable_any_whitespace,
                       params.disable_additional_properties, params.whitespace_pattern],
                      sort_keys=True)


def _schema(kind: str, spec, close_objects: bool):
    """The JSON schema of a ``json`` (a dict, or its JSON text) or ``json_object`` spec,
    closed (``disable_additional_properties``) on a copy if asked.

    Raises:
        SamplingParamsError: JSON text that does not parse (``structured_outputs.json``).
    """
    schema = {"type": "object"} if kind == "json_object" else spec
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise SamplingParamsError("structured_outputs.json",
                                      f"is not valid JSON: {e}") from None
    if close_objects:
        schema = copy.deepcopy(schema)
        _close_objects(schema)
    return schema


def serialize(params: StructuredOutputsParams) -> str:
    """The llguidance grammar (its JSON text) of ``params``.

    Raises:
        SamplingParamsError: a JSON schema that is not JSON (``structured_outputs.json``).
    """
    return _serialize(cache_key(params))


@functools.lru_cache(maxsize=256)
def _serialize(key: str) -> str:
    llguidance = _llguidance()
    kind, spec, no_whitespace, close_objects, whitespace = json.loads(key)
    options = {"whitespace_flexible": not no_whitespace}
    if whitespace is not None:
        options["whitespace_pattern"] = whitespace
    if kind in ("json", "json_object"):
        schema = _schema(kind, spec, close_objects)
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
        except ValueError as e:
            raise SamplingParamsError("structured_outputs.json", f"is not a JSON schema: {e}"
                                      ) from None
    try:
        return llguidance.grammar_from(kind, spec)
    except ValueError as e:
        raise SamplingParamsError(f"structured_outputs.{kind}", f"is invalid: {e}") from None


def validate(params: StructuredOutputsParams) -> None:
    """Compile ``params``' grammar without a tokenizer (milliseconds; cached by spec).

    Raises:
        SamplingParamsError: naming ``structured_outputs.<kind>``, with llguidance's message
            (e.g. ``invalid regex "[0-9" ... unclosed character class``).
    """
    error = _validation_error(cache_key(params))
    if error:
        raise SamplingParamsError(f"structured_outputs.{params.kind}", f"is invalid: {error}")


@functools.lru_cache(maxsize=256)
def _validation_error(key: str) -> str:
    return _llguidance().LLMatcher.validate_grammar(_serialize(key), None)


def _llguidance():
    """The llguidance module, imported when a request first asks for a grammar (not with
    jaxpaged: plain generation runs without it).

    Raises:
        SamplingParamsError: llguidance is not installed (``structured_outputs``).
    """
    try:
        import llguidance
    except ImportError as e:
        raise SamplingParamsError("structured_outputs", f"needs the llguidance package, "
                                  f"which cannot be imported here ({e})") from None
    return llguidance


#: How the output may begin a reasoning block (:func:`after_reasoning`).
REASONING_OPENINGS = ("inside", "optional", "untagged_reasoning")


def after_reasoning(params: StructuredOutputsParams, start: str, end: str,
                    opening: str) -> StructuredOutputsParams:
    """``params``' grammar behind a reasoning block, as one Lark grammar: free text up to the
    ``end`` tag (llguidance's ``stop`` on a rule), optional whitespace, then the constrained
    output. vLLM starts the grammar once its reasoning parser sees the end of the reasoning
    (``vllm/v1/structured_output/__init__.py``, ``should_advance``); here the same effect
    is in the grammar, so the engine needs nothing more.

    Args:
        params: the request's structured output (``json``, ``json_object``, ``regex`` or
            ``choice``; a ``grammar`` is returned as it is: it constrains from the first
            token).
        start, end: the block's tags (``<think>``, ``</think>``).
        opening: ``"inside"``: the prompt opened the block, so the output reasons first;
            ``"optional"``: the output may open it with ``start``, else it has none;
            ``"untagged_reasoning"``: it may open it with ``start``, and reasons until
            ``end`` either way (DeepSeek-R1's models).

    Raises:
        SamplingParamsError: as :func:`serialize` (a JSON schema that is not JSON).
        ValueError: an unknown ``opening``.
    """
    if opening not in REASONING_OPENINGS:
        raise ValueError(f"opening must be one of {REASONING_OPENINGS}, got {opening!r}")
    body = _lark_body(params)
    if body is None:
        return params
    # After the block, at most a few blank characters (Qwen3 writes "\n\n"); without one,
    # the constraint holds from the first token.
    think = "think_text /[ \\t\\n]{0,4}/"
    lead = {"inside": think, "optional": f"({json.dumps(start)} {think})?",
            "untagged_reasoning": f"{json.dumps(start)}? {think}"}[opening]
    return StructuredOutputsParams(grammar=(
        f"start: {lead} body\n"
        f"think_text[stop={json.dumps(end)}]: /(.|\\n)*/\n"
        f"body: {body}\n"))


def _lark_body(params: StructuredOutputsParams) -> str | None:
    """``params``' constraint as a Lark expression (None for a ``grammar``)."""
    kind, spec = params.kind, getattr(params, params.kind)
    if kind in ("json", "json_object"):
        schema = copy.deepcopy(_schema(kind, spec, params.disable_additional_properties))
        options = {"whitespace_flexible": not params.disable_any_whitespace}
        if params.whitespace_pattern is not None:
            options["whitespace_pattern"] = params.whitespace_pattern
        if isinstance(schema, dict):
            schema["x-guidance"] = {**options, **schema.get("x-guidance", {})}
        return "%json " + json.dumps(schema)
    if kind == "regex":     # a Lark regex literal: every unescaped "/" escaped
        return "/" + re.sub(r"(?<!\\)((?:\\\\)*)/", r"\1\\/", spec) + "/"
    if kind == "choice":
        return " | ".join(json.dumps(c) for c in spec)
    return None
