"""LoRA-aware projections: a base projection plus per-token adapter deltas from stacked slots.

Each adapted projection holds ``lora_a`` [S, d_in, r] and ``lora_b`` [S, r, d_out] (S =
``max_loras + 1``; slot 0 stays zeros, the base model) and adds, for token t of adapter slot
s_t, ``(x_t @ A[s_t]) @ B[s_t]`` (Hu et al., "LoRA: Low-Rank Adaptation of Large Language
Models", 2021, eq. 3; the scaling ``alpha / r`` is folded into B when an adapter is written).

The per-token slot index is a traced [T] int32 array the step sets around the model call
(:func:`lora_token_slots`), as vLLM's Punica wrapper gives every LoRA layer the batch's token
-> adapter mapping before the forward (``vllm/lora/punica_wrapper``); outside that context
(a scratch prefill) the projection is the base alone.

Shrink and expand are dense matmuls against every adapter slot with a one-hot mask, not a
gather of per-token weights or ``jax.lax.ragged_dot`` over slot-sorted rows: on the CPU this
was the fastest of the three (figures in ``docs/lora.md``), its cost is ``max_loras`` times a
rank-r LoRA and needs no sort or scatter, and every shape is fixed by (T, S, r), so mixing or
swapping adapters never recompiles.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax
import jax.numpy as jnp
from flax import nnx

_TOKEN_SLOTS: contextvars.ContextVar = contextvars.ContextVar("lora_token_slots", default=None)


class LoRAWeight(nnx.Param):
    """Stacked adapter slots of one projection: ``lora_a`` [S, d_in, r] or ``lora_b``
    [S, r, d_out], float32 or the model's dtype; written by ``jaxpaged.lora.device``."""


@contextlib.contextmanager
def lora_token_slots(slots: jax.Array | None):
    """Within the block, every :class:`LoRALinear` applies token t's adapter slot
    ``slots[t]`` ([T] int32, 0 = base). ``None``: no adapters (the base projections)."""
    token = _TOKEN_SLOTS.set(slots)
    try:
        yield
    finally:
        _TOKEN_SLOTS.reset(token)


def lora_delta(x: jax.Array, slots: jax.Array, a: jax.Array, b: jax.Array) -> jax.Array:
    """The adapters' contribution to a projection of a mixed batch.

    Args:
        x: [T, d_in] inputs; slots: [T] int32 each token's slot in [0, S).
        a: [S, d_in, r]; b: [S, r, d_out] (scaling folded in); slot 0 is the base (zeros,
            and skipped here).

    Returns:
        [T, d_out] in x's dtype: ``x[t] @ a[slots[t]] @ b[slots[t]]``.
    """
    a, b = a[1:].astype(x.dtype), b[1:].astype(x.dtype)
    n, _, r = a.shape
    shrunk = jnp.einsum("td,sdr->tsr", x, a)                                  # [T, S-1, r]
    mine = slots[:, None] == jnp.arange(1, n + 1, dtype=slots.dtype)[None]    # [T, S-1]
    shrunk = jnp.where(mine[:, :, None], shrunk, 0).reshape(x.shape[0], n * r)
    return shrunk @ b.reshape(n * r, b.shape[-1])


class LoRALinear(nnx.Module):
    """A projection ``base`` (dense, 8-bit or AWQ) with stacked adapter slots.

    Args:
        base: the wrapped projection module ([T, d_in] -> [T, d_out]).
        a: [S, d_in, r] initial ``lora_a`` (zeros); b: [S, r, d_out] initial ``lora_b``.
    """

    def __init__(self, base: nnx.Module, a: jax.Array, b: jax.Array):
        self.base = base
        self.lora_a = LoRAWeight(a)
        self.lora_b = LoRAWeight(b)

    def __call__(self, x: jax.Array) -> jax.Array:
        """x: [T, d_in] -> [T, d_out]: the base projection plus each token's adapter."""
        y = self.base(x)
        slots = _TOKEN_SLOTS.get()
        if slots is None:
            return y
        return y + lora_delta(x, slots, self.lora_a[...], self.lora_b[...]).astype(y.dtype)
