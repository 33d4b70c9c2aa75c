"""The C++ paged attention kernel (``cpu`` backend) against the ``xla`` backend, its oracle."""

import dataclasses
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged.layers import cpu_build
from jaxpaged.runner import compile_cache
from jaxpaged.layers.attention import get_attention_backend, selection
from jaxpaged.layers.attention.cpu import CpuAttentionBackend, kernel_available, paged_attention_cpu
from jaxpaged.layers.attention.xla import XlaAttentionBackend, paged_attention_chunked
from pallas_kernels.kv_quant import FP8_DTYPE, quantize_kv
from tests.kernels.ragged_batches import block_inputs, device_metadata, make_batch, random_seqs

pytestmark = pytest.mark.skipif(not kernel_available(), reason="no C++ compiler: "
                                "test_missing_compiler_falls_back_to_xla covers that")
TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


def forward_both(batch, backend_kwargs=None, **options):
    """Both backends' forward (KV write, then attention) on ``batch``: (cpu, xla) outputs as
    float32 numpy over the real tokens, and the two updated pools."""
    outs, pools = [], []
    for backend in (CpuAttentionBackend(**(backend_kwargs or {})),
                    XlaAttentionBackend(**(backend_kwargs or {}))):
        meta = device_metadata(backend, batch.layout)
        fn = jax.jit(lambda q, k, v, pool, meta: backend.forward(
            q, k, v, pool, meta, scale=batch.q.shape[-1] ** -0.5, **options))
        out, pool = fn(batch.q, batch.k, batch.v, (batch.k_pages, batch.v_pages), meta)
        outs.append(np.asarray(out, np.float32)[:batch.layout.num_tokens])
        pools.append(pool)
    return outs, pools


@pytest.mark.parametrize("dtype,num_heads,num_kv_heads,page_size", [
    (jnp.float32, 4, 4, 16), (jnp.float32, 8, 2, 16), (jnp.bfloat16, 8, 2, 16),
    (jnp.bfloat16, 12, 4, 8)])
def test_decode_batch_matches_xla(dtype, num_heads, num_kv_heads, page_size):
    """Decodes at context 1, on both sides of page boundaries and over many pages (up to 40),
    pages shuffled in the pool, padding sequences and tokens."""
    rng = np.random.default_rng(num_heads + page_size)
    contexts = [0, page_size - 1, page_size, 2 * page_size - 1, 5, 40 * page_size - 3, 77]
    batch = make_batch(rng, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=64,
                       page_size=page_size, dtype=dtype, seqs=[(c, 1) for c in contexts],
                       pad_tokens=0)
    assert batch.layout.is_decode_only
    (ours, theirs), (pool, pool_xla) = forward_both(batch)
    np.testing.assert_allclose(ours, theirs, atol=TOLERANCE[dtype], rtol=0)
    assert all(jnp.array_equal(a, b) for a, b in zip(pool, pool_xla))      # same KV write


@pytest.mark.parametrize("dtype,num_heads,num_kv_heads,page_size,head_dim", [
    (jnp.float32, 4, 4, 16, 64), (jnp.float32, 8, 2, 16, 64), (jnp.bfloat16, 8, 2, 16, 64),
    (jnp.bfloat16, 12, 4, 8, 32), (jnp.float32, 16, 2, 32, 80), (jnp.float32, 8, 1, 16, 128)])
