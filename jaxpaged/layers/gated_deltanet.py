"""Qwen3-Next's Gated DeltaNet layer over a ragged batch, its recurrent state in slots.

Reference: Yang, Kautz and Hatamizadeh, "Gated Delta Networks: Improving Mamba2 with Delta
Rule" (ICLR 2025), equation (10): per value head, with ``S`` a [Dk, Dv] state,

    S_t = exp(g_t) * S_{t-1} + k_t (beta_t * (v_t - (exp(g_t) * S_{t-1})^T k_t))^T
    o_t = S_t^T q_t

with ``q`` and ``k`` L2-normalised (``q`` also scaled by ``Dk ** -0.5``), ``beta = sigmoid(b)``
and ``g = -exp(A_log) * softplus(a + dt_bias)``. Numerics and parameter names follow
transformers' ``Qwen3NextGatedDeltaNet`` (``in_proj_qkvz``, ``in_proj_ba``, ``conv1d``,
``dt_bias``, ``A_log``, the gated ``norm``, ``out_proj``): q, k and v pass a depthwise causal
convolution of width ``K`` and SiLU before the recurrence, and the output is RMS-normalised
per head, scaled, and gated by ``silu(z)``.

A sequence's recurrent state lives in its *state slot* (``jaxpaged.core.state_slots``): per
layer, ``conv_state`` [S + 1, K - 1, conv_dim] (the last ``K - 1`` convolution inputs, in the
model dtype) and ``ssm_state`` [S + 1, Hv, Dk, Dv] float32, row ``S`` a scratch slot that
padding tokens write. The step's ``metadata["state_slots"]`` [T] gives each token's slot (-1:
padding, or a metadata without slots: every token is one sequence in the scratch slot, as a
single whole-prompt forward is). A token at position 0 starts from a zero state, so a slot
needs no clearing when a new (or preempted and recomputed) sequence takes it.

:func:`ragged_gated_delta` applies the one-step update
(``pallas_kernels.deltanet_chunk.gated_delta_step``) to every token of a decode-only step at
once (no two real tokens share a slot); any other step runs the chunked form of the same
recurrence per segment of the ragged batch (:mod:`jaxpaged.layers.deltanet_segments`: the XLA
chunk on the ``xla`` and ``cpu`` attention backends, the Pallas kernel on ``pallas``), its
convolution computed for every token at once. The token-by-token scan (``prefill="scan"``)
is kept as the oracle the chunked path is tested against (``tests/test_deltanet_segments.py``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpaged.config import ModelConfig
from jaxpaged.layers.deltanet_segments import (PREFILL_CHUNK, chunk_function,
                                               chunked_delta_rule, prefill_kernel,
                                               ragged_segments, segment_conv)
from jaxpaged.layers.linear import linear
from pallas_kernels.deltanet_chunk import gated_delta_step


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """``x / sqrt(sum(x^2) + eps)`` over the last axis (flash-linear-attention's ``l2norm``,
    as transformers computes it)."""
    return x * jax.lax.rsqrt(jnp.sum(x * x, -1, keepdims=True) + eps)


def conv_qkv(window: jax.Array, taps: jax.Array, num_k_heads: int, k_head_dim: int,
             num_v_heads: int, v_head_dim: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The convolution's output for windows [..., K, C] (taps [K, C]), SiLU, split into the
    rule's float32 q, k [..., Hv, Dk] (L2-normalised, each key head repeated for its value
    heads, q scaled by ``Dk ** -0.5``) and v [..., Hv, Dv]."""
    y = jnp.sum(window.astype(taps.dtype) * taps, -2)
    return split_qkv(y, num_k_heads, k_head_dim, num_v_heads, v_head_dim)


