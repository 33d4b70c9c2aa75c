"""A ragged batch's Gated DeltaNet prefill: its sequences cut into segments and chunks, the
convolution windows of every token at once, and the chunked gated delta rule over the chunks.

A multi-token step (prefill, chunked prefill, a mixed step) holds each sequence's tokens
contiguously in the flat batch. A *segment* is a maximal run of real tokens in one state slot
that does not restart: it begins at the batch's first real token, after padding, where the
slot changes, or at a reset (a token at position 0, whose sequence starts from a zero state).
Each segment is cut into chunks of ``chunk`` tokens from its first token (the last one
shorter); a chunk starts from its slot's state (zero at a reset) and leaves the state after it
in the slot, so a chunk boundary inside a segment carries the state. The chunks run in batch
order in one ``fori_loop`` whose trip count is the step's number of chunks (static shapes, one
compiled program per step bucket); each gathers its tokens with a dynamic slice, zeroes those
past its segment's end (``g = beta = 0`` and ``k = 0`` leave the state as it is: the padding
of ``pallas_kernels.deltanet_chunk``) and writes back only its own outputs. Padding tokens
(not real) belong to no segment: their outputs are zero and the scratch slot keeps its rows.

The same arithmetic is vLLM's and flash-linear-attention's ``chunk_gated_delta_rule`` over
``cu_seqlens`` (varlen: chunks never cross a sequence boundary, initial and final states per
sequence); the chunk itself is ``pallas_kernels.deltanet_chunk`` (the WY/UT form, Yang et al.,
"Gated Delta Networks", ICLR 2025, section 3.2).

Assumes (as the engine's steps satisfy) that a slot's tokens are contiguous, or that a later
run of the same slot starts at a reset (the scratch slot of a metadata without slots).
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.deltanet_chunk import chunk_gated_delta, chunk_gated_delta_xla
from pallas_kernels.lowering import default_interpret

#: Tokens per chunk (flash-linear-attention's ``BT``; a power of two).
PREFILL_CHUNK = 64

#: ``(q [C, H, Dk], k, v [C, H, Dv], g [C, H], beta [C, H], state [H, Dk, Dv]) ->
#: (out [C, H, Dv], state)``, all float32.
ChunkFn = Callable[..., tuple[jax.Array, jax.Array]]


class Segments(NamedTuple):
    """Per-token segment facts of a flat batch of T tokens (module docstring).

    Attributes:
        first: [T] int32 index of the token's segment's first token.
        end: [T] int32 index one past the segment's last token.
        fresh: [T] bool; the segment starts from a zero state (its first token is a reset).
        final: [T] bool; the token is the last real one of its slot in the batch (it writes
            the slot's convolution state).
        chunk_starts: [T] int32 the first token of each chunk in batch order (then padding).
        num_chunks: [] int32 how many entries of ``chunk_starts`` are chunks.
    """

    first: jax.Array
    end: jax.Array
    fresh: jax.Array
    final: jax.Array
    chunk_starts: jax.Array
    num_chunks: jax.Array


def ragged_segments(slots: jax.Array, reset: jax.Array, real: jax.Array, num_slots: int,
                    chunk: int) -> Segments:
    """The segments and chunks of a flat batch.

    Args:
        slots: [T] int32 each token's state slot (in ``[0, num_slots)``).
        reset: [T] bool; the token starts its sequence from a zero state.
        real: [T] bool; False for padding tokens.
        num_slots: rows of the state arrays (slots plus the scratch row).
        chunk: tokens per chunk.
    """
    t = slots.shape[0]
    i = jnp.arange(t, dtype=jnp.int32)
    before = lambda x, fill: jnp.concatenate([jnp.full((1,), fill, x.dtype), x[:-1]])
    start = real & (~before(real, False) | (slots != before(slots, -1)) | reset)
    after = lambda x, fill: jnp.concatenate([x[1:], jnp.full((1,), fill, x.dtype)])
    last = real & (after(start, True) | ~after(real, False))
    first = jax.lax.cummax(jnp.where(start, i, 0))
    end = jax.lax.cummin(jnp.where(last, i + 1, t), reverse=True)
    latest = jnp.full(num_slots, -1, jnp.int32).at[slots].max(jnp.where(real, i, -1))
    begins = real & ((i - first) % chunk == 0)
    return Segments(first, end, reset[first], real & (latest[slots] == i),
                    jnp.nonzero(begins, size=t, fill_value=0)[0].astype(jnp.int32),
                    jnp.sum(begins, dtype=jnp.int32))


def segment_windows(mixed: jax.Array, slots: jax.Array, segments: Segments,
                    conv_state: jax.Array) -> jax.Array:
    """Every token's convolution window [T, K, C] (in ``conv_state``'s dtype): its own input
    last, before it the segment's earlier inputs, and where the segment has fewer than
    ``K - 1`` of them the slot's stored inputs (zeros for a fresh segment).

    Args:
        mixed: [T, C] the convolution's inputs.
        slots: [T] int32 state slots; segments: from :func:`ragged_segments`.
        conv_state: [S + 1, K - 1, C] each slot's last ``K - 1`` inputs (row ``K - 2`` the
            latest).
    """
    t, history = mixed.shape[0], conv_state.shape[1]
    back = jnp.arange(history, -1, -1, dtype=jnp.int32)            # tap j reads i - (K-1-j)
    source = jnp.arange(t, dtype=jnp.int32)[:, None] - back[None]   # [T, K]
    inside = source >= segments.first[:, None]
    row = jnp.clip(history - (segments.first[:, None] - source), 0, history - 1)
    stored = jnp.where(segments.fresh[:, None, None], 0, conv_state[slots[:, None], row])
    ours = mixed.astype(conv_state.dtype)[jnp.maximum(source, 0)]
    return jnp.where(inside[..., None], ours, stored)


def chunked_delta_rule(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array,
                       beta: jax.Array, slots: jax.Array, reset: jax.Array,
                       segments: Segments, ssm_state: jax.Array, chunk: int,
                       chunk_fn: ChunkFn) -> tuple[jax.Array, jax.Array]:
    """The gated delta rule over the batch's chunks, in order (module docstring).

    Args:
        q, k: [T, H, Dk]; v: [T, H, Dv]; g, beta: [T, H]; all float32 (q, k normalised).
        slots: [T] int32; reset: [T] bool; segments: from :func:`ragged_segments` with the
            same ``chunk``.
        ssm_state: [S + 1, H, Dk, Dv] float32.
        chunk: tokens per chunk; chunk_fn: one chunk's rule (:func:`chunk_function`).

    Returns:
        (out [T, H, Dv] float32, zeros for padding tokens; the updated ssm_state).
    """
    t = q.shape[0]
    pad = lambda x: jnp.concatenate([x, jnp.zeros((chunk, *x.shape[1:]), x.dtype)])
    inputs = tuple(map(pad, (q, k, v, g, beta)))
    rows = jnp.arange(chunk, dtype=jnp.int32)

    def body(j, carry):
        ssm, out = carry
        c = segments.chunk_starts[j]
        keep = rows < segments.end[c] - c
        take = lambda x: jnp.where(keep.reshape(-1, *(1,) * (x.ndim - 1)),
                                   jax.lax.dynamic_slice_in_dim(x, c, chunk), 0)
        state = jnp.where(reset[c], 0, ssm[slots[c]])
        part, state = chunk_fn(*map(take, inputs), state)
        mine = jnp.where(keep[:, None, None], part, jax.lax.dynamic_slice_in_dim(out, c, chunk))
        return ssm.at[slots[c]].set(state), jax.lax.dynamic_update_slice_in_dim(out, mine, c, 0)

    out = jnp.zeros((t + chunk, *v.shape[1:]), jnp.float32)
    ssm, out = jax.lax.fori_loop(0, segments.num_chunks, body, (ssm_state, out))
    return out[:t], ssm


def chunk_function(kernel: str, chunk: int, interpret: bool | None = None) -> ChunkFn:
    """One chunk's gated delta rule: ``"xla"`` (``chunk_gated_delta_xla``) or ``"pallas"``
    (the Pallas kernel ``chunk_gated_delta``; ``interpret`` None: on unless on a GPU).

    Raises:
        ValueError: another ``kernel``, or ``chunk`` not a power of two.
    """
    if chunk < 1 or chunk & (chunk - 1):
        raise ValueError(f"chunk must be a power of two, got {chunk}")
    if kernel == "xla":
        return functools.partial(chunk_gated_delta_xla, chunk=chunk)
    if kernel == "pallas":
        return functools.partial(chunk_gated_delta, chunk=chunk,
                                 interpret=default_interpret() if interpret is None
                                 else interpret)
    raise ValueError(f"kernel must be 'xla' or 'pallas', got {kernel!r}")
