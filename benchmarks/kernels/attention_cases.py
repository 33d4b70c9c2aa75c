"""Benchmark cases for paged attention: one step's ragged batch, its inputs and its ideal cost.

A case is written ``MODE:BATCHxCONTEXT[:fp8]`` (e.g. ``decode:64x4096:fp8``):

- ``decode``: ``BATCH`` sequences of ``CONTEXT`` tokens, each with its one new token at
  position ``CONTEXT - 1`` (a decode-only step: one query row per sequence);
- ``ragged``: ``BATCH`` decodes whose lengths are spread uniformly over ``[1, CONTEXT]``
  (mixed context lengths in one batch, as a serving step has them);
- ``prefill``: ``BATCH`` sequences each prefilling a chunk of ``min(chunk, CONTEXT)`` tokens
  that ends at ``CONTEXT`` (the chunk's queries see the earlier context and, causally, the
  chunk itself);
- ``mixed``: ``BATCH - 1`` decodes at ``CONTEXT`` plus one prefill chunk as above (vLLM's
  chunked-prefill step); its parts are ``decode:(BATCH-1)xCONTEXT`` and ``prefill:1xCONTEXT``.

``:fp8`` stores the pool as float8_e4m3fn (``pallas_kernels.kv_quant``) with per-tensor
scales :data:`FP8_SCALES`; otherwise the pool has the model's dtype.

The layout is built as the engine builds one (``jaxpaged.layers.attention.base.BatchLayout``)
with no padding, over a pool that holds exactly the batch's pages plus the null page, in
shuffled order (pages of a long-running server are scattered). The ideal cost of a step is
what any implementation must move and compute: every sequence's K and V read once, the
queries and the step's new K/V rows read, the new rows written to the pool and the output
written (:func:`traffic_bytes`); ``4 * heads * head_dim`` FLOPs per (query, visible key) pair
for the two products QK^T and PV (:func:`attention_flops`, the count FlashAttention's
benchmarks use, Dao et al. 2022, section 4).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.layers.attention import NULL_PAGE, BatchLayout
from pallas_kernels.kv_quant import FP8_DTYPE, quantize_kv

MODES = ("decode", "ragged", "prefill", "mixed")
#: (k_scale, v_scale) of fp8 cases: K/V in [-2, 2) then span +-100 of e4m3's +-448.
FP8_SCALES = (0.02, 0.02)
#: The layout's arrays that every backend receives besides its own metadata.
COMMON_METADATA = ("slot_mapping", "page_table", "seq_lens", "query_start_loc", "positions")

_CASE = re.compile(r"^(?P<mode>[a-z]+):(?P<batch>\d+)x(?P<context>\d+)(?P<fp8>:fp8)?$")


@dataclass(frozen=True)
class Shape:
    """Attention shape: query heads, KV heads, head_dim, tokens per page, model dtype."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: str


@dataclass(frozen=True)
class Case:
    """One benchmark step (see the module docstring); ``fp8`` selects the float8 pool."""

    mode: str
    batch: int
    context: int
    fp8: bool = False

    @property
    def name(self) -> str:
        return f"{self.mode}:{self.batch}x{self.context}" + (":fp8" if self.fp8 else "")

    def parts(self) -> tuple["Case", "Case"] | None:
        """The decode part and the prefill part of a ``mixed`` case (None otherwise)."""
        if self.mode != "mixed":
            return None
        return (Case("decode", self.batch - 1, self.context, self.fp8),
                Case("prefill", 1, self.context, self.fp8))

    def with_fp8(self, fp8: bool) -> "Case":
        return Case(self.mode, self.batch, self.context, fp8)


def parse_case(text: str) -> Case:
    """``MODE:BATCHxCONTEXT[:fp8]`` -> :class:`Case`.

    Raises:
        ValueError: malformed text, an unknown mode, a zero size, or ``mixed`` with batch < 2.
    """
    m = _CASE.match(text)
    if not m or m["mode"] not in MODES:
        raise ValueError(f"bad case {text!r}: expected MODE:BATCHxCONTEXT[:fp8], MODE one of "
                         f"{MODES}")
    case = Case(m["mode"], int(m["batch"]), int(m["context"]), bool(m["fp8"]))
    if case.batch < 1 or case.context < 1 or (case.mode == "mixed" and case.batch < 2):
        raise ValueError(f"bad case {text!r}: batch and context must be >= 1 (mixed: batch >= 2)")
    return case


def sequences(case: Case, prefill_chunk: int) -> list[tuple[int, int]]:
    """[(num_computed_tokens, num_new_tokens)] of the case's sequences."""
    c, chunk = case.context, min(prefill_chunk, case.context)
    if case.mode == "decode":
        return [(c - 1, 1)] * case.batch
    if case.mode == "ragged":
        rng = np.random.default_rng(case.batch * 100003 + c)
        return [(int(n) - 1, 1) for n in rng.integers(1, c + 1, size=case.batch)]
    if case.mode == "prefill":
        return [(c - chunk, chunk)] * case.batch
    return [(c - 1, 1)] * (case.batch - 1) + [(c - chunk, chunk)]


