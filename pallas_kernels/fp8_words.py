"""fp8 (e4m3) KV tiles widened to float16 through 32-bit words (issue 41, item 1).

Why. Compiled for sm_90 (Triton 3.9, Llama-3-8B shapes, 32-key decode tiles), converting an
fp8 tile to float16 with a plain ``astype`` let Triton convert it *in the MMA operand
layout*: V's operand pairs keys (rows of the tile, not adjacent in memory) and sm_90 has no
8-bit transposing ``ldmatrix``, so V left shared memory one byte at a time (32 ``LDS.U8`` a
tile) and K's bytes were rearranged by ~76 register moves (``IMAD.MOV``): a 476-instruction
loop, 60 a KiB of K/V against bf16's 18.

What :func:`widen_e4m3_tile` does instead. It packs each run of four bytes of a key (four
values along the head dimension) into a ``uint32`` word, then takes the bytes back out of the
words with shifts and masks and converts them. The word step is a reduction over groups of
four, which Triton cannot push the MMA layout through: the tile leaves shared memory in
16-byte loads (``LDS.128``), LLVM folds the packing and unpacking to nothing, each pair of
bytes becomes an f16 pair in one ``F2FP.F16.E4M3.UNPACK_B``, and the float16 tile reaches
its MMA through shared memory and ``ldmatrix`` (transposing for V, which 16-bit elements
allow). The decode loop is then 270 instructions a tile (34 a KiB), 105 registers, no stack
at 4 warps (``jaxpaged.benchmarks.kernels.schedule_check``; the kernel launches 2,
``pallas_kernels.paged_attention.DECODE_WARPS_FP8``).

Alternatives measured (same compiler, decode loop a 32-key tile):

- The pool bitcast to ``uint32`` outside the kernel (``lax.bitcast_convert_type`` of
  ``[..., D // 4, 4]``): 268 instructions, but XLA expands a bitcast between dtypes of
  different widths (its ``BitcastDtypesExpander`` pass, on CPU and GPU alike) into a fusion
  that rewrites the whole pool on every call. Pallas' Triton lowering has no in-kernel
  bitcast between widths (``bitcast_convert_type``) or ref bitcast to widen with.
- Widening words by integer arithmetic instead of the conversion instruction (an e4m3 byte
  ``b`` is the float16 ``((b & 0x80) << 8) | ((b & 0x7f) << 7)`` times ``2**8``): about
  seven instructions a word where ``F2FP`` takes two (V alone so: 334 against 309).
- Building the words with joins and splits instead of a reduction: Triton carried the MMA
  layout back through them (370 instructions, 80 register moves).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

#: e4m3 values per 32-bit word.
PER_WORD = 4


def widen_e4m3_tile(tile: jax.Array) -> jax.Array:
    """``[S, D]`` float8_e4m3fn -> ``[S, D]`` float16, exactly (every e4m3 value, subnormals
    included, is a float16; NaN stays NaN), through 32-bit words (see the module docstring).

    Plain jnp (interpret mode runs it as written); lowers with Pallas' Triton backend. A
    ``D`` that is not a multiple of 4 (test sizes only) is converted directly.
    """
    rows, cols = tile.shape
    if cols % PER_WORD:
        return tile.astype(jnp.float16)
    u8 = jax.lax.bitcast_convert_type(tile, jnp.uint8).astype(jnp.uint32)
    shifts = jax.lax.broadcasted_iota(jnp.uint32, (1, 1, PER_WORD), 2) * jnp.uint32(8)
    words = jnp.sum(u8.reshape(rows, cols // PER_WORD, PER_WORD) << shifts, axis=-1,
                    dtype=jnp.uint32)                         # byte i of word j: value 4j + i
    values = [jax.lax.bitcast_convert_type(
        ((words >> jnp.uint32(8 * i)) & jnp.uint32(0xFF)).astype(jnp.uint8),
        jnp.float8_e4m3fn) for i in range(PER_WORD)]
    # stack(stack(v0, v2), stack(v1, v3)) is [..., 2, 2] holding value 2 * inner + outer:
    # the reshape puts bytes 0, 1, 2, 3 of word j in columns 4j .. 4j + 3.
    quad = jnp.stack([jnp.stack([values[0], values[2]], axis=-1),
                      jnp.stack([values[1], values[3]], axis=-1)], axis=-1)
    return quad.reshape(rows, cols).astype(jnp.float16)
