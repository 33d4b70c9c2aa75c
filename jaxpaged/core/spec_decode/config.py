"""`SpeculativeConfig`: ``--speculative-config JSON`` / ``LLM(speculative_config={...})``.

Field names are vLLM's (``vllm/config/speculative.py``): ``method``, ``num_speculative_tokens``,
``prompt_lookup_max``, ``prompt_lookup_min`` and, for a draft model, ``model``:
``method="ngram"`` proposes by prompt lookup (``jaxpaged.core.spec_decode.ngram``),
``method="draft_model"`` by a smaller model's greedy tokens
(``jaxpaged.spec_decode.draft_model``). Pure Python.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

#: The methods a config may name.
METHODS = ("ngram", "draft_model")
_FIELDS = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
           "model", "disable_by_batch_size"}


class SpeculativeConfigError(ValueError):
    """A speculative config that cannot be used; ``field`` names the offending key."""

    def __init__(self, field: str, message: str):
        super().__init__(f"speculative_config.{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class SpeculativeConfig:
    """A validated speculative-decoding configuration.

    Attributes:
        method: ``"ngram"`` or ``"draft_model"``.
        num_speculative_tokens: k, the most tokens proposed per sequence per step (>= 1).
        prompt_lookup_max: the longest n-gram matched against the sequence's earlier tokens
            (``ngram``; 0 for ``draft_model``).
        prompt_lookup_min: the shortest (1 <= min <= max; 0 for ``draft_model``).
        disable_by_batch_size: a step with more running sequences than this does not
            speculate (vLLM's field); None: every step may.
        model: the draft model's directory or GGUF file (``draft_model`` only, else None).
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int
    prompt_lookup_min: int
    disable_by_batch_size: int | None = None
    model: str | None = None

    @classmethod
    def from_dict(cls, value: dict | str | None) -> SpeculativeConfig | None:
        """Validate ``value`` (a dict, or its JSON text; None: no speculation).

        Defaults as vLLM's ``SpeculativeConfig``: a missing ``prompt_lookup_min`` takes
        ``prompt_lookup_max`` and the other way round; with neither, both are 5.

        Raises:
            SpeculativeConfigError: an unknown key, a missing or ill-typed field, an
                unknown method, ``prompt_lookup_min > prompt_lookup_max``, a
                ``draft_model`` without a ``model`` path that exists, or with n-gram fields.
        """
        if value is None:
            return None
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise SpeculativeConfigError("<json>", f"not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise SpeculativeConfigError("<config>", f"must be a JSON object, got "
                                         f"{type(value).__name__}")
        unknown = sorted(set(value) - _FIELDS)
        if unknown:
            raise SpeculativeConfigError(unknown[0], f"unknown field; known: {sorted(_FIELDS)}")
        method = value.get("method")
        if method not in METHODS:
            raise SpeculativeConfigError("method", f"must be one of {list(METHODS)}, got "
                                         f"{method!r}")
        k = _positive(value, "num_speculative_tokens", required=True)
        disable_by = _positive(value, "disable_by_batch_size")
        if method == "draft_model":
            model = value.get("model")
            if not isinstance(model, str) or not model:
                raise SpeculativeConfigError("model", "draft_model needs the draft model's "
                                             "path")
            if not os.path.exists(model):
                raise SpeculativeConfigError("model", f"no draft model at {model!r}")
            for name in ("prompt_lookup_max", "prompt_lookup_min"):
                if name in value:
                    raise SpeculativeConfigError(name, "only method 'ngram' takes it")
            return cls(method, k, 0, 0, disable_by, model)
        if "model" in value:
            raise SpeculativeConfigError("model", "only method 'draft_model' takes a model")
        high = _positive(value, "prompt_lookup_max")
        low = _positive(value, "prompt_lookup_min")
        if high is None and low is None:
            high = low = 5
        high, low = high or low, low or high
        if low > high:
            raise SpeculativeConfigError("prompt_lookup_min", f"{low} exceeds "
                                         f"prompt_lookup_max={high}")
        return cls(method, k, high, low, disable_by)

    def check_engine(self, *, enable_lora: bool, tensor_parallel_size: int,
                     num_processes: int) -> None:
        """Refuse engine settings a draft model does not combine with (pipeline
        parallelism refuses every speculative config itself).

        Raises:
            SpeculativeConfigError: ``field="method"``, naming the ``EngineArgs`` field.
        """
        if self.method != "draft_model":
            return
        refused = [name for name, on in (
            ("enable_lora", enable_lora),
            (f"tensor_parallel_size={tensor_parallel_size}", tensor_parallel_size > 1),
            (f"num_processes={num_processes}", num_processes > 1)) if on]
        if refused:
            raise SpeculativeConfigError("method", f"draft_model cannot be combined with "
                                         f"EngineArgs.{refused[0]} (not supported)")


def _positive(value: dict, name: str, required: bool = False) -> int | None:
    v = value.get(name)
    if v is None and not required:
        return None
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise SpeculativeConfigError(name, f"must be a positive integer, got {v!r}")
    return v
