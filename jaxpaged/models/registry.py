"""Which model class serves each ``config.json`` architecture.

Llama, Mistral, Qwen2, Qwen3, Phi-3 and SmolLM3 checkpoints share one module
(:mod:`jaxpaged.models.llama`): their differences (RoPE scaling, sliding windows, q/k/v
biases, q/k norms, LongRoPE, layers without RoPE) are settings of
:class:`jaxpaged.config.ModelConfig` and its ``family`` (:mod:`jaxpaged.family_settings`). Families with other block structures have their own
small modules built from the same layers.
"""

from __future__ import annotations

from jaxpaged.config import UnsupportedModelError
from jaxpaged.models.gemma2 import Gemma2ForCausalLM
from jaxpaged.models.gemma3 import Gemma3ForCausalLM
from jaxpaged.models.gpt_oss import GptOssForCausalLM
from jaxpaged.models.granite import GraniteForCausalLM
from jaxpaged.models.llama import LlamaForCausalLM
from jaxpaged.models.mixtral import MixtralForCausalLM
from jaxpaged.models.olmo2 import Olmo2ForCausalLM
from jaxpaged.models.qwen3_moe import Qwen3MoeForCausalLM
from jaxpaged.models.qwen3_next import Qwen3NextForCausalLM

#: Keys: every name in :data:`jaxpaged.config.SUPPORTED_ARCHITECTURES`.
MODEL_CLASSES = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Phi3ForCausalLM": LlamaForCausalLM,          # fused tensors: models.checkpoint_names
    "Olmo2ForCausalLM": Olmo2ForCausalLM,
    "SmolLM3ForCausalLM": LlamaForCausalLM,       # NoPE layers: FamilySettings.layer_rope
    "GraniteForCausalLM": GraniteForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
    "Qwen3NextForCausalLM": Qwen3NextForCausalLM,   # recurrent layers: layers.recurrent_pool
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