def split_qkv(y: jax.Array, num_k_heads: int, k_head_dim: int, num_v_heads: int,
              v_head_dim: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """SiLU of the convolution's output y [..., C], split as :func:`conv_qkv` splits it."""
    y = jax.nn.silu(y).astype(jnp.float32)
    lead, key_dim = y.shape[:-1], num_k_heads * k_head_dim
    q = y[..., :key_dim].reshape(*lead, num_k_heads, k_head_dim)
    k = y[..., key_dim:2 * key_dim].reshape(*lead, num_k_heads, k_head_dim)
    v = y[..., 2 * key_dim:].reshape(*lead, num_v_heads, v_head_dim)
    repeat = num_v_heads // num_k_heads
    return (jnp.repeat(l2_normalize(q), repeat, -2) * k_head_dim ** -0.5,
            jnp.repeat(l2_normalize(k), repeat, -2), v)


def ragged_gated_delta(mixed: jax.Array, g: jax.Array, beta: jax.Array, slots: jax.Array,
                       reset: jax.Array, conv_weight: jax.Array, conv_state: jax.Array,
                       ssm_state: jax.Array, num_k_heads: int, k_head_dim: int,
                       num_v_heads: int, v_head_dim: int, distinct: jax.Array | None = None,
                       real: jax.Array | None = None, prefill: str = "xla",
                       chunk: int = PREFILL_CHUNK, interpret: bool | None = None
                       ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The convolution and the gated delta rule over a flat ragged batch.

    Args:
        mixed: [T, C] the projected q, k and v of every token (C = conv_dim = 2 * Hk * Dk +
            Hv * Dv), before the convolution.
        g, beta: [T, Hv] float32 log decays and write strengths.
        slots: [T] int32 each token's state slot (a valid row of the states).
        reset: [T] bool; the token starts its sequence (its slot's old state is ignored).
        conv_weight: [C, K] the depthwise convolution (tap ``K - 1`` multiplies the token
            itself).
        conv_state: [S + 1, K - 1, C]; ssm_state: [S + 1, Hv, Dk, Dv] float32.
        num_k_heads, k_head_dim, num_v_heads, v_head_dim: the head layout.
        distinct: [] bool, True when no two real tokens share a slot (a decode-only step;
            padding tokens may share the scratch slot): every token then takes its one
            update at once, vectorised; otherwise (and for None) the multi-token path. A
            one-token batch always takes the one-step update.
        real: [T] bool, False for padding tokens (None: all real). The chunked path skips
            padding (zero outputs, their slot's rows kept); the scan runs them too.
        prefill: the multi-token path: ``"xla"`` or ``"pallas"``, the chunked rule with that
            chunk (:func:`jaxpaged.layers.deltanet_segments.chunk_function`), or ``"scan"``,
            the token-by-token recurrence (the oracle).
        chunk: tokens per chunk of the chunked path (a power of two).
        interpret: the Pallas chunk's interpret mode (None: on unless on a GPU).

    Returns:
        (the outputs [T, Hv, Dv] float32, the updated conv_state, the updated ssm_state).

    Raises:
        ValueError: another ``prefill``, or ``chunk`` not a power of two.
    """
    taps = conv_weight.T                                                     # [K, C]
    heads = (num_k_heads, k_head_dim, num_v_heads, v_head_dim)

    def step(carry, token):
        conv_all, ssm_all = carry
        x, g_t, beta_t, slot, fresh = token
        window = jnp.concatenate(
            [jnp.where(fresh, 0, conv_all[slot]), x[None].astype(conv_all.dtype)], 0)
        q, k, v = conv_qkv(window, taps, *heads)
        state, out = gated_delta_step(jnp.where(fresh, 0, ssm_all[slot]), q, k, v, g_t, beta_t)
        return (conv_all.at[slot].set(window[1:]), ssm_all.at[slot].set(state)), out

    def in_order():
        (conv, ssm), out = jax.lax.scan(step, (conv_state, ssm_state),
                                        (mixed, g, beta, slots, reset))
        return out, conv, ssm

    def chunked():
        real_ = jnp.ones(slots.shape, bool) if real is None else real
        segments = ragged_segments(slots, reset, real_, ssm_state.shape[0], chunk)
        y, conv = segment_conv(mixed, slots, segments, conv_state, taps)
        q, k, v = split_qkv(y, *heads)
        out, ssm = chunked_delta_rule(q, k, v, g, beta, slots, reset, segments, ssm_state,
                                      chunk, chunk_fn)
        return out, conv, ssm

    def at_once():
        window = jnp.concatenate([jnp.where(reset[:, None, None], 0, conv_state[slots]),
                                  mixed[:, None].astype(conv_state.dtype)], 1)   # [T, K, C]
        q, k, v = conv_qkv(window, taps, *heads)
        state, out = jax.vmap(gated_delta_step)(
            jnp.where(reset[:, None, None, None], 0, ssm_state[slots]), q, k, v, g, beta)
        return out, conv_state.at[slots].set(window[:, 1:]), ssm_state.at[slots].set(state)

    if slots.shape[0] == 1:         # one token never shares its slot: no other program
        return at_once()
    if prefill == "scan":
        many = in_order
    else:
        chunk_fn = chunk_function(prefill, chunk, interpret)
        many = chunked
    return many() if distinct is None else jax.lax.cond(distinct, at_once, many)


class ConvWeight(nnx.Module):
    """The depthwise convolution's ``weight`` [C, 1, K] (torch's ``Conv1d`` layout, no bias)."""

    def __init__(self, channels: int, kernel: int, dtype, rngs: nnx.Rngs):
        self.weight = nnx.Param(nnx.initializers.normal(0.02)(rngs.params(),
                                                              (channels, 1, kernel), dtype))


class GatedRMSNorm(nnx.Module):
    """``weight * rmsnorm(x) * silu(z)`` over the last axis (transformers'
    ``Qwen3NextRMSNormGated``: statistics and gate in float32, the scale applied after the
    cast back to x's dtype).

    Args:
        dim: the normalised width (Dv); eps: added to the mean square; dtype: of ``weight``.
    """

    def __init__(self, dim: int, eps: float, dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array, z: jax.Array) -> jax.Array:
        """x, z: [..., dim] -> [..., dim] in x's dtype."""
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + self.eps)
        y = self.weight[...] * xf.astype(x.dtype)
        return (y * jax.nn.silu(z.astype(jnp.float32))).astype(x.dtype)


class GatedDeltaNet(nnx.Module):
    """Qwen3-Next's linear-attention token mixer (module docstring).

    Args:
        config: the model's settings (``config.family.linear_attention`` gives the heads).
        dtype: parameter and activation dtype.
        rngs: initialisers' randomness.
        backend: the model's attention backend; its ``name`` picks the prefill's chunk
            (``pallas``: the Pallas kernel, with the backend's ``interpret``; any other, and
            None: the XLA chunk).
    """

    def __init__(self, config: ModelConfig, dtype, rngs: nnx.Rngs, backend=None):
        la = config.family.linear_attention
        self.prefill, self.interpret = prefill_kernel(backend)
        h = config.hidden_size
        self.num_k_heads, self.num_v_heads = la.num_k_heads, la.num_v_heads
        self.k_head_dim, self.v_head_dim = la.k_head_dim, la.v_head_dim
        key_dim, value_dim = la.num_k_heads * la.k_head_dim, la.num_v_heads * la.v_head_dim
        conv_dim = 2 * key_dim + value_dim
        self.in_proj_qkvz = linear(h, 2 * key_dim + 2 * value_dim, False, dtype, rngs)
        self.in_proj_ba = linear(h, 2 * la.num_v_heads, False, dtype, rngs)
        self.conv1d = ConvWeight(conv_dim, la.conv_kernel, dtype, rngs)
        self.dt_bias = nnx.Param(jnp.ones((la.num_v_heads,), dtype))
        self.A_log = nnx.Param(jnp.zeros((la.num_v_heads,), dtype))
        self.norm = GatedRMSNorm(la.v_head_dim, config.rms_norm_eps, dtype)
        self.out_proj = linear(value_dim, h, False, dtype, rngs)

    def project(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        """x [T, H] -> (mixed q|k|v [T, C], z [T, Hv, Dv], b [T, Hv], a [T, Hv]), undoing the
        projections' per-key-head grouping (transformers' ``fix_query_key_value_ordering``)."""
        t, nk, nv = x.shape[0], self.num_k_heads, self.num_v_heads
        dk, dv, r = self.k_head_dim, self.v_head_dim, nv // nk
        qkvz = self.in_proj_qkvz(x).reshape(t, nk, 2 * dk + 2 * r * dv)
        ba = self.in_proj_ba(x).reshape(t, nk, 2 * r)
        q, k = qkvz[..., :dk], qkvz[..., dk:2 * dk]
        v, z = qkvz[..., 2 * dk:2 * dk + r * dv], qkvz[..., 2 * dk + r * dv:]
        mixed = jnp.concatenate([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], -1)
        return mixed, z.reshape(t, nv, dv), ba[..., :r].reshape(t, nv), ba[..., r:].reshape(t, nv)

    def __call__(self, x, positions, state, metadata):
        """x: [T, H]; positions: [T] int32; state: ``(conv_state, ssm_state)`` (module
        docstring) -> ([T, H], the updated state)."""
        conv_state, ssm_state = state
        mixed, z, b, a = self.project(x)
        beta = jax.nn.sigmoid(b).astype(jnp.float32)
        g = -jnp.exp(self.A_log[...].astype(jnp.float32)) * jax.nn.softplus(
            a.astype(jnp.float32) + self.dt_bias[...].astype(jnp.float32))
        scratch = conv_state.shape[0] - 1
        given = metadata.get("state_slots")
        if given is None:       # one sequence in the scratch slot: the multi-token path
            slots, distinct, real = jnp.full(x.shape[0], scratch, jnp.int32), None, None
        else:
            real = given >= 0
            slots = jnp.where(real, given, scratch)
            per_slot = jnp.zeros(scratch + 1, jnp.int32).at[slots].add(real.astype(jnp.int32))
            distinct = jnp.max(per_slot) <= 1
        out, conv_state, ssm_state = ragged_gated_delta(
            mixed, g, beta, slots, positions == 0, self.conv1d.weight[...][:, 0, :],
            conv_state, ssm_state, self.num_k_heads, self.k_head_dim, self.num_v_heads,
            self.v_head_dim, distinct, real, self.prefill, interpret=self.interpret)
        out = self.norm(out.astype(x.dtype), z)
        return self.out_proj(out.reshape(x.shape[0], -1)), (conv_state, ssm_state)
