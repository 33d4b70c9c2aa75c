"""Which model class serves each ``config.json`` architecture.

Llama, Mistral, Qwen2 and Qwen3 checkpoints share one module (:mod:`jaxpaged.models.llama`):
their differences (RoPE scaling, sliding windows, q/k/v biases, q/k norms) are settings of
:class:`jaxpaged.config.ModelConfig`. Families with other block structures have their own
small modules built from the same layers.
"""

from __future__ import annotations

from jaxpaged.config import UnsupportedModelError
from jaxpaged.models.gemma2 import Gemma2ForCausalLM
from jaxpaged.models.llama import LlamaForCausalLM
from jaxpaged.models.mixtral import MixtralForCausalLM

#: Keys: every name in :data:`jaxpaged.config.SUPPORTED_ARCHITECTURES`.
MODEL_CLASSES = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
}


def model_class(architecture: str):
    """The Flax module class for ``architecture``.

    Raises:
        UnsupportedModelError: no class serves it.
    """
    cls = MODEL_CLASSES.get(architecture)
    if cls is None:
        raise UnsupportedModelError(f"no model class for architecture {architecture!r}")
    return cls
