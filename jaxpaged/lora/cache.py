"""`AdapterCache`: the host's LRU of loaded adapters (vLLM's ``--max-cpu-loras``). Pure Python."""

from __future__ import annotations

from collections import OrderedDict

from jaxpaged.config import ModelConfig
from jaxpaged.lora.config import LoRAConfig
from jaxpaged.lora.peft import LoRAAdapter, load_adapter
from jaxpaged.lora.request import LoRARequest


class AdapterCache:
    """Loaded adapters by ``lora_int_id``, at most ``config.cpu_capacity`` of them (the least
    recently used is dropped first; it is read from disk again when asked for).

    Args:
        config: the engine's LoRA limits.
        model_config: the base model (adapters are checked against it).
    """

    def __init__(self, config: LoRAConfig, model_config: ModelConfig):
        self.config = config
        self.model_config = model_config
        self._loaded: OrderedDict[int, LoRAAdapter] = OrderedDict()
        #: Times an adapter was read from disk (a test of the LRU).
        self.num_loads = 0

    def get(self, request: LoRARequest) -> LoRAAdapter:
        """The adapter of ``request``, read now unless cached (and marked most recent).

        Raises:
            LoRAAdapterError / UnsupportedLoRATargetError: as
                :func:`jaxpaged.lora.peft.load_adapter`; ValueError: another adapter was
                loaded under the same ``lora_int_id`` with a different name or path.
        """
        adapter = self._loaded.get(request.lora_int_id)
        if adapter is not None:
            if (adapter.name, adapter.path) != (request.lora_name, request.lora_path):
                raise ValueError(f"lora_int_id {request.lora_int_id} is already used by "
                                 f"adapter {adapter.name!r} ({adapter.path})")
            self._loaded.move_to_end(request.lora_int_id)
            return adapter
        adapter = load_adapter(request, self.model_config, self.config.max_lora_rank)
        self.num_loads += 1
        self._loaded[request.lora_int_id] = adapter
        while len(self._loaded) > self.config.cpu_capacity:
            self._loaded.popitem(last=False)
        return adapter

    def remove(self, lora_int_id: int) -> bool:
        """Drop an adapter; False if it was not loaded."""
        return self._loaded.pop(lora_int_id, None) is not None

    def ids(self) -> set[int]:
        """``lora_int_id`` of every loaded adapter."""
        return set(self._loaded)
