"""jaxpaged: a JAX/Pallas LLM inference and serving engine in the spirit of vLLM.

Public API: :class:`LLM`, :class:`SamplingParams`, :class:`EngineArgs`, :class:`Engine`,
:class:`RequestOutput`, :class:`CompletionOutput`, the pooling outputs, and the errors of
the RL surface (:class:`WeightUpdateError`, :class:`GenerationPausedError`,
:class:`WeightsNotLoadedError`, ``docs/rl.md``). They are imported on first use, so that
``import jaxpaged`` (and the command line's argument parsing) stays cheap.
"""

import importlib
from pathlib import Path

from jaxpaged import _checkout

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "jaxpaged.entrypoints.llm",
    "Engine": "jaxpaged.engine.engine",
    "EngineArgs": "jaxpaged.arg_utils",
    "SamplingParams": "jaxpaged.sampling_params",
    "RequestOutput": "jaxpaged.outputs",
    "CompletionOutput": "jaxpaged.outputs",
    "EmbeddingRequestOutput": "jaxpaged.outputs",
    "ClassificationRequestOutput": "jaxpaged.outputs",
    "ScoringRequestOutput": "jaxpaged.outputs",
    "PoolingParams": "jaxpaged.pooling_params",
    "WeightUpdateError": "jaxpaged.runner.weight_update",
    "GenerationPausedError": "jaxpaged.engine.rollout",
    "WeightsNotLoadedError": "jaxpaged.engine.sleep",
}

__all__ = [*_EXPORTS, "__version__"]

# Imported from the repository root (not from an installed copy): server/ and benchmarks/ sit
# beside this folder and are found as jaxpaged.server / jaxpaged.benchmarks (see _checkout).
_checkout.install(Path(__file__).parent)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'jaxpaged' has no attribute {name!r}")
