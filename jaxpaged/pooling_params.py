"""Pooling (embedding) requests: `PoolingParams`, `PoolerConfig`, and which runner a model gets.

vLLM's names (``vllm/pooling_params.py``, ``vllm/config/pooler.py``, the ``--runner`` /
``--convert`` / ``--pooler-config`` flags of ``vllm serve``): an engine runs a model either for
generation (``runner="generate"``, the default for the ``*ForCausalLM`` checkpoints jaxpaged
loads) or for pooling (``runner="pooling"``, or ``convert="embed"``, which adapts a decoder to
an embedding model). A pooling engine answers only embedding requests and a generating engine
only generation requests, one task per engine as in vLLM.

Pooling (``jaxpaged.engine.pooling``) reduces the final hidden states (after the model's final
norm) of the prompt's tokens to one vector: ``LAST`` (the last token; vLLM's default for
decoder embedding models) or ``MEAN`` (the average over every prompt token), then L2-normalises
it unless ``normalize`` is false. The pooling type comes from, in order: ``pooler_config`` (the
``--pooler-config`` override), the checkpoint's sentence-transformers files (``modules.json``
naming a ``sentence_transformers.models.Pooling`` module, whose ``config.json`` sets
``pooling_mode_mean_tokens`` / ``pooling_mode_lasttoken``; normalisation when a
``sentence_transformers.models.Normalize`` module is listed), else ``LAST`` with normalisation.
Pure Python (no JAX).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

#: ``--runner`` choices.
RUNNERS = ("auto", "generate", "pooling")
#: ``--convert`` choices (``embed``: run a decoder as an embedding model).
CONVERTS = ("auto", "none", "embed")
#: Pooling types this engine computes (vLLM's ``PoolingType`` names). ``CLS`` (the first
#: token) is an encoder's convention and is refused for these decoder-only models.
POOLING_TYPES = ("LAST", "MEAN")

_ST_POOLING = "sentence_transformers.models.Pooling"
_ST_NORMALIZE = "sentence_transformers.models.Normalize"


@dataclass(frozen=True, kw_only=True)
class PoolerConfig:
    """How a pooling engine reduces a prompt's hidden states to its embedding.

    Attributes:
        pooling_type: ``"LAST"`` or ``"MEAN"`` (see the module docstring).
        normalize: L2-normalise the pooled vector (vLLM's embedding default: True).

    Raises:
        ValueError: an unknown or unsupported pooling type.
    """

    pooling_type: str = "LAST"
    normalize: bool = True

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooler_config.pooling_type must be one of {POOLING_TYPES} "
                             f"(decoder models), got {self.pooling_type!r}")
        if not isinstance(self.normalize, bool):
            raise ValueError(f"pooler_config.normalize must be true or false, "
                             f"got {self.normalize!r}")

    @classmethod
    def parse(cls, value: str | dict | PoolerConfig | None) -> PoolerConfig | None:
        """A config from ``--pooler-config``'s JSON text (``'{"pooling_type": "MEAN"}'``), a
        dict of the same keys, or a config; None stays None.

        Raises:
            ValueError: invalid JSON, unknown keys, or bad values.
        """
        if value is None or isinstance(value, PoolerConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"pooler_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"pooler_config must be a JSON object, got {value!r}")
        unknown = set(value) - {"pooling_type", "normalize"}
        if unknown:
            raise ValueError(f"pooler_config has unknown keys {sorted(unknown)}; it takes "
                             "pooling_type and normalize")
        value = dict(value)
        if isinstance(value.get("pooling_type"), str):
            value["pooling_type"] = value["pooling_type"].upper()
        return cls(**value)


def sentence_transformers_config(model_dir: str) -> PoolerConfig | None:
    """The pooling a sentence-transformers checkpoint declares (``modules.json`` and its
    Pooling module's ``config.json``), or None when it has no such files (or ``model_dir``
    is a file, e.g. a GGUF).

    Raises:
        ValueError: the files are unreadable, or declare a pooling this engine lacks.
    """
    path = os.path.join(model_dir, "modules.json")
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            modules = json.load(f)
        pooling = next((m for m in modules if m.get("type") == _ST_POOLING), None)
        if pooling is None:
            return None
        with open(os.path.join(model_dir, pooling.get("path", ""), "config.json")) as f:
            settings = json.load(f)
    except (OSError, json.JSONDecodeError, AttributeError, TypeError) as e:
        raise ValueError(f"unreadable sentence-transformers files in {model_dir!r}: {e}") from e
    modes = [name for key, name in (("pooling_mode_lasttoken", "LAST"),
                                    ("pooling_mode_mean_tokens", "MEAN"))
             if settings.get(key)]
    others = [k for k, v in settings.items() if k.startswith("pooling_mode_") and v
              and k not in ("pooling_mode_lasttoken", "pooling_mode_mean_tokens")]
    if len(modes) != 1 or others:
        raise ValueError(f"{model_dir!r} declares pooling {modes + others}; this engine "
                         f"pools with exactly one of {POOLING_TYPES}")
    return PoolerConfig(pooling_type=modes[0],
                        normalize=any(m.get("type") == _ST_NORMALIZE for m in modules))


def resolve_pooler(model_dir: str, runner: str, convert: str,
                   pooler_config: str | dict | PoolerConfig | None) -> PoolerConfig | None:
    """The pooler of an engine with these flags, or None for a generating engine.

    ``runner="auto"`` is ``pooling`` when ``convert="embed"`` or a pooler config is given,
    else ``generate`` (every architecture jaxpaged loads is a ``*ForCausalLM``).

    Raises:
        ValueError: unknown choices, ``convert="embed"`` or a pooler config with
            ``runner="generate"``, or a bad pooler config.
    """
    if runner not in RUNNERS:
        raise ValueError(f"EngineArgs.runner must be one of {RUNNERS}, got {runner!r}")
    if convert not in CONVERTS:
        raise ValueError(f"EngineArgs.convert must be one of {CONVERTS}, got {convert!r}")
    override = PoolerConfig.parse(pooler_config)
    wants_pooling = convert == "embed" or override is not None
    if runner == "generate" and wants_pooling:
        raise ValueError("EngineArgs.convert=embed and EngineArgs.pooler_config need "
                         "EngineArgs.runner=pooling (or auto), not generate")
    if runner == "generate" or (runner == "auto" and not wants_pooling):
        return None
    return override or sentence_transformers_config(model_dir) or PoolerConfig()


@dataclass(frozen=True, kw_only=True)
class PoolingParams:
    """Per-request pooling parameters (vLLM's ``PoolingParams`` for the ``embed`` task).

    Attributes:
        dimensions: Matryoshka output size; no model this engine loads is trained for it,
            so any value is refused when the request is added (vLLM refuses it for models
            without ``is_matryoshka``).
        normalize: L2-normalise this request's embedding (None: the pooler config's).
    """

    dimensions: int | None = None
    normalize: bool | None = None
