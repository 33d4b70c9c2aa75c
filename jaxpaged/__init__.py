"""jaxpaged: a JAX/Pallas LLM inference and serving engine in the spirit of vLLM.

Public API: :class:`LLM`, :class:`SamplingParams`, :class:`EngineArgs`, :class:`Engine`,
:class:`RequestOutput`, :class:`CompletionOutput`.
"""

from jaxpaged.engine.arg_utils import EngineArgs
from jaxpaged.engine.engine import Engine
from jaxpaged.entrypoints.llm import LLM
from jaxpaged.outputs import CompletionOutput, RequestOutput
from jaxpaged.sampling_params import SamplingParams

__version__ = "0.1.0"

__all__ = ["LLM", "CompletionOutput", "Engine", "EngineArgs", "RequestOutput", "SamplingParams",
           "__version__"]
