"""The gated delta rule (Gated DeltaNet, Qwen3-Next's linear attention) over one sequence:
a one-step update for decode, its token-by-token scan, and the chunked form for prefill as
an XLA function and a Pallas kernel.

Recurrence (Yang, Kautz and Hatamizadeh, "Gated Delta Networks", ICLR 2025, eq. 10), per
head, state ``S`` [Dk, Dv]: ``S_t = a_t S_{t-1} + beta_t k_t (v_t - a_t S_{t-1}^T k_t)^T``,
``o_t = S_t^T q_t``, ``a_t = exp(g_t)``; q and k arrive L2-normalised (q also scaled).

Chunked form (the paper's section 3.2, the WY / UT representation of DeltaNet's products of
Householder-like updates; flash-linear-attention's ``chunk_gated_delta_rule`` computes the
same): a chunk of C tokens with cumulative log decays ``G = cumsum(g)`` and
``D_ij = exp(G_i - G_j)`` for ``i >= j`` (else 0) needs, besides the state entering it,

    A = strictly_lower(beta k k^T * D),   T = (I + A)^-1
    U = T (beta v),   W = T (beta exp(G) k),   V = U - W S
    O = (q exp(G)) S + lower(q k^T * D) V
    S' = exp(G_C) S + (k exp(G_C - G))^T V

so a chunk is a few C x C and C x D matmuls and the scan runs over L / C chunks, not L
tokens. ``T`` is computed without a triangular solve, which GPU kernels lack:
``A`` is nilpotent (``A^C = 0``), so for C a power of two
``(I + A)^-1 = (I - A)(I + A^2)(I + A^4) ... (I + A^(C/2))``, ``log2 C`` matmuls.

:func:`chunk_gated_delta` runs the chunked form as a Pallas kernel, one program per head
(the whole sequence's rows of the head in its blocks, a ``fori_loop`` over the chunks carrying
the state); :func:`chunk_gated_delta_xla` is the same arithmetic in plain jnp and
:func:`recurrent_gated_delta` the token-by-token oracle both are tested against
(``tests/kernels/test_deltanet_chunk.py``). Everything is float32. Run in interpret mode
only; its Triton lowering is checked (abstract H200) for one chunk of 32 tokens at
128 x 128 heads, the way the model (``jaxpaged.layers.deltanet_segments``) calls it: one chunk
at a time per segment of a ragged batch. Over a whole sequence the blocks would span the
head's padded sequence, which a GPU would want loaded chunk by chunk (``pl.ANY`` refs).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

_HIGHEST = jax.lax.Precision.HIGHEST


def gated_delta_step(state: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array,
                     g: jax.Array, beta: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One token's update (the decode step).

    Args:
        state: [H, Dk, Dv]; q, k: [H, Dk] (normalised); v: [H, Dv]; g: [H] log decays
            (<= 0); beta: [H] write strengths. All float32.

    Returns:
        (the new state [H, Dk, Dv], the output [H, Dv]).
    """
    state = state * jnp.exp(g)[:, None, None]
    memory = jnp.einsum("hkv,hk->hv", state, k, precision=_HIGHEST)
    state = state + k[:, :, None] * ((v - memory) * beta[:, None])[:, None, :]
    return state, jnp.einsum("hkv,hk->hv", state, q, precision=_HIGHEST)


def recurrent_gated_delta(q, k, v, g, beta, state):
    """Token-by-token oracle: q, k [L, H, Dk]; v [L, H, Dv]; g, beta [L, H]; state
    [H, Dk, Dv] -> (out [L, H, Dv], final state)."""
    def step(s, token):
        return gated_delta_step(s, *token)
    state, out = jax.lax.scan(step, state, (q, k, v, g, beta))
    return out, state


def _chunk_terms(q, k, v, g, beta):
    """One head's chunk quantities that do not depend on the state: q, k [C, Dk], v [C, Dv],
    g, beta [C] -> (q * exp(G), lower(q k^T D), U, W, k * exp(G_C - G), exp(G_C))."""
    c = g.shape[0]
    row = jax.lax.broadcasted_iota(jnp.int32, (c, c), 0)
    col = jax.lax.broadcasted_iota(jnp.int32, (c, c), 1)
    cum = jnp.sum(jnp.where(row >= col, g[None, :], 0.0), axis=1)       # G = cumsum(g)
    decay = jnp.exp(jnp.where(row >= col, cum[:, None] - cum[None, :], -jnp.inf))
    dot = functools.partial(jnp.dot, precision=_HIGHEST, preferred_element_type=jnp.float32)
    a = jnp.where(row > col, beta[:, None] * dot(k, k.T) * decay, 0.0)
    eye = jnp.where(row == col, 1.0, 0.0)
    inverse, power = eye - a, dot(a, a)                     # (I - A)(I + A^2)(I + A^4)...
    for _ in range(max(c.bit_length() - 2, 0)):
        inverse = dot(inverse, eye + power)
        power = dot(power, power)
    u = dot(inverse, beta[:, None] * v)
    w = dot(inverse, (beta * jnp.exp(cum))[:, None] * k)
    last = jnp.sum(g)                                 # G_C (no slice: Triton lacks one)
    return (q * jnp.exp(cum)[:, None], dot(q, k.T) * decay, u, w,
            k * jnp.exp(last - cum)[:, None], jnp.exp(last))