def test_mixed_step_matches_xla(dtype, num_heads, num_kv_heads, page_size, head_dim):
    """A mixed step (block_q 16): decodes, first prefill chunks, chunks starting mid-sequence
    and a 70-token prompt, with padding tokens and sequences; G = 1, 3, 4 and 8 (so blocks
    take both the row-tile path and, for blocks with few real queries, the one-query path)."""
    rng = np.random.default_rng(num_heads * page_size + head_dim)
    seqs = random_seqs(rng, 9, page_size) + [(0, 70), (3 * page_size - 1, 2)]
    batch = make_batch(rng, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                       page_size=page_size, dtype=dtype, seqs=seqs)
    assert not batch.layout.is_decode_only
    (ours, theirs), (pool, pool_xla) = forward_both(batch)
    np.testing.assert_allclose(ours, theirs, atol=TOLERANCE[dtype], rtol=0)
    assert all(jnp.array_equal(a, b) for a, b in zip(pool, pool_xla))      # same KV write


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,page_size,decode_only", [
    (9, 3, 64, 16, True), (8, 2, 128, 16, True), (4, 4, 64, 16, True), (8, 2, 64, 16, False),
    (12, 4, 32, 8, False)])
def test_float16_pool_under_float32_queries_matches_xla(num_heads, num_kv_heads, head_dim,
                                                         page_size, decode_only):
    """``--kv-cache-dtype float16`` under a float32 model: the kernel widens the pool's
    elements as it reads them, on every path (register accumulators, one query at a time, row
    tiles), and equals the xla backend, which promotes the pool to float32; both write the
    same float16 rows."""
    rng = np.random.default_rng(num_heads * head_dim + page_size)
    seqs = ([(c, 1) for c in (0, 15, 16, 17, 33, 100, 5 * page_size + 7)] if decode_only
            else random_seqs(rng, 9, page_size) + [(0, 70)])
    batch = make_batch(rng, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                       page_size=page_size, dtype=jnp.float32, seqs=seqs,
                       pad_tokens=0 if decode_only else 3)
    batch = dataclasses.replace(batch, k_pages=batch.k_pages.astype(jnp.float16),
                                v_pages=batch.v_pages.astype(jnp.float16))
    assert selection.get_attention_backend(
        "auto", num_kv_heads=num_kv_heads, num_heads=num_heads, head_dim=head_dim,
        page_size=page_size, dtype=jnp.float32, kv_cache_dtype=jnp.float16).name == "cpu"
    (ours, theirs), (pool, pool_xla) = forward_both(batch)
    np.testing.assert_allclose(ours, theirs, atol=1e-5, rtol=0)
    assert pool[0].dtype == jnp.float16
    assert all(jnp.array_equal(a, b) for a, b in zip(pool, pool_xla))


@pytest.mark.parametrize("dtype,num_heads,num_kv_heads,head_dim,page_size,window", [
    (jnp.bfloat16, 9, 3, 64, 16, None), (jnp.float32, 9, 3, 64, 32, None),
    (jnp.float32, 4, 2, 128, 16, None), (jnp.bfloat16, 2, 2, 128, 32, 40),
    (jnp.float32, 8, 2, 64, 16, 19)])
def test_decodes_with_register_accumulators_match_xla(dtype, num_heads, num_kv_heads, head_dim,
                                                       page_size, window):
    """The decode path that keeps its accumulators in registers (``csrc/one_query_regs.h``:
    G x D / 16 <= 16, pages of 16 or 32 rows; SmolLM2's G = 3, D = 64 first), at every
    offset of a 16-key chunk: contexts on both sides of chunk and page edges, a window
    starting mid-chunk."""
    rng = np.random.default_rng(num_heads * head_dim + page_size)
    contexts = [0, 1, 15, 16, 17, 31, 32, 33, 47, 100, 5 * page_size + 7]
    batch = make_batch(rng, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                       page_size=page_size, dtype=dtype, seqs=[(c, 1) for c in contexts],
                       pad_tokens=0)
    assert batch.layout.is_decode_only
    (ours, theirs), _ = forward_both(batch, sliding_window=window)
    np.testing.assert_allclose(ours, theirs, atol=TOLERANCE[dtype], rtol=0)


