"""`LoRAConfig`: the engine's LoRA limits (vLLM's ``vllm.config.LoRAConfig``), and their flags."""

from __future__ import annotations

import argparse
from dataclasses import dataclass


class LoRAConfigError(ValueError):
    """A LoRA engine setting out of range (the message names the field)."""


@dataclass(frozen=True)
class LoRAConfig:
    """Limits of multi-LoRA serving.

    Attributes:
        max_loras: distinct adapters one step may run (device slots besides the base's
            slot 0); vLLM's default 1.
        max_lora_rank: the largest adapter rank accepted; every slot is padded to it.
        max_cpu_loras: adapters kept loaded on the host (LRU); None: ``max_loras``.

    Raises:
        LoRAConfigError: a non-positive value, or ``max_cpu_loras < max_loras``.
    """

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank", "max_cpu_loras"):
            value = getattr(self, name)
            if value is None and name == "max_cpu_loras":
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise LoRAConfigError(f"EngineArgs.{name} must be a positive integer, got "
                                      f"{value!r}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise LoRAConfigError(f"EngineArgs.max_cpu_loras ({self.max_cpu_loras}) must be >= "
                                  f"max_loras ({self.max_loras})")

    @property
    def num_slots(self) -> int:
        """Device slots per target layer: ``max_loras`` plus slot 0 (zeros: the base)."""
        return self.max_loras + 1

    @property
    def cpu_capacity(self) -> int:
        """Adapters the host LRU keeps (``max_cpu_loras``, else ``max_loras``)."""
        return self.max_cpu_loras or self.max_loras

    @classmethod
    def from_engine_args(cls, args) -> "LoRAConfig | None":
        """The config of an :class:`~jaxpaged.arg_utils.EngineArgs` (None unless
        ``enable_lora``)."""
        if not args.enable_lora:
            return None
        return cls(args.max_loras, args.max_lora_rank, args.max_cpu_loras)


def add_lora_cli_args(parser: argparse.ArgumentParser) -> None:
    """The engine's LoRA flags (vLLM's spelling and defaults)."""
    g = parser.add_argument_group("LoRA")
    g.add_argument("--enable-lora", action="store_true",
                   help="serve PEFT LoRA adapters over the base model (docs/lora.md)")
    g.add_argument("--max-loras", type=int, default=1,
                   help="most distinct adapters in one step (device slots)")
    g.add_argument("--max-lora-rank", type=int, default=16,
                   help="largest adapter rank accepted (slots are padded to it)")
    g.add_argument("--max-cpu-loras", type=int, default=None,
                   help="adapters kept loaded on the host, LRU (default: --max-loras)")
