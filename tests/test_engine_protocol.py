"""``Engine`` and ``DataParallelEngine`` satisfy ``EngineClient``, the seam the server and the
benchmarks call (``jaxpaged/engine/protocol.py``), and ``ModelInfo`` is a frozen description."""

import dataclasses
import inspect
import typing

import pytest

from jaxpaged.engine.data_parallel import DataParallelEngine
from jaxpaged.engine.engine import Engine
from jaxpaged.engine.protocol import EngineClient, ModelInfo
from jaxpaged.arg_utils import EngineArgs

#: The protocol's methods (its data members are checked on a built engine below).
METHODS = sorted(name for name, value in vars(EngineClient).items()
                 if callable(value) and not name.startswith("_"))


def test_the_protocol_names_the_calls_its_callers_make():
    assert METHODS == ["abort_request", "add_request", "device_memory_used",
                       "get_num_unfinished_requests", "get_num_waiting_seqs",
                       "has_unfinished_requests", "record_stats", "start_background_compile",
                       "stats", "step", "wait_until_compiled"]
    assert set(typing.get_type_hints(EngineClient)) >= {"model_info", "tokenizer",
                                                        "stat_loggers", "lora_config",
                                                        "fault_injector"}


@pytest.mark.parametrize("cls", [Engine, DataParallelEngine])
def test_both_engines_have_every_call_with_its_parameters(cls):
    for name in METHODS:
        want = list(inspect.signature(getattr(EngineClient, name)).parameters)
        have = list(inspect.signature(getattr(cls, name)).parameters)
        assert have == want, (cls.__name__, name)
    assert isinstance(cls.num_preemptions, property)


def test_built_engines_are_engine_clients_with_one_model_info(stories_llm):
    engine = stories_llm.engine
    assert isinstance(engine, EngineClient)
    info = engine.model_info
    assert (info.max_model_len, info.vocab_size, info.hidden_size) == (
        engine.max_model_len, engine.model_config.vocab_size, engine.model_config.hidden_size)
    assert info.vocab_size == 512 and info.eos_token_ids == {2}
    assert info.eos_token_ids == frozenset(engine.output_processor.eos_token_ids)
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.max_model_len = 1
    with pytest.raises(TypeError):
        info.generation_defaults["max_tokens"] = 1      # read-only


def test_a_data_parallel_engine_is_an_engine_client_sharing_its_replicas_model_info():
    engine = DataParallelEngine(EngineArgs(data_parallel_size=2, enforce_eager=True,
                                           max_num_seqs=8, max_num_batched_tokens=64))
    assert isinstance(engine, EngineClient)
    assert all(r.model_info == engine.model_info for r in engine.replicas)
    assert engine.model_info is engine.replicas[0].model_info
    assert isinstance(engine.model_info, ModelInfo)
    assert engine.lora_config is None             # started without --enable-lora

    def injector(step, request_ids):
        pass

    engine.fault_injector = injector              # reaches every replica
    assert [r.fault_injector for r in engine.replicas] == [injector, injector]
    assert engine.fault_injector is injector