@pytest.mark.parametrize("sliding_window,soft_cap", [(24, None), (None, 30.0), (7, 20.0)])
@pytest.mark.parametrize("decode_only", [True, False])
def test_sliding_window_and_soft_cap_match_xla(sliding_window, soft_cap, decode_only):
    rng = np.random.default_rng(3)
    seqs = [(c, 1) for c in (0, 6, 23, 24, 100, 161)]
    if not decode_only:
        seqs += [(0, 40), (30, 19), (100, 3)]
    batch = make_batch(rng, num_heads=8, num_kv_heads=2, head_dim=32, page_size=16,
                       dtype=jnp.float32, seqs=seqs, pad_tokens=0 if decode_only else 5)
    (ours, theirs), _ = forward_both(batch, sliding_window=sliding_window, soft_cap=soft_cap)
    np.testing.assert_allclose(ours, theirs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("decode_only", [True, False])
def test_kv_scales_match_xla(decode_only):
    rng = np.random.default_rng(4)
    seqs = [(c, 1) for c in (3, 50, 129)] + ([] if decode_only else [(0, 33)])
    batch = make_batch(rng, num_heads=4, num_kv_heads=2, head_dim=64, page_size=16,
                       dtype=jnp.float32, seqs=seqs, pad_tokens=0)
    (ours, theirs), _ = forward_both(batch, dict(k_scale=0.5, v_scale=2.0))
    np.testing.assert_allclose(ours, theirs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("block_q,group,dtype,nb", [
    (2, 1, jnp.float32, 11), (3, 4, jnp.float32, 11), (5, 2, jnp.bfloat16, 11),
    (8, 1, jnp.float32, 11), (16, 1, jnp.bfloat16, 11), (16, 3, jnp.float32, 11),
    (16, 8, jnp.float32, 1)])
def test_query_blocks_of_any_size_match_xla(block_q, group, dtype, nb):
    """Blocks of block_q consecutive queries (a speculative verify step's 1 + k), each with a
    random number of real queries and padding after them: the kernel equals the oracle on the
    real queries and writes zeros for the padding ones (one block: its KV heads are split
    over work items)."""
    rng = np.random.default_rng(block_q * 10 + group)
    args, real = block_inputs(rng, nb=nb, block_q=block_q, group=group, dtype=dtype)
    q, k, v, page_table, seq, pos = args
    ours = np.asarray(jax.jit(lambda q, k, v, *a: CpuAttentionBackend().attend(
        q, (k, v), *a, scale=0.125))(*args), np.float32)
    theirs = np.asarray(jax.jit(lambda *a: paged_attention_chunked(*a, scale=0.125))(*args),
                        np.float32)
    np.testing.assert_allclose(ours[real], theirs[real], atol=TOLERANCE[dtype], rtol=0)
    assert not ours[~real].any()


def test_fp8_pool_takes_the_xla_path():
    """An fp8 pool never reaches the kernel: the result is the xla backend's, bit for bit."""
    rng = np.random.default_rng(5)
    q = jnp.asarray(rng.normal(size=(3, 1, 4, 64)), jnp.float32)
    pool = quantize_kv(jnp.asarray(rng.normal(size=(8, 16, 2, 64)), jnp.float32), 1.0, FP8_DTYPE)
    args = (q, (pool, pool), jnp.asarray([[1, 2], [3, 4]], jnp.int32),
            jnp.asarray([0, 1, 0], jnp.int32), jnp.asarray([[20], [9], [-1]], jnp.int32))
    ours = CpuAttentionBackend().attend(*args, scale=0.125)
    theirs = XlaAttentionBackend().attend(*args, scale=0.125)
    assert jnp.array_equal(ours, theirs, equal_nan=True)    # (the padding block: NaN)


def test_padding_blocks_are_zero_and_thread_split_agrees():
    """One long sequence (2 blocks: too few to fill the threads, so each block's KV heads are
    split over work items) equals the oracle; a padding block (position -1) gives zeros."""
    rng = np.random.default_rng(6)
    q = jnp.asarray(rng.normal(size=(2, 1, 8, 64)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(70, 16, 4, 64)), jnp.float32) for _ in range(2))
    page_table = jnp.asarray(rng.permutation(np.arange(1, 70))[None, :64], jnp.int32)
    seq, pos = jnp.zeros(2, jnp.int32), jnp.asarray([[1000], [-1]], jnp.int32)
    out = np.asarray(CpuAttentionBackend().attend(q, (k, v), page_table, seq, pos, scale=0.125))
    ref = np.asarray(paged_attention_chunked(q, k, v, page_table, seq, pos, scale=0.125))
    np.testing.assert_allclose(out[0], ref[0], atol=1e-5, rtol=0)
    assert not out[1].any()


def test_auto_picks_cpu_on_cpu_for_its_dtypes():
    assert get_attention_backend("auto", num_kv_heads=2, num_heads=4, head_dim=64,
                                 dtype=jnp.float32).name == "cpu"
    assert get_attention_backend("cpu").name == "cpu"
    assert get_attention_backend("auto", num_kv_heads=2, num_heads=4, head_dim=64,
                                 dtype=jnp.bfloat16, kv_cache_dtype=FP8_DTYPE).name == "xla"


def test_missing_compiler_falls_back_to_xla(monkeypatch, caplog, tmp_path):
    monkeypatch.setenv(cpu_build.CXX_ENV, str(tmp_path / "no-such-g++"))
    with caplog.at_level(logging.WARNING, logger=cpu_build.__name__):
        assert not cpu_build.load_cpu_kernels()
        assert get_attention_backend("cpu").name == "xla"
        assert get_attention_backend("auto", num_kv_heads=2, num_heads=4, head_dim=64,
                                     dtype=jnp.float32).name == "xla"
    warnings = [r for r in caplog.records if "kernels unavailable" in r.getMessage()]
    assert len(warnings) == 1 and "no-such-g++" in warnings[0].getMessage()


def test_failed_self_check_falls_back_to_xla(monkeypatch, caplog, tmp_path):
    monkeypatch.setenv(compile_cache.CACHE_ROOT_ENV, str(tmp_path))   # no pass on record
    monkeypatch.setattr(selection, "self_check", lambda *a, **k: 0.5)
    with caplog.at_level(logging.WARNING, logger=selection.__name__):
        assert get_attention_backend("auto", dtype=jnp.float32).name == "xla"
    assert "differs from the xla reference" in caplog.text


def test_a_passed_self_check_is_recorded_and_not_run_again(monkeypatch, caplog, tmp_path):
    """The first ``auto`` on the CPU runs the self-check and records its pass beside the
    kernel library; the next one with the same shapes takes the record (the check is not
    called), other shapes check again, and ``JAXPAGED_DISABLE_COMPILE_CACHE`` ignores it."""
    monkeypatch.setenv(compile_cache.CACHE_ROOT_ENV, str(tmp_path))
    pick = lambda heads: get_attention_backend("auto", num_kv_heads=2, num_heads=heads,
                                               head_dim=64, dtype=jnp.float32).name
    errors = []
    real = selection.self_check
    monkeypatch.setattr(selection, "self_check",
                        lambda *a, **k: errors.append(real(*a, **k)) or errors[-1])
    with caplog.at_level(logging.INFO, logger=selection.__name__):
        assert pick(4) == "cpu" and len(errors) == 2      # the mixed and the decode step
        assert [n for n in os.listdir(tmp_path / "kernels") if n.startswith("self-check-")]
        assert pick(4) == "cpu" and len(errors) == 2
    assert f"self-check on record, max error {max(errors):.3g}" in caplog.text
    assert pick(8) == "cpu" and len(errors) == 4
    monkeypatch.setenv(compile_cache.DISABLE_ENV, "1")
    assert pick(4) == "cpu" and len(errors) == 6



@pytest.mark.parametrize("model, page_size", [
    ("qwen3_next", 4), ("gguf_2026/qwen3_next.f32.gguf", 4), ("qwen3_next", 16),
    ("gguf_2026/gpt_oss.mxfp4.gguf", 4), ("qwen3_next", 1), ("qwen3_next", 2)])
def test_auto_picks_cpu_at_small_pages_for_the_fixtures(monkeypatch, caplog, tmp_path, model,
                                                        page_size):
    """Issue 45: the self-check's 38 tokens (a chunk to position 24, a decode at 37) once sat
    in a 4-page table, too short below 10-token pages: at ``--block-size 4`` (the family
    tests' engines, Qwen3-Next's HF and GGUF fixtures) it raised IndexError and ``auto`` fell
    back to xla. Now both steps run, pass, and ``cpu`` is picked without a warning."""
    from jaxpaged.config import ModelConfig
    from tests.conftest import FIXTURES

    cfg = ModelConfig.from_pretrained(os.path.join(FIXTURES, model))
    monkeypatch.setenv(compile_cache.CACHE_ROOT_ENV, str(tmp_path))   # no pass on record
    errors = []
    real = selection.self_check
    monkeypatch.setattr(selection, "self_check",
                        lambda *a, **k: errors.append(real(*a, **k)) or errors[-1])
    with caplog.at_level(logging.WARNING, logger=selection.__name__):
        backend = get_attention_backend("auto", num_kv_heads=cfg.num_kv_heads,
                                        num_heads=cfg.num_heads, head_dim=cfg.head_dim,
                                        page_size=page_size, dtype=jnp.float32)
    assert caplog.text == "" and backend.name == "cpu"
    assert len(errors) == 2 and max(errors) <= TOLERANCE[jnp.float32]


def test_self_check_pages_names_a_bad_page_size():
    assert [selection.self_check_pages(p) for p in (1, 4, 8, 16, 256)] == [38, 10, 5, 4, 4]
    with pytest.raises(ValueError, match="page_size must be >= 1, got 0"):
        selection.self_check_pages(0)


_LOAD_AND_RUN = """
import sys, numpy as np, jax
from jaxpaged.runner.executable_store import ExecutableStore
data = np.load(sys.argv[2])
step = ExecutableStore(sys.argv[1]).load("decode", jax.devices()[:1])
out = step(*(data[f"a{i}"] for i in range(7)))
print(float(np.abs(np.asarray(out) - data["out"]).max()))
"""


def test_stored_step_with_the_kernel_runs_in_a_fresh_process(tmp_path):
    """A compiled step calling the kernel round-trips through the executable store: a new
    process (which registers the FFI target in ``ExecutableStore.load``) runs it and gets the
    same output."""
    import os
    import subprocess
    import sys

    from jaxpaged.runner.executable_store import ExecutableStore

    rng = np.random.default_rng(7)
    args = (jnp.asarray(rng.normal(size=(4, 4, 32)), jnp.float32),
            *(jnp.asarray(rng.normal(size=(9, 8, 2, 32)), jnp.float32) for _ in range(2)),
            jnp.asarray([[1, 2, 3, 4], [5, 6, 7, 8]], jnp.int32),
            jnp.asarray([[0, 1], [2, 4], [4, 4]], jnp.int32), jnp.asarray([1, 0, 1], jnp.int32),
            jnp.asarray([[30, 31], [4, -1], [-1, -1]], jnp.int32))
    f = jax.jit(lambda *a: paged_attention_cpu(*a, scale=0.2) * 2.0)
    store = ExecutableStore(str(tmp_path / "steps"))
    compiled = store.compile("decode", lambda: f.lower(*args))
    assert os.listdir(tmp_path / "steps") == ["decode.pkl"]
    out = np.asarray(compiled(*args))
    np.savez(tmp_path / "data.npz", out=out, **{f"a{i}": np.asarray(a) for i, a in enumerate(args)})
    run = subprocess.run([sys.executable, "-c", _LOAD_AND_RUN, str(tmp_path / "steps"),
                          str(tmp_path / "data.npz")], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert float(run.stdout.split()[-1]) == 0.0
