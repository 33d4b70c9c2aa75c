"""`EngineArgs`: every engine setting, and the one argparse parser for them.

Flag names follow vLLM's CLI (``--model``, ``--block-size``, ``--max-num-seqs``, ...) so that
commands written for ``vllm`` carry over. ``jaxpaged generate`` and ``jaxpaged serve`` both
build their parsers with :meth:`EngineArgs.add_cli_args`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass

#: The model shipped inside the package (stories260K, MIT licence); the default ``--model``.
DEFAULT_MODEL = os.path.join(os.path.dirname(os.path.dirname(__file__)), "model_files",
                             "stories260K")

DTYPES = ("auto", "float32", "bfloat16")
#: ``--attention-backend`` choices (see ``jaxpaged.layers.attention.selection``).
ATTENTION_BACKENDS = ("auto", "xla", "pallas")


@dataclass
class EngineArgs:
    """Engine configuration (vLLM's names).

    Attributes:
        model: Hugging Face model directory (default: the bundled stories260K).
        tokenizer: tokenizer directory (default: ``model``).
        dtype: ``float32``, ``bfloat16`` or ``auto`` (the checkpoint's ``torch_dtype``:
            float32 stays float32, 16-bit floats become bfloat16, unspecified is float32).
        load_format: ``auto`` (safetensors) or ``dummy`` (random weights).
        seed: engine seed; requests without a ``seed`` draw theirs from it.
        block_size: tokens per KV page.
        max_model_len: longest prompt + output (default: the model's trained context).
        max_num_seqs: most requests in one step.
        max_num_batched_tokens: most tokens in one step (longer prompts are chunked).
        num_gpu_blocks_override: exact KV page count (null page included); overrides budgets.
        kv_cache_memory_bytes: KV pool budget in bytes (sets the page count).
        attention_backend: ``xla``, ``pallas`` or ``auto`` (pallas on a GPU after a
            self-check, else xla).
    """

    model: str = DEFAULT_MODEL
    tokenizer: str | None = None
    dtype: str = "auto"
    load_format: str = "auto"
    seed: int = 0
    block_size: int = 16
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    num_gpu_blocks_override: int | None = None
    kv_cache_memory_bytes: int | None = None
    attention_backend: str = "auto"

    def __post_init__(self) -> None:
        def positive(name):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"EngineArgs.{name} must be a positive integer, got {value!r}")

        for name in ("block_size", "max_model_len", "max_num_seqs", "max_num_batched_tokens",
                     "num_gpu_blocks_override", "kv_cache_memory_bytes"):
            positive(name)
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"EngineArgs.block_size must be a power of two, got {self.block_size}")
        if self.dtype not in DTYPES:
            raise ValueError(f"EngineArgs.dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"EngineArgs.attention_backend must be one of {ATTENTION_BACKENDS}, "
                             f"got {self.attention_backend!r}")

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """Add the engine flags (vLLM spelling) to ``parser``."""
        d = EngineArgs()
        g = parser.add_argument_group("engine")
        g.add_argument("--model", default=d.model,
                       help="Hugging Face model directory (default: the bundled stories260K)")
        g.add_argument("--tokenizer", default=None, help="tokenizer directory (default: --model)")
        g.add_argument("--dtype", default=d.dtype, choices=DTYPES)
        g.add_argument("--load-format", default=d.load_format, choices=("auto", "safetensors", "dummy"))
        g.add_argument("--seed", type=int, default=d.seed,
                       help="engine seed: requests without their own seed draw one from it")
        g.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV page")
        g.add_argument("--max-model-len", type=int, default=None)
        g.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
        g.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
        g.add_argument("--num-gpu-blocks-override", type=int, default=None,
                       help="exact number of KV pages (overrides the memory budget)")
        g.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                       help="KV pool size in bytes")
        g.add_argument("--attention-backend", default=d.attention_backend,
                       choices=ATTENTION_BACKENDS,
                       help="auto: pallas on a GPU after a self-check, else xla")
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineArgs":
        """Build from a namespace parsed with :meth:`add_cli_args`' flags."""
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})
