"""A request's structured-output fields -> one `StructuredOutputsParams` (or None).

The fields and their meaning are vLLM's (``vllm/entrypoints/openai/protocol.py``,
``to_sampling_params``): OpenAI's ``response_format`` (``text``, ``json_object``,
``json_schema`` with ``json_schema: {name, schema, strict}``), vLLM's ``structured_outputs``
object (the fields of :class:`~jaxpaged.sampling_params.StructuredOutputsParams`), and the older
``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar`` aliases with
``guided_whitespace_pattern``. At most one of the three ways may be used in a request; every
error is a 400 naming the request's field, with llguidance's message for a grammar that does
not compile.
"""

from __future__ import annotations

from jaxpaged.sampling_params import SamplingParamsError, StructuredOutputsParams
from jaxpaged.server.errors import APIError, bad_request
from jaxpaged.server.protocol import SamplingFields
from jaxpaged.structured_output.grammar import validate

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}


def _sources(body: SamplingFields) -> list[tuple[str, dict]]:
    """Each way the request asks for a grammar: (its field, StructuredOutputsParams
    keyword arguments)."""
    found = []
    rf = body.response_format
    if rf is not None and rf.type != "text":
        if rf.type == "json_object":
            found.append(("response_format", {"json_object": True}))
        elif rf.json_schema is None or rf.json_schema.json_schema is None:
            raise bad_request("response_format of type json_schema needs json_schema.schema",
                              "response_format")
        else:
            found.append(("response_format", {"json": rf.json_schema.json_schema}))
    if body.structured_outputs is not None:
        found.append(("structured_outputs", dict(body.structured_outputs)))
    guided = {kind: getattr(body, name) for name, kind in _GUIDED.items()
              if getattr(body, name) is not None}
    if guided:
        found.append((next(n for n in _GUIDED if getattr(body, n) is not None), guided))
    return found


def structured_outputs_params(body: SamplingFields) -> StructuredOutputsParams | None:
    """The request's grammar, compiled once to check it (cached by spec).

    Raises:
        APIError 400: two ways of asking at once, an unknown ``structured_outputs`` key,
            a field of the wrong type, or a schema, regex or grammar that does not compile.
    """
    sources = _sources(body)
    if not sources:
        return None
    if len(sources) > 1:
        names = [name for name, _ in sources]
        raise bad_request(f"use one of {names} to constrain the output, not several",
                          names[1])
    param, kwargs = sources[0]
    if body.guided_whitespace_pattern is not None:
        kwargs.setdefault("whitespace_pattern", body.guided_whitespace_pattern)
    try:
        params = StructuredOutputsParams(**kwargs)
        validate(params)
    except TypeError as e:      # an unknown key of structured_outputs
        raise bad_request(f"{param}: {e}", param) from None
    except SamplingParamsError as e:
        raise _renamed(e, param) from None
    return params


def _renamed(e: SamplingParamsError, param: str) -> APIError:
    """``e`` (naming ``structured_outputs.<field>``) as a 400 naming the request's field."""
    detail = e.detail
    if param != "structured_outputs" and detail.startswith("structured_outputs"):
        detail = param + detail[len(e.param):]
    return bad_request(detail, param)
