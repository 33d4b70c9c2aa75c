"""A ragged batch's Gated DeltaNet prefill: its sequences cut into segments and chunks, the
convolution of every token at once, and the chunked gated delta rule over the chunks.

A multi-token step (prefill, chunked prefill, a mixed step) holds each sequence's tokens
contiguously in the flat batch. A *segment* is a maximal run of real tokens in one state slot
that does not restart: it begins at the batch's first real token, after padding, where the
slot changes, or at a reset (a token at position 0, whose sequence starts from a zero state).
Each segment is cut into chunks of ``chunk`` tokens from its first token (the last one
shorter); a chunk starts from its slot's state (zero at a reset) and leaves the state after it
in the slot, so a chunk boundary inside a segment carries the state. The chunks run in batch
order in one ``fori_loop`` whose trip count is the step's number of chunks (static shapes, one
compiled program per step bucket); a one-token chunk (a decode in a mixed step) takes the
one-step update instead of the chunk's matrices. Each chunk gathers its tokens with a dynamic
slice, zeroes those past its segment's end (``g = beta = 0`` and ``k = 0`` leave the state as
it is: the padding of ``pallas_kernels.deltanet_chunk``) and writes back only its own
outputs. Padding tokens
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

from pallas_kernels.deltanet_chunk import (chunk_gated_delta, chunk_gated_delta_xla,
                                           gated_delta_step)
from pallas_kernels.lowering import default_interpret

#: Tokens per chunk (a power of two; flash-linear-attention uses 64): 32 was as fast as 16
#: and faster than 64 for a 512-token prefill of an 80B-shaped layer on XLA:CPU
#: (docs/measurements.md, "Gated DeltaNet prefill").
PREFILL_CHUNK = 32

#: ``(q [C, H, Dk], k, v [C, H, Dv], g [C, H], beta [C, H], state [H, Dk, Dv]) ->
#: (out [C, H, Dv], state)``, all float32.
ChunkFn = Callable[..., tuple[jax.Array, jax.Array]]


class Segments(NamedTuple):
    """Per-token segment facts of a flat batch of T tokens (module docstring).

    Attributes:
        first: [T] int32 index of the token's segment's first token.
        end: [T] int32 index one past the segment's last token.
        fresh: [T] bool; the segment starts from a zero state (its first token is a reset).
        latest: [S + 1] int32 each slot's last real token in the batch (-1: none); it leaves
            the slot's convolution state.
        chunk_starts: [T] int32 the first token of each chunk in batch order (then padding).
        num_chunks: [] int32 how many entries of ``chunk_starts`` are chunks.
    """

    first: jax.Array
    end: jax.Array
    fresh: jax.Array
    latest: jax.Array
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
    return Segments(first, end, reset[first], latest,
                    jnp.nonzero(begins, size=t, fill_value=0)[0].astype(jnp.int32),
                    jnp.sum(begins, dtype=jnp.int32))


def _input_before(x: jax.Array, conv_state: jax.Array, slots: jax.Array, segments: Segments,
                  index: jax.Array, back: int) -> jax.Array:
    """The convolution input ``back`` tokens before each token ``index`` [N] of its segment,
    [N, C]: the batch's own, or before the segment's first token the slot's stored rows
    (row ``K - 2`` the latest; zeros for a fresh segment)."""
    history = conv_state.shape[1]
    source, first = index - back, segments.first[index]
    row = jnp.clip(history - (first - source), 0, history - 1)
    stored = jnp.where(segments.fresh[index][:, None], 0, conv_state[slots[index], row])
    return jnp.where((source >= first)[:, None], x[jnp.maximum(source, 0)], stored)


def segment_conv(mixed: jax.Array, slots: jax.Array, segments: Segments,
                 conv_state: jax.Array, taps: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The depthwise causal convolution of every token at once, each reading its segment's
    earlier inputs and, for its first ``K - 1``, the slot's stored ones; and the stored rows
    after the step (each slot's last ``K - 1`` inputs up to its last token in the batch).

    One [T, C] term per tap, no [T, K, C] window (on XLA:CPU the window's gathers cost more
    than the rule: ``docs/measurements.md``, "Gated DeltaNet prefill").

    Args:
        mixed: [T, C] the convolution's inputs (cast to ``conv_state``'s dtype, as stored).
        slots: [T] int32 state slots; segments: from :func:`ragged_segments`.
        conv_state: [S + 1, K - 1, C] each slot's last ``K - 1`` inputs.
        taps: [K, C] the weights (tap ``K - 1`` multiplies the token itself).

    Returns:
        (the convolution's output [T, C] in ``taps``' dtype, before the activation; the
        updated conv_state).
    """
    x = mixed.astype(conv_state.dtype)
    kernel, everyone = taps.shape[0], jnp.arange(x.shape[0], dtype=jnp.int32)
    y = x.astype(taps.dtype) * taps[kernel - 1]
    for back in range(1, kernel):
        term = _input_before(x, conv_state, slots, segments, everyone, back)
        y = y + term.astype(taps.dtype) * taps[kernel - 1 - back]
    ends = jnp.maximum(segments.latest, 0)
    rows = jnp.stack([_input_before(x, conv_state, slots, segments, ends, back)
                      for back in range(kernel - 2, -1, -1)], 1)          # [S + 1, K - 1, C]
    return y, jnp.where((segments.latest >= 0)[:, None, None], rows, conv_state)


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

    def one_token(q, k, v, g, beta, state):        # a decode in a mixed step: one update
        state, out = gated_delta_step(state, q[0], k[0], v[0], g[0], beta[0])
        return jnp.zeros((chunk, *out.shape), out.dtype).at[0].set(out), state

    def body(j, carry):
        ssm, out = carry
        c = segments.chunk_starts[j]
        keep = rows < segments.end[c] - c
        take = lambda x: jnp.where(keep.reshape(-1, *(1,) * (x.ndim - 1)),
                                   jax.lax.dynamic_slice_in_dim(x, c, chunk), 0)
        state = jnp.where(reset[c], 0, ssm[slots[c]])
        part, state = jax.lax.cond(segments.end[c] - c == 1, one_token, chunk_fn,
                                   *map(take, inputs), state)
        mine = jnp.where(keep[:, None, None], part, jax.lax.dynamic_slice_in_dim(out, c, chunk))
        return ssm.at[slots[c]].set(state), jax.lax.dynamic_update_slice_in_dim(out, mine, c, 0)

    out = jnp.zeros((t + chunk, *v.shape[1:]), jnp.float32)
    ssm, out = jax.lax.fori_loop(0, segments.num_chunks, body, (ssm_state, out))
    return out[:t], ssm


def prefill_kernel(backend) -> tuple[str, bool | None]:
    """``(kernel, interpret)`` for :func:`chunk_function` from an attention backend (or
    None): the Pallas kernel with the backend's ``interpret`` on ``pallas`` (a tensor-parallel
    wrapper reports its inner backend's name), else the XLA chunk (``xla``, ``cpu``)."""
    if getattr(backend, "name", None) == "pallas":
        return "pallas", getattr(backend, "interpret", None)
    return "xla", None


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
