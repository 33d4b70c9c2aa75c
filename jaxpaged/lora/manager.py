"""`LoRAManager`: the engine's adapters (vLLM's ``add_lora`` / ``remove_lora`` /
``list_loras`` and the per-request check). Pure Python; the device side is
``jaxpaged.lora.device``."""

from __future__ import annotations

from jaxpaged.config import ModelConfig
from jaxpaged.lora.cache import AdapterCache
from jaxpaged.lora.config import LoRAConfig
from jaxpaged.lora.request import LoRARequest
from jaxpaged.lora.scheduling import LoRAScheduling


class LoRANotEnabledError(ValueError):
    """A LoRA request to an engine started without ``enable_lora``."""


class LoRAManager:
    """Host state of multi-LoRA serving.

    Args:
        config: the LoRA limits; model_config: the base model.

    Attributes:
        cache: loaded adapters (host LRU); scheduling: the scheduler's slot rules.
    """

    def __init__(self, config: LoRAConfig, model_config: ModelConfig):
        self.config = config
        self.cache = AdapterCache(config, model_config)
        self.scheduling = LoRAScheduling(self.cache)

    @staticmethod
    def check_request(manager: LoRAManager | None, lora_request) -> None:
        """Check a request's ``lora_request`` (None: the base model) and load its adapter.

        Raises:
            TypeError: not a :class:`LoRARequest`.
            LoRANotEnabledError: the engine has no LoRA support (``manager`` is None).
            LoRAAdapterError / UnsupportedLoRATargetError: the adapter does not load.
        """
        if lora_request is None:
            return
        if not isinstance(lora_request, LoRARequest):
            raise TypeError(f"lora_request must be a LoRARequest, got "
                            f"{type(lora_request).__name__}")
        if manager is None:
            raise LoRANotEnabledError(f"LoRA adapter {lora_request.lora_name!r} requested but "
                                      "LoRA is not enabled; start the engine with "
                                      "enable_lora=True (--enable-lora)")
        manager.cache.get(lora_request)

    def remove(self, lora_int_id: int, running) -> bool:
        """Forget an adapter (vLLM's ``remove_lora``); requests still running with it
        finish with it. False if it was not loaded."""
        self.scheduling.forget(lora_int_id, running)
        return self.cache.remove(lora_int_id)

    def list(self) -> set[int]:
        """``lora_int_id`` of the adapters loaded on the host."""
        return self.cache.ids()
