"""Projections and embeddings whose weights stay packed in 4 or 8 bits (GGUF files on a CPU).

A GGUF checkpoint stores its projections as ggml blocks: integers with a scale and an offset
per group of G weights of a row (:mod:`jaxpaged.models.gguf_blocks`). Dequantized to float32
they take 4 bytes a weight, which every decode step reads, several times the packed blocks
(``docs/measurements.md``, "Packed linear"). Here they are kept as the file stores them, regrouped
at load time so that 16 output features lie side by side (one vector register's lanes;
:mod:`jaxpaged.layers.packed_layout`: ``blocks``, ``block_scale``, ``block_min``). The bits and G are read from the arrays' dtypes and shapes, so one module class holds every
block type, and the loader gives each projection the shapes of its own tensor.

On the CPU, where the kernel library builds (:func:`kernel_available`), ``x . W^T`` runs in
``csrc/packed_matmul.cc``, which dequantizes a vector of weights at a time in registers;
elsewhere (no compiler), the weight is dequantized in the jitted step (``dequantize``)
before an XLA dot, which is the kernel's reference. Either way the weights are those of
``gguf.quants.dequantize`` bit for bit, and outputs equal a float32 matmul with them up to
the order of the sum. Packed layers are used on one CPU device only
(``jaxpaged.runner.worker``); on GPUs and with parallelism the GGUF is dequantized on load
(``docs/quantization.md``).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpaged.layers.cpu_build import PACKED_MATMUL_TARGET, load_cpu_kernels, packed_int8_dots
from jaxpaged.layers.layer_stack import LayerSlice, unstack
from jaxpaged.layers.packed_layout import (LANES, dequantize, integers, pack_weight,
                                           reference_product)

_VALID_ROWS: contextvars.ContextVar = contextvars.ContextVar("packed_valid_rows",
                                                              default=None)


@contextlib.contextmanager
def valid_rows(count: jax.Array | None):
    """While tracing inside this block, the packed projections' kernel computes only the
    first ``count`` rows ([] int32, a traced value: the step's real tokens or sampling rows)
    of its input and writes zeros in the rest, so a step padded to its bucket (8 decode rows
    for one sequence) costs what its real rows cost. None: every row."""
    token = _VALID_ROWS.set(count)
    try:
        yield
    finally:
        _VALID_ROWS.reset(token)


def packed_projections(x: jax.Array, weights, *, rows: jax.Array | None = None,
                       norm: jax.Array | None = None, eps: float = 0.0,
                       residual: jax.Array | None = None, gated: bool = False,
                       int8: bool = True, rope: tuple | None = None) -> list:
    """``x . W_p^T`` for several packed weights in one call of the C++ kernel (registered:
    :func:`kernel_available`), with a decoder layer's neighbouring operations folded in.

    Args:
        x: [..., K] float32.
        weights: (blocks, block_scale, block_min) per weight; weight p has N_p' = 16 *
            blocks.shape[0] features. Any of them (and ``norm``) may be a
            :class:`~jaxpaged.layers.layer_stack.LayerSlice` (all of one layer): the kernel
            reads its row of the stacked array in place.
        rows: [] int32, how many leading rows of ``x`` (flattened) to compute; the others
            come back as zeros (None: all).
        norm: [K] float32 weight of an RMSNorm applied to ``x`` first (with ``eps``;
            transformers' ``LlamaRMSNorm`` in float32), or None.
        residual: [..., N_0'] float32 added to the only weight's product, or None.
        gated: two weights (a SwiGLU gate and up): one output ``silu(x . W_0^T) * (x . W_1^T)``.
        int8: let calls of fewer than 128 rows multiply in int8 dot products with the
            activations split into three bytes where the library can
            (:func:`jaxpaged.layers.cpu_build.packed_int8_dots`); False: the float paths.
        rope: ``(positions [M] int32, inv_freq [D/2])``: the first two outputs (a layer's q
            and k, whole heads of D features) come back rotated by RoPE as
            :func:`jaxpaged.layers.rotary.apply_rope` rotates them (one XLA operation less
            per rotated tensor and half), or None.

    Returns:
        The outputs, [..., N_p'] float32 each (one when ``gated``); the caller drops padding
        features.
    """
    k = x.shape[-1]
    flat = x.reshape(-1, k).astype(jnp.float32)
    m = flat.shape[0]
    widths = [w[0].shape[0] * LANES for w in weights]
    outs = [jax.ShapeDtypeStruct((m, n), jnp.float32) for n in widths[:1 if gated else None]]
    empty = jnp.zeros((0,), jnp.float32)
    positions, inv_freq = rope if rope is not None else (jnp.zeros((0,), jnp.int32), empty)
    layers = {a.index for a in (norm, *(a for w in weights for a in w))
              if isinstance(a, LayerSlice)}
    if len(layers) > 1:
        raise ValueError(f"one call's weights come from one layer, not {sorted(layers)}")
    whole = lambda a: a.stack if isinstance(a, LayerSlice) else a     # the kernel indexes it
    args = [flat, jnp.asarray(m if rows is None else rows, jnp.int32),
            empty if norm is None else whole(norm).astype(jnp.float32),
            empty if residual is None else residual.reshape(m, -1).astype(jnp.float32),
            jnp.asarray(positions, jnp.int32).reshape(-1), jnp.asarray(inv_freq, jnp.float32)]
    ys = jax.ffi.ffi_call(PACKED_MATMUL_TARGET, outs)(
        *args, *(whole(a) for w in weights for a in w), eps=np.float32(eps),
        gated=np.int32(gated), int8=np.int32(int8),
        rope_outputs=np.int32(0 if rope is None else 2),
        layer=np.int32(layers.pop() if layers else -1))
    return [y.reshape(*x.shape[:-1], y.shape[-1]) for y in ys]


def project_packed(x: jax.Array, weights, **options) -> list:
    """:func:`packed_projections` of the rows the enclosing :func:`valid_rows` block names."""
    return packed_projections(x, weights, rows=_VALID_ROWS.get(), **options)


def packed_matmul(x: jax.Array, blocks: jax.Array, block_scale: jax.Array,
                  block_min: jax.Array, rows: jax.Array | None = None,
                  int8: bool = True) -> jax.Array:
    """``x . W^T`` ([..., K] float32 -> [..., N'] float32) for one packed weight
    (:func:`packed_projections` without the folded operations)."""
    return packed_projections(x, [(blocks, block_scale, block_min)], rows=rows, int8=int8)[0]


@functools.lru_cache(maxsize=None)
def kernel_available() -> bool:
    """True on a CPU backend where the kernel library builds and the kernel matches
    :func:`dequantize` + float64 matmul on small products of both widths (relative error
    <= 1e-5; of the activations as :func:`split_activations` rounds them where the library
    multiplies in int8, :func:`jaxpaged.layers.cpu_build.packed_int8_dots`); never raises (a
    build failure is logged once by the build)."""
    return jax.default_backend() == "cpu" and load_cpu_kernels() and _self_check() <= 1e-5


def _project(x: jax.Array, params, din: int, dout: int) -> jax.Array:
    """x [..., din] -> [..., dout] float32 through a packed weight (kernel or reference)."""
    if kernel_available():
        return project_packed(x, [params])[0][..., :dout]
    w = dequantize(*(unstack(p) for p in params), din, dout, xp=jnp)
    return jax.lax.dot_general(x.astype(jnp.float32), w, (((x.ndim - 1,), (1,)), ((), ())))


def _placeholders(din: int, dout: int) -> dict[str, nnx.Param]:
    """4-bit, G = 32 parameters of the right size class (the loader replaces them with the
    checkpoint's own shapes and dtypes). numpy zeros: the loader builds the model under
    ``nnx.eval_shape``, where each ``jnp.zeros`` was traced (~0.2 s of a warm start's
    single-threaded Python for SmolLM2's 633 placeholders)."""
    v, groups = -(-dout // LANES), max(1, din // 32)
    return {"blocks": nnx.Param(np.zeros((v, din // 2, LANES), np.uint8)),
            "block_scale": nnx.Param(np.zeros((v, groups, LANES), np.float32)),
            "block_min": nnx.Param(np.zeros((v, groups, LANES), np.float32))}


class PackedLinear(nnx.Module):
    """``y = x . W^T + bias`` with W packed (module docstring), returned in ``dtype``.

    Args:
        din, dout: input and output widths.
        bias: whether the projection has a bias (zeros until loaded).
        dtype: the model dtype (of ``bias`` and of the output).
        rngs: unused (kept for :func:`jaxpaged.layers.linear.linear`'s signature).
    """

    def __init__(self, din: int, dout: int, bias: bool, dtype, rngs: nnx.Rngs):
        del rngs
        self.din, self.dout, self.dtype = din, dout, dtype
        for name, param in _placeholders(din, dout).items():
            setattr(self, name, param)
        self.bias = nnx.Param(jnp.zeros((dout,), dtype)) if bias else nnx.data(None)

    def __call__(self, x: jax.Array) -> jax.Array:
        """x: [..., din] -> [..., dout] in ``dtype`` (computed in float32)."""
        y = _project(x, (self.blocks[...], self.block_scale[...], self.block_min[...]),
                     self.din, self.dout).astype(self.dtype)
        return y if self.bias is None else y + self.bias[...]


class PackedEmbedding(nnx.Module):
    """A token embedding [num_embeddings, features] kept packed; ``nnx.Embed``'s interface
    (``__call__`` to look tokens up, :meth:`attend` for a tied LM head).

    Args:
        num_embeddings: vocabulary size; features: the hidden size.
        dtype: the dtype of looked-up rows and of :meth:`attend`'s output.
    """

    def __init__(self, num_embeddings: int, features: int, dtype):
        self.num_embeddings, self.features, self.dtype = num_embeddings, features, dtype
        for name, param in _placeholders(features, num_embeddings).items():
            setattr(self, name, param)

    def __call__(self, ids: jax.Array) -> jax.Array:
        """ids [T] int32 -> [T, features] in ``dtype``: each row dequantized from its blocks
        (only the looked-up rows are read)."""
        blocks, scale, offset = self.blocks[...], self.block_scale[...], self.block_min[...]
        v, lane = (ids // LANES)[:, None], (ids % LANES)[:, None]
        pick = lambda a: a[v, jnp.arange(a.shape[1])[None, :], lane]     # [T, a.shape[1]]
        q = integers(pick(blocks)[..., None], self.features, jnp)[..., 0]
        group = self.features // scale.shape[1]
        widen = lambda a: jnp.repeat(pick(a), group, axis=1)
        return (q * widen(scale) + widen(offset)).astype(self.dtype)

    def attend(self, hidden: jax.Array) -> jax.Array:
        """hidden [N, features] -> [N, num_embeddings] logits (``hidden . E^T``)."""
        params = (self.blocks[...], self.block_scale[...], self.block_min[...])
        return _project(hidden, params, self.features, self.num_embeddings).astype(self.dtype)


def _self_check() -> float:
    with jax.ensure_compile_time_eval():      # (first asked while a step is being traced)
        return _self_check_error()


def _self_check_error() -> float:
    rng = np.random.default_rng(0)
    worst = 0.0
    for bits, k, group in ((4, 64, 32), (8, 48, 16)):
        n = 40
        q = rng.integers(0, 16, (n, k)) if bits == 4 else rng.integers(-128, 128, (n, k))
        scale = rng.uniform(0.01, 0.1, (n, k // group)).astype(np.float32)
        offset = rng.uniform(-0.2, 0.2, (n, k // group)).astype(np.float32)
        p = pack_weight(q, scale, offset, bits)
        x = rng.normal(size=(7, k)).astype(np.float32)
        want = reference_product(x, p, k, n, split=packed_int8_dots())
        got = np.asarray(jax.jit(packed_matmul)(x, *p.values()), np.float64)[:, :n]
        worst = max(worst, float(np.abs(got - want).max() / np.abs(want).max()))
    return worst