def build_layout(seqs: list[tuple[int, int]], page_size: int, rng: np.random.Generator
                 ) -> tuple[BatchLayout, int]:
    """The unpadded :class:`BatchLayout` of ``seqs`` over a shuffled pool, and the pool's page
    count (the sequences' pages plus the null page)."""
    pages_per_seq = [-(-(c + n) // page_size) for c, n in seqs]
    num_pages = sum(pages_per_seq) + 1
    order = rng.permutation(np.arange(1, num_pages)).astype(np.int32)
    page_table = np.full((len(seqs), max(pages_per_seq)), NULL_PAGE, np.int32)
    query_start_loc = np.zeros(len(seqs) + 1, np.int32)
    query_start_loc[1:] = np.cumsum([n for _, n in seqs])
    positions = np.concatenate([np.arange(c, c + n) for c, n in seqs]).astype(np.int32)
    starts = np.cumsum([0] + pages_per_seq)
    slots = []
    for i, (c, n) in enumerate(seqs):
        table = order[starts[i]:starts[i + 1]]
        page_table[i, :len(table)] = table
        pos = np.arange(c, c + n)
        slots.append(table[pos // page_size] * page_size + pos % page_size)
    layout = BatchLayout(query_start_loc=query_start_loc,
                         seq_lens=np.asarray([c + n for c, n in seqs], np.int32),
                         positions=positions, slot_mapping=np.concatenate(slots).astype(np.int32),
                         page_table=page_table, num_seqs=len(seqs),
                         num_tokens=int(query_start_loc[-1]))
    return layout, num_pages


def traffic_bytes(layout: BatchLayout, shape: Shape, fp8: bool) -> dict[str, int]:
    """Ideal bytes of one step: ``kv_read`` (every sequence's K and V once, in the pool's
    dtype) and ``total`` (``kv_read`` plus queries and new K/V rows read in the model's dtype,
    new rows written in the pool's dtype, the output written)."""
    item = jnp.dtype(shape.dtype).itemsize
    kv_item = 1 if fp8 else item
    row = shape.num_kv_heads * shape.head_dim
    kv_read = 2 * int(layout.seq_lens.sum()) * row * kv_item
    t = layout.num_tokens
    q_and_out = 2 * t * shape.num_heads * shape.head_dim * item
    new_rows = 2 * t * row * (item + kv_item)
    return {"kv_read": kv_read, "total": kv_read + q_and_out + new_rows}


def attention_flops(layout: BatchLayout, shape: Shape) -> int:
    """Causal attention FLOPs of one step: 4 * heads * head_dim per (query, visible key)."""
    visible = int((layout.positions[:layout.num_tokens].astype(np.int64) + 1).sum())
    return 4 * shape.num_heads * shape.head_dim * visible


def make_input_set(seed: int, layout: BatchLayout, num_pages: int, shape: Shape,
                   fp8: bool) -> dict:
    """Device arrays of one step: ``q`` [T, H, D], ``k``/``v`` [T, KVH, D] in the model's dtype
    and ``kv_pages`` = (k_pages, v_pages), each [num_pages, page_size, KVH, D], stored in the
    pool's dtype (``K / k_scale`` for fp8); values uniform in [-2, 2) from ``seed``."""
    t, kvh, d = layout.num_tokens, shape.num_kv_heads, shape.head_dim
    q, k, v, k_pages, v_pages = _random_inputs(
        seed, q_shape=(t, shape.num_heads, d), row_shape=(t, kvh, d),
        pool_shape=(num_pages, shape.page_size, kvh, d), dtype=jnp.dtype(shape.dtype), fp8=fp8)
    return {"q": q, "k": k, "v": v, "kv_pages": (k_pages, v_pages)}


@functools.partial(jax.jit, static_argnames=("q_shape", "row_shape", "pool_shape", "dtype",
                                             "fp8"))
def _random_inputs(seed, *, q_shape, row_shape, pool_shape, dtype, fp8):
    def uniform(shape, stream):
        """A murmur3-style integer hash of each element's index (cheap to compile and run for
        gigabytes, unlike a counter-based PRNG on XLA:CPU), scaled to [-2, 2)."""
        n = int(np.prod(shape))
        h = jax.lax.iota(jnp.uint32, n) * jnp.uint32(0x9E3779B1) + jnp.uint32(seed * 8 + stream)
        h = (h ^ (h >> 16)) * jnp.uint32(0x85EBCA6B)
        h = (h ^ (h >> 13)) * jnp.uint32(0xC2B2AE35)
        x = (h >> 8).astype(jnp.float32) * (4.0 / (1 << 24)) - 2.0
        return x.reshape(shape).astype(dtype)

    def pool(stream, scale):
        x = uniform(pool_shape, stream)
        return quantize_kv(x, scale, FP8_DTYPE) if fp8 else x

    return (uniform(q_shape, 0), uniform(row_shape, 1), uniform(row_shape, 2),
            pool(3, FP8_SCALES[0]), pool(4, FP8_SCALES[1]))


def input_set_bytes(layout: BatchLayout, num_pages: int, shape: Shape, fp8: bool) -> int:
    """Device bytes of one :func:`make_input_set` (the pool dominates)."""
    item = jnp.dtype(shape.dtype).itemsize
    row = shape.num_kv_heads * shape.head_dim
    pool = 2 * num_pages * shape.page_size * row * (1 if fp8 else item)
    return pool + layout.num_tokens * (shape.num_heads * shape.head_dim + 2 * row) * item


def step_metadata(backend, layout: BatchLayout) -> dict[str, jax.Array]:
    """Device copies of ``backend.build_metadata(layout)`` plus the layout's common arrays
    (:data:`COMMON_METADATA`): the ``metadata`` argument of ``backend.forward``."""
    host = dict(backend.build_metadata(layout))
    host.update({name: getattr(layout, name) for name in COMMON_METADATA})
    return {name: jnp.asarray(value) for name, value in host.items()}
