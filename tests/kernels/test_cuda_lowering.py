"""Every kernel cross-lowers for an NVIDIA H200 (abstract CUDA device) at production shapes.

Lowering runs the Pallas -> Triton translation, so a kernel that Triton cannot take (e.g. a
non-power-of-two tile) fails here, on the CPU-only CI machine.
"""

import functools
import re
import warnings

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.kv_write import write_kv
from pallas_kernels.lowering import lower_for_cuda
from pallas_kernels.paged_attention import paged_decode_attention
from pallas_kernels.paged_attention_v1 import paged_attention
from pallas_kernels.prefill_attention import paged_prefill_attention
from jaxpaged.benchmarks.kernels.schedule_check import capture_ttir

# Llama-3-8B attention: 32 query heads, 8 KV heads, head_dim 128, page 16, bf16.
QH, KVH = 32, 8
POOL_PAGES = 8192
FP8 = jnp.float8_e4m3fn


def lowered_text(fn, *args):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the Triton backend's notice
        return lower_for_cuda(fn, *args).as_text()


def sds(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


def triton_calls(text):
    return len(re.findall(r"__gpu\$xla\.gpu\.triton", text))


@pytest.mark.parametrize("batch, context, block_q", [
    (1, 8192, 1), (64, 4096, 1), (256, 512, 1),    # decode (split-K picked for small batches)
    (33, 2048, 16),                                # mixed prefill chunks + decodes
])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_paged_attention_lowers_for_h200(batch, context, block_q, dtype):
    head_dim, page_size = 128, 16
    pages = context // page_size
    args = (sds((batch, block_q, QH, head_dim), dtype),
            sds((POOL_PAGES, page_size, KVH, head_dim), dtype),
            sds((POOL_PAGES, page_size, KVH, head_dim), dtype),
            sds((batch, pages), jnp.int32), sds((batch,), jnp.int32),
            sds((batch, block_q), jnp.int32))
    fn = functools.partial(paged_attention, scale=head_dim ** -0.5, interpret=False)
    text = lowered_text(fn, *args)
    assert triton_calls(text) == 1
    assert "num_warps = 4" in text


def v2_args(batch, context, block_q, dtype, pool_dtype=None, head_dim=128, page_size=16,
            pool_pages=POOL_PAGES):
    """A v2 kernel (decode for block_q 1, else prefill) and its abstract arguments."""
    pool = sds((pool_pages, page_size, KVH, head_dim), pool_dtype or dtype)
    table = sds((batch, context // page_size), jnp.int32)
    if block_q == 1:
        return paged_decode_attention, (sds((batch, QH, head_dim), dtype), pool, pool, table,
                                        sds((batch,), jnp.int32), sds((batch,), jnp.int32),
                                        sds((1,), jnp.int32))
    return paged_prefill_attention, (sds((batch, block_q, QH, head_dim), dtype), pool, pool,
                                     table, sds((batch,), jnp.int32),
                                     sds((batch, block_q), jnp.int32))


@pytest.mark.parametrize("batch, context, block_q, launches, warps", [
    (1, 8192, 1, 2, 4), (64, 4096, 1, 2, 4),     # decode: split-K, then the merge launch
    (256, 512, 1, 1, 4),                         # enough sequences: no split slots, no merge
    (33, 2048, 32, 1, 8),                        # prefill blocks: 32 tokens x 4 heads
])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_v2_kernels_lower_for_h200(batch, context, block_q, launches, warps, dtype):
    kernel, args = v2_args(batch, context, block_q, dtype)
    text = lowered_text(functools.partial(kernel, scale=128 ** -0.5, interpret=False), *args)
    assert triton_calls(text) == launches
    assert f"num_warps = {warps}" in text
    assert "num_stages = 3" in text


@pytest.mark.parametrize("block_q", [1, 32])
@pytest.mark.parametrize("head_dim, page_size, sliding_window, soft_cap", [
    (64, 32, None, None), (128, 64, 4096, None), (128, 128, None, 50.0),
])
def test_v2_variants_lower(block_q, head_dim, page_size, sliding_window, soft_cap):
    kernel, args = v2_args(16, 64 * page_size, block_q, jnp.bfloat16, head_dim=head_dim,
                           page_size=page_size, pool_pages=1024)
    fn = functools.partial(kernel, scale=0.1, sliding_window=sliding_window, soft_cap=soft_cap,
                           interpret=False)
    assert triton_calls(lowered_text(fn, *args)) >= 1


@pytest.mark.parametrize("batch, context, block_q", [(1, 8192, 1), (33, 2048, 32)])
def test_v2_kernels_on_fp8_pool_lower_for_h200(batch, context, block_q):
    """The pool enters the kernels as fp8 (flat [pages * page_size, KVH, D] view) and its
    tiles are converted inside them."""
    kernel, args = v2_args(batch, context, block_q, jnp.bfloat16, pool_dtype=FP8)
    fn = functools.partial(kernel, scale=128 ** -0.5, k_scale=0.05, v_scale=0.02,
                           sliding_window=256, soft_cap=30.0, interpret=False)
    text = lowered_text(fn, *args)
    assert f"tensor<{POOL_PAGES * 16}x{KVH}x128xf8E4M3FN>" in text
    assert "stablehlo.bitcast_convert" not in text   # no pool-wide bitcast (XLA would copy)
    assert "fp_to_fp" in text
    if block_q == 1:                                 # decode over fp8: DECODE_WARPS_FP8
        assert "num_warps = 2" in text


@pytest.mark.parametrize("head_dim, page_size, sliding_window, soft_cap", [
    (64, 32, None, None), (128, 64, 4096, None), (128, 128, None, 50.0),
])
def test_paged_attention_variants_lower(head_dim, page_size, sliding_window, soft_cap):
    args = (sds((16, 16, QH, head_dim), jnp.bfloat16),
            sds((1024, page_size, KVH, head_dim), jnp.bfloat16),
            sds((1024, page_size, KVH, head_dim), jnp.bfloat16),
            sds((4, 64), jnp.int32), sds((16,), jnp.int32), sds((16, 16), jnp.int32))
    fn = functools.partial(paged_attention, scale=0.1, sliding_window=sliding_window,
                           soft_cap=soft_cap, num_splits=2, interpret=False)
    assert triton_calls(lowered_text(fn, *args)) == 1


@pytest.mark.parametrize("dtype, num_kv_heads, head_dim", [
    (jnp.bfloat16, 8, 128), (jnp.float32, 12, 64),
])
def test_kv_write_lowers_for_h200(dtype, num_kv_heads, head_dim):
    """One token per program: one [KVH, D] store (8 heads) or one per head (12)."""
    pool = sds((POOL_PAGES, 16, num_kv_heads, head_dim), dtype)
    rows = sds((2048, num_kv_heads, head_dim), dtype)
    text = lowered_text(functools.partial(write_kv, interpret=False), pool, pool, rows, rows,
                        sds((2048,), jnp.int32))
    assert triton_calls(text) == 1
    assert "output_operand_aliases" in text  # the pool is aliased, not copied
    assert "grid_x = 2048 : i32" in text     # one program per token
    (kernel,) = capture_ttir(functools.partial(write_kv, interpret=False), pool, pool, rows,
                             rows, sds((2048,), jnp.int32))
    stores = re.findall(r"tt\.store %\S+, %\S+ : tensor<([\dx]+)x", kernel.ttir)
    assert stores == (["8x128"] * 2 if num_kv_heads == 8 else ["64"] * 24)





@pytest.mark.parametrize("batch, context, block_q, sliding_window, soft_cap", [
    (1, 8192, 1, None, None), (256, 512, 1, None, None),      # decode: split-K, then none
    (33, 2048, 16, None, None),                               # mixed prefill chunks + decodes
    (16, 1024, 16, 256, 30.0),                                # sliding window and soft cap
])
def test_paged_attention_on_fp8_pool_lowers_for_h200(batch, context, block_q, sliding_window,
                                                     soft_cap):
    """bfloat16 queries over a float8_e4m3fn pool with per-tensor scales: the fp8 tiles are
    loaded and converted inside the Triton kernel (the pool enters it as fp8)."""
    head_dim, page_size = 128, 16
    pool = sds((POOL_PAGES, page_size, KVH, head_dim), FP8)
    args = (sds((batch, block_q, QH, head_dim), jnp.bfloat16), pool, pool,
            sds((batch, context // page_size), jnp.int32), sds((batch,), jnp.int32),
            sds((batch, block_q), jnp.int32))
    fn = functools.partial(paged_attention, scale=head_dim ** -0.5, k_scale=0.05, v_scale=0.02,
                           sliding_window=sliding_window, soft_cap=soft_cap, interpret=False)
    text = lowered_text(fn, *args)
    assert triton_calls(text) == 1
    assert f"tensor<{POOL_PAGES}x{page_size}x{KVH}x{head_dim}xf8E4M3FN>" in text
    assert "fp_to_fp" in text            # the Triton IR's fp8 conversion (tt.fp_to_fp)


@pytest.mark.parametrize("num_kv_heads, head_dim, k_scale", [(8, 128, 1.0), (12, 64, 0.05)])
def test_kv_write_to_fp8_pool_lowers_for_h200(num_kv_heads, head_dim, k_scale):
    """bfloat16 rows quantized (scaled, saturated, rounded to e4m3) inside the write kernel."""
    pool = sds((POOL_PAGES, 16, num_kv_heads, head_dim), FP8)
    rows = sds((2048, num_kv_heads, head_dim), jnp.bfloat16)
    fn = functools.partial(write_kv, k_scale=k_scale, v_scale=0.02, interpret=False)
    text = lowered_text(fn, pool, pool, rows, rows, sds((2048,), jnp.int32))
    assert triton_calls(text) == 1
    assert "output_operand_aliases" in text
    assert "xf8E4M3FN>" in text
    assert "fp_to_fp" in text            # rounded to e4m3 inside the kernel
