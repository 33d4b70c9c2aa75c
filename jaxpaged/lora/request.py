"""`LoRARequest`: which adapter a request runs with (vLLM's ``vllm.lora.request.LoRARequest``)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class LoRARequest:
    """A PEFT adapter to apply to one request.

    Attributes:
        lora_name: the adapter's name (what ``model`` names over HTTP; part of the
            prefix-cache hash, so the same prompt under two adapters never shares KV).
        lora_int_id: a positive integer unique per adapter (0 is the base model).
        lora_path: the PEFT directory (``adapter_config.json``, ``adapter_model.safetensors``).
        base_model_name: the served model the adapter belongs to (``/v1/models``' ``parent``;
            None: the first served name).

    Raises:
        ValueError: ``lora_int_id`` < 1, or an empty name or path.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) \
                or self.lora_int_id < 1:
            raise ValueError(f"LoRARequest.lora_int_id must be an integer > 0, got "
                             f"{self.lora_int_id!r}")
        if not self.lora_name:
            raise ValueError("LoRARequest.lora_name must not be empty")
        if not self.lora_path:
            raise ValueError("LoRARequest.lora_path must not be empty")

    @property
    def adapter_id(self) -> int:
        """vLLM's alias of :attr:`lora_int_id`."""
        return self.lora_int_id
