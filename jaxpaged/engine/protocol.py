"""The seam between the engine and its callers (the server, the benchmarks, ``LLM``).

:class:`ModelInfo` is what a caller may know of the served model; :class:`EngineClient` is what
it may call on an engine. :class:`~jaxpaged.engine.engine.Engine` and
:class:`~jaxpaged.engine.data_parallel.DataParallelEngine` both satisfy it
(``tests/test_engine_protocol.py``), so a caller typed against it never reaches into either.
vLLM draws the same line with ``vllm/engine/protocol.py``'s ``EngineClient``.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from jaxpaged.config import ModelConfig
from jaxpaged.core.input_processor import Prompt
from jaxpaged.lora.config import LoRAConfig
from jaxpaged.metrics.stats import EngineStats, StatLogger
from jaxpaged.outputs import RequestOutput
from jaxpaged.pooling_params import PoolingParams
from jaxpaged.sampling_params import SamplingParams


@dataclass(frozen=True)
class ModelInfo:
    """The served model as its callers see it, fixed once the engine is built.

    Attributes:
        model_config: the model's shape and numerics (``config.json``).
        max_model_len: the longest sequence (prompt + output, tokens) a request may have.
        eos_token_ids: the ids that end generation (``config.json``, ``generation_config.json``
            and the tokenizer's EOS, merged).
        generation_defaults: ``generation_config.json``'s default sampling fields, by
            ``SamplingParams`` name (read-only).
    """

    model_config: ModelConfig
    max_model_len: int
    eos_token_ids: frozenset[int]
    generation_defaults: Mapping[str, Any]

    def __post_init__(self) -> None:
        object.__setattr__(self, "eos_token_ids", frozenset(self.eos_token_ids))
        object.__setattr__(self, "generation_defaults",
                           types.MappingProxyType(dict(self.generation_defaults)))

    @property
    def vocab_size(self) -> int:
        """Rows of the model's embedding (token ids are in ``[0, vocab_size)``)."""
        return self.model_config.vocab_size

    @property
    def hidden_size(self) -> int:
        """The model's hidden size (an embedding's length)."""
        return self.model_config.hidden_size


@runtime_checkable
class EngineClient(Protocol):
    """What callers use of an engine: requests in, outputs out, statistics.

    Attributes:
        model_info: the served model (:class:`ModelInfo`).
        tokenizer: the model's tokenizer (a ``transformers`` tokenizer).
        stat_loggers: called with each step's statistics (append to add one).
        lora_config: the LoRA limits (``--max-lora-rank``, ...) when LoRA is enabled
            (``--enable-lora``), else None: what an adapter is checked against before it is
            loaded (``server/serving_models.py``).
        fault_injector: a test hook, None in normal use: called before every model step as
            ``fault_injector(step_index, request_ids)``; what it raises fails that step
            (``Engine``'s attribute; a data-parallel engine hands it to every replica).
    """

    model_info: ModelInfo
    tokenizer: Any
    stat_loggers: list[StatLogger]
    lora_config: LoRAConfig | None
    fault_injector: Callable[[int, list[str]], None] | None

    def add_request(self, request_id: str, prompt: Prompt,
                    params: SamplingParams | PoolingParams | None = None,
                    priority: int = 0, lora_request=None) -> None:
        """Queue a request (``Engine.add_request``)."""

    def abort_request(self, request_id: str | list[str]) -> None:
        """Stop requests now; unknown ids are ignored."""

    def step(self) -> list[RequestOutput]:
        """Run one scheduling iteration and model step; the outputs it produced."""

    def has_unfinished_requests(self) -> bool:
        """True while any request is waiting or running."""

    def get_num_unfinished_requests(self) -> int:
        """Requests waiting or running."""

    def get_num_waiting_seqs(self) -> int:
        """Sequences waiting to be scheduled."""

    def wait_until_compiled(self, timeout: float | None = None) -> bool:
        """Wait for the step programs compiling in the background; False on timeout."""

    def start_background_compile(self) -> None:
        """Start the background step compilations held back for a server's warm-up."""

    def record_stats(self) -> None:
        """Hand the statistics since the last call to :attr:`stat_loggers`."""

    def stats(self) -> EngineStats:
        """The engine's counters and gauges now."""

    @property
    def num_preemptions(self) -> int:
        """Preemptions since start-up."""

    def device_memory_used(self) -> dict[str, int]:
        """Bytes in use on each of the engine's devices."""