def _chunk_apply(terms, state):
    """A chunk's output [C, Dv] and the state after it, from :func:`_chunk_terms`."""
    dot = functools.partial(jnp.dot, precision=_HIGHEST, preferred_element_type=jnp.float32)
    q_decayed, attn, u, w, k_tail, total = terms
    new_v = u - dot(w, state)
    out = dot(q_decayed, state) + dot(attn, new_v)
    return out, total * state + dot(k_tail.T, new_v)


def _padded(chunk: int, *arrays):
    """Pad the leading (token) axis to a multiple of ``chunk`` with zeros (a token with
    ``g = 0`` and ``beta = 0`` leaves the state as it is)."""
    pad = -arrays[0].shape[0] % chunk
    return [jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1)) for a in arrays]


def _check_chunk(chunk: int) -> None:
    if chunk < 1 or chunk & (chunk - 1):
        raise ValueError(f"chunk must be a power of two, got {chunk}")


def chunk_gated_delta_xla(q, k, v, g, beta, state, chunk: int = 16):
    """The chunked form in jnp (module docstring); same arguments and result as
    :func:`recurrent_gated_delta`.

    Raises:
        ValueError: ``chunk`` is not a power of two.
    """
    _check_chunk(chunk)
    n = q.shape[0]
    q, k, v, g, beta = _padded(chunk, q, k, v, g, beta)
    split = lambda x: jnp.swapaxes(x.reshape(-1, chunk, *x.shape[1:]), 1, 2)  # [N, H, C, ...]

    def per_chunk(s, xs):
        terms = jax.vmap(_chunk_terms)(*xs)
        out, s = jax.vmap(_chunk_apply)(terms, s)
        return s, out                                                      # out [H, C, Dv]

    state, out = jax.lax.scan(per_chunk, state, tuple(map(split, (q, k, v, g, beta))))
    return jnp.swapaxes(out, 1, 2).reshape(-1, *v.shape[1:])[:n], state


def _kernel(q_ref, k_ref, v_ref, g_ref, b_ref, s_ref, o_ref, s_out_ref, *, chunk: int,
            num_chunks: int):
    """One head: the chunks in order, the state carried in the loop."""
    def body(i, state):
        rows = pl.ds(pl.multiple_of(i * chunk, chunk), chunk)
        terms = _chunk_terms(q_ref[rows, :], k_ref[rows, :], v_ref[rows, :], g_ref[rows],
                             b_ref[rows])
        out, state = _chunk_apply(terms, state)
        o_ref[rows, :] = out
        return state

    s_out_ref[...] = jax.lax.fori_loop(0, num_chunks, body, s_ref[...])


def chunk_gated_delta(q, k, v, g, beta, state, chunk: int = 16, interpret: bool = False):
    """The chunked form as a Pallas kernel (module docstring), one program per head.

    Args:
        q, k: [L, H, Dk]; v: [L, H, Dv]; g, beta: [L, H]; state: [H, Dk, Dv]; float32.
        chunk: tokens per chunk (a power of two; 16+ on a GPU for its matmul tiles).
        interpret: run in Pallas's interpreter (CPU tests).

    Returns:
        (out [L, H, Dv], the final state [H, Dk, Dv]).

    Raises:
        ValueError: ``chunk`` is not a power of two.
    """
    _check_chunk(chunk)
    n, h, dk = q.shape
    dv = v.shape[-1]
    q, k, v, g, beta = _padded(chunk, q, k, v, g, beta)
    length = q.shape[0]
    heads_first = lambda x: jnp.moveaxis(x, 1, 0)
    seq = lambda d: pl.BlockSpec((None, length, d), lambda i: (i, 0, 0))
    vec = pl.BlockSpec((None, length), lambda i: (i, 0))
    mat = pl.BlockSpec((None, dk, dv), lambda i: (i, 0, 0))
    out, state = pl.pallas_call(
        functools.partial(_kernel, chunk=chunk, num_chunks=length // chunk),
        out_shape=(jax.ShapeDtypeStruct((h, length, dv), jnp.float32),
                   jax.ShapeDtypeStruct((h, dk, dv), jnp.float32)),
        grid=(h,), in_specs=[seq(dk), seq(dk), seq(dv), vec, vec, mat],
        out_specs=(seq(dv), mat), interpret=interpret,
    )(*map(heads_first, (q, k, v, g, beta)), state)
    return jnp.moveaxis(out, 0, 1)[:n], state
