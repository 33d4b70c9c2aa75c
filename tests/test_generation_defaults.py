"""A model's ``generation_config.json`` defaults reach the sampling fields a request leaves to
the model, applied in one place: the engine's input processor
(``SamplingParams.model_default_fields``, ``core.generation_config.apply_generation_defaults``).
"""

from types import SimpleNamespace

import pytest

from jaxpaged.core.input_processor import InputProcessor
from jaxpaged.sampling_params import MODEL_DEFAULT_FIELDS, SamplingParams, SamplingParamsError
from jaxpaged.server.protocol import CompletionRequest
from jaxpaged.server.protocol_responses import ResponsesRequest
from jaxpaged.server.request_params import RequestParameters
from jaxpaged.server.serving_chat import ChatRun
from jaxpaged.server.serving_responses import OpenAIServingResponses

DEFAULTS = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "max_tokens": 64}
#: An engine's checks for a model with those defaults (no tokenizer needed to check params).
PROCESSOR = InputProcessor(None, 512, 128, 8, generation_defaults=DEFAULTS)
#: The same for a model without a generation config.
PLAIN = InputProcessor(None, 512, 128, 8)


def test_fields_left_to_the_model_take_its_defaults():
    given = SamplingParams(top_k=5, max_tokens=16, model_default_fields=frozenset(
        {"temperature", "top_p", "min_p", "max_tokens"}))
    p = PROCESSOR.check_params(given)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.max_tokens) == (0.7, 0.8, 5, 0.0, 64)
    assert p.model_default_fields == frozenset()
    assert (given.temperature, given.max_tokens) == (1.0, 16)     # the caller's copy is kept


def test_explicit_fields_and_greedy_decoding_win():
    p = PROCESSOR.check_params(SamplingParams(temperature=0, model_default_fields=frozenset(
        {"top_p", "top_k"})))
    assert (p.temperature, p.top_p, p.top_k) == (0, 1.0, 0)      # greedy resets them
    p = PROCESSOR.check_params(SamplingParams(temperature=0.2))     # nothing left to the model
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens) == (0.2, 1.0, 0, 16)


def test_a_model_without_defaults_keeps_the_values_given():
    p = PLAIN.check_params(SamplingParams(max_tokens=16, model_default_fields=MODEL_DEFAULT_FIELDS))
    assert p == SamplingParams(max_tokens=16)


def test_min_tokens_is_checked_against_the_limit_applied():
    params = SamplingParams(min_tokens=32, max_tokens=16,
                            model_default_fields=frozenset({"max_tokens"}))
    assert PROCESSOR.check_params(params).max_tokens == 64
    with pytest.raises(SamplingParamsError, match="min_tokens must be <= max_tokens=16") as e:
        PLAIN.check_params(params)
    assert e.value.param == "min_tokens"


def test_only_fields_a_model_can_default_are_left_to_it():
    with pytest.raises(SamplingParamsError, match="model_default_fields must be a set") as e:
        SamplingParams(model_default_fields=frozenset({"seed"}))
    assert e.value.param == "model_default_fields"


def test_the_server_leaves_null_fields_and_an_absent_limit_to_the_model():
    body = CompletionRequest(model="m", prompt="x", temperature=0.3)
    p = RequestParameters().sampling_params(body, 16, None, None, False,
                                            max_tokens_from_model=True)
    assert p.model_default_fields == {"top_p", "top_k", "min_p", "repetition_penalty",
                                      "max_tokens"}
    p = PROCESSOR.check_params(p)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.max_tokens) == (0.3, 0.8, 20, 0.0, 64)
    assert PLAIN.check_params(RequestParameters().sampling_params(
        body, 16, None, None, False, max_tokens_from_model=True)).max_tokens == 16
    body = CompletionRequest(model="m", prompt="x", top_p=0.5, max_tokens=8)
    p = PROCESSOR.check_params(RequestParameters().sampling_params(body, 8, None, None, False))
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens) == (0.7, 0.5, 20, 8)


def test_a_response_object_echoes_the_values_the_engine_samples_with():
    chat = SimpleNamespace(engine=SimpleNamespace(model_info=SimpleNamespace(
        generation_defaults=DEFAULTS)), model_name=lambda name: name)
    body = ResponsesRequest(model="m", input="hi", top_p=0.5)
    params = RequestParameters().sampling_params(      # as the chat request it becomes
        CompletionRequest(model="m", prompt="hi", top_p=0.5), 16, None, None, False)
    run = ChatRun("resp-1", None, params, None)
    echoed = OpenAIServingResponses(chat)._response_object(body, run, keep=False)
    assert (echoed.temperature, echoed.top_p) == (0.7, 0.5)     # the model's, the request's
