"""Pooling requests (embeddings, classification): `PoolingParams`, `PoolerConfig`, and which
runner a model gets.

vLLM's names (``vllm/pooling_params.py``, ``vllm/config/pooler.py``, the ``--runner`` /
``--convert`` / ``--pooler-config`` flags of ``vllm serve``): an engine runs a model either for
generation (``runner="generate"``, the default for the ``*ForCausalLM`` checkpoints jaxpaged
loads) or for pooling (``runner="pooling"``, or ``convert="embed"``, which adapts a decoder to
an embedding model). A pooling engine answers only pooling requests and a generating engine
only generation requests, one task per engine as in vLLM. A pooling engine's task is
``embed`` or ``classify``: a sequence-classification model (``jaxpaged.classification``: a
``*ForSequenceClassification`` checkpoint, or a generative reranker given
``hf_overrides`` ``classifier_from_token``) pools for ``classify`` (``runner="auto"`` becomes
``pooling`` for it, ``convert="classify"``, or its older name ``score``, asks for it
explicitly): its last token's hidden state goes through the classifier head
(``jaxpaged.core.classifier_head``), not normalised.

Pooling (``jaxpaged.core.pooling``) reduces the final hidden states (after the model's final
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

from jaxpaged.classification import classifier_spec, json_object, parse_hf_overrides

#: ``--runner`` choices.
RUNNERS = ("auto", "generate", "pooling")
#: ``--convert`` choices (``embed``: run a decoder as an embedding model; ``classify``, or
#: vLLM's older ``score``: as a sequence classifier).
CONVERTS = ("auto", "none", "embed", "classify", "score")
#: A pooling engine's tasks (vLLM's ``PoolingTask`` names).
POOLING_TASKS = ("embed", "classify")
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
        task: ``"embed"`` (the pooled vector is the output) or ``"classify"`` (it goes
            through the model's classifier head).

    Raises:
        ValueError: an unknown or unsupported pooling type or task.
    """

    pooling_type: str = "LAST"
    normalize: bool = True
    task: str = "embed"

    def __post_init__(self) -> None:
        if self.task not in POOLING_TASKS:
            raise ValueError(f"pooler task must be one of {POOLING_TASKS}, got {self.task!r}")
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
        value = json_object(value, "pooler_config")
        unknown = set(value) - {"pooling_type", "normalize"}
        if unknown:
            raise ValueError(f"pooler_config has unknown keys {sorted(unknown)}; it takes "
                             "pooling_type and normalize")
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


def _is_classifier(model_dir: str, hf_overrides: str | dict | None) -> bool:
    """Whether the model's ``config.json`` (with ``hf_overrides``) declares a sequence
    classifier (False when there is no such file, e.g. a GGUF).

    Raises:
        ValueError: bad ``hf_overrides`` or classifier fields.
    """
    overrides = parse_hf_overrides(hf_overrides)
    path = os.path.join(model_dir, "config.json")
    cfg = {}
    if os.path.isfile(path):
        try:
            with open(path) as f:
                cfg = json.load(f)
        except (OSError, json.JSONDecodeError):
            cfg = {}     # (the engine's own config reading names the problem)
    cfg = {**cfg, **overrides} if isinstance(cfg, dict) else overrides
    return classifier_spec(cfg) is not None


def resolve_pooler(model_dir: str, runner: str, convert: str,
                   pooler_config: str | dict | PoolerConfig | None,
                   hf_overrides: str | dict | None = None) -> PoolerConfig | None:
    """The pooler of an engine with these flags, or None for a generating engine.

    ``runner="auto"`` is ``pooling`` when ``convert`` is ``embed``/``classify``/``score``, a
    pooler config is given or the model is a sequence classifier (``config.json`` with
    ``hf_overrides``), else ``generate``. A classifier pools for ``classify`` unless
    ``convert="embed"``.

    Raises:
        ValueError: unknown choices; ``convert``, a pooler config or a classifier model with
            ``runner="generate"``; ``convert="classify"`` for a model without a classifier
            head; a bad pooler config or ``hf_overrides``.
    """
    if runner not in RUNNERS:
        raise ValueError(f"EngineArgs.runner must be one of {RUNNERS}, got {runner!r}")
    if convert not in CONVERTS:
        raise ValueError(f"EngineArgs.convert must be one of {CONVERTS}, got {convert!r}")
    override = PoolerConfig.parse(pooler_config)
    classifier = _is_classifier(model_dir, hf_overrides)
    if convert in ("classify", "score") and not classifier:
        raise ValueError(f"EngineArgs.convert={convert} needs a sequence-classification model: "
                         "a *ForSequenceClassification checkpoint, or a generative reranker "
                         "with EngineArgs.hf_overrides naming its architecture and "
                         "classifier_from_token (e.g. '{\"architectures\": "
                         "[\"Qwen3ForSequenceClassification\"], \"classifier_from_token\": "
                         "[\"no\", \"yes\"], \"is_original_qwen3_reranker\": true}')")
    wants_pooling = convert in ("embed", "classify", "score") or override is not None
    if runner == "generate" and (wants_pooling or classifier):
        raise ValueError("EngineArgs.convert, EngineArgs.pooler_config and sequence-"
                         "classification models need EngineArgs.runner=pooling (or auto), not "
                         "generate")
    if runner == "generate" or (runner == "auto" and not wants_pooling and not classifier):
        return None
    if classifier and convert != "embed":
        return PoolerConfig(pooling_type=override.pooling_type if override else "LAST",
                            normalize=False, task="classify")
    return override or sentence_transformers_config(model_dir) or PoolerConfig()


@dataclass(frozen=True, kw_only=True)
class PoolingParams:
    """Per-request pooling parameters (vLLM's ``PoolingParams``).

    Attributes:
        dimensions: Matryoshka output size; no model this engine loads is trained for it,
            so any value is refused when the request is added (vLLM refuses it for models
            without ``is_matryoshka``).
        normalize: L2-normalise this request's embedding (None: the pooler config's).
        task: ``"embed"`` or ``"classify"``; a request for another task than the engine's
            is refused when added (None: the engine's task).
        use_activation: classify: the head's sigmoid (one label) or softmax (several) on
            the logits (None or True), or the raw logits (False).
    """

    dimensions: int | None = None
    normalize: bool | None = None
    task: str | None = None
    use_activation: bool | None = None
