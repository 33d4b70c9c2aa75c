"""The kernel microbenchmark (benchmarks/kernels/paged_attention.py) on a CPU: tiny shapes in
interpret mode, its byte and FLOP counts, its rotation plan, budget and variant selection, and
its timed call cross-lowered for an H200."""

import dataclasses
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged.benchmarks.kernels import attention_cases as cases
from jaxpaged.benchmarks.kernels import paged_attention as bench
from jaxpaged.benchmarks.kernels.device_timing import make_sweep, plan_rotation
from pallas_kernels.kv_quant import FP8_DTYPE
from pallas_kernels.lowering import cuda_lowering_context


def test_smoke_run_rows_ratios_and_counts(tmp_path, capsys):
    out = tmp_path / "rows.json"
    assert bench.main(["--smoke", "--output-json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "device-to-device copy" in printed and "goals (issue 19):" in printed
    result = json.loads(out.read_text())
    kernel_row = [bench.KERNEL_ROW] if "v2" in bench.available_kernels() else []
    backends = [f"pallas-{k}" for k in bench.available_kernels()] + kernel_row + ["xla"]
    assert result["backends"] == backends
    rows = {r["case"]: r for r in result["rows"]}
    # mixed:3x64 brings its parts decode:2x64 (already listed) and prefill:1x64, before it
    assert list(rows) == ["decode:2x64", "decode:2x64:fp8", "prefill:1x64", "mixed:3x64"]
    for row in rows.values():
        assert list(row["results"]) == backends
        results = dict(row["results"])
        if row["mode"] != "decode" and kernel_row:
            assert results.pop(bench.KERNEL_ROW) == {"skipped": "decode cases only"}
        assert all(r["ms"] > 0 and r["trials"] >= 1 and r["GBps"] > 0 and r["pct_copy"] > 0
                   for r in results.values())
        assert row["input_sets"] == 2          # --smoke rotates the minimum of two sets
        assert all(r["pct_hbm"] is None for r in results.values())   # no CPU peak
    # 2 sequences x 64 tokens x (2 KV heads x 16 dims) x K and V x 2 bytes (bf16) ...
    kv = 2 * 64 * 32 * 2 * 2
    # ... + q and output (2 tokens x 4 heads x 16 x 2 bytes each) + 2 new K and V rows read in
    # bf16 and written to the pool (2 + 2 bytes a value)
    assert rows["decode:2x64"]["bytes"] == {"kv_read": kv, "total": kv + 2 * 128 * 2 + 2 * 2 * 32 * 4}
    # the fp8 pool holds one byte a value; the new rows are still read in bf16
    assert rows["decode:2x64:fp8"]["bytes"] == {"kv_read": kv // 2,
                                                "total": kv // 2 + 512 + 2 * 2 * 32 * 3}
    # prefill chunk of 32 at positions 32..63: each sees 33..64 keys; 4 FLOPs x 4 heads x 16
    assert rows["prefill:1x64"]["flops"] == 4 * 4 * 16 * sum(range(33, 65))
    assert all("TFLOPs" in r for r in rows["prefill:1x64"]["results"].values() if "ms" in r)
    ms = {case: {b: r["ms"] for b, r in row["results"].items() if "ms" in r}
          for case, row in rows.items()}
    ratios = rows["mixed:3x64"]["ratios"]
    for b in (b for b in backends if b != bench.KERNEL_ROW):
        parts = ms["decode:2x64"][b] + ms["prefill:1x64"][b]
        assert ratios["mixed_over_parts"][b] == pytest.approx(ms["mixed:3x64"][b] / parts)
        assert ratios["vs_xla"].get(b, 1.0) == pytest.approx(ms["mixed:3x64"]["xla"]
                                                             / ms["mixed:3x64"][b])
        assert rows["decode:2x64:fp8"]["ratios"]["fp8_speedup"][b] == pytest.approx(
            ms["decode:2x64"][b] / ms["decode:2x64:fp8"][b])
    if "pallas-v2" in backends:
        assert ratios["v2_over_v1"] == pytest.approx(ms["mixed:3x64"]["pallas-v1"]
                                                     / ms["mixed:3x64"]["pallas-v2"])
    goals = result["goals"]
    assert {g["case"] for g in goals} >= {"decode:64x4096", "decode:2x64:fp8", "mixed:64x4096"}
    assert all(g["met"] is None for g in goals)     # a CPU measures none of the goals


@pytest.mark.parametrize("fp8", [False, True])
def test_kernel_row_computes_what_the_forward_computes(fp8):
    """The kernel-alone row's step (v2's decode kernel on the decode queries) gives the decode
    tokens' outputs of ``pallas-v2``'s whole forward, on a pool already holding their K/V."""
    if "v2" not in bench.available_kernels():
        pytest.skip("this checkout has no v2 kernel")
    backend = bench.make_backends(["v2"], False)[bench.KERNEL_ROW]
    if fp8:
        backend = backend.with_kv_scales(*cases.FP8_SCALES)
    shape = cases.Shape(4, 2, 16, 16, "bfloat16")
    case = cases.parse_case("ragged:3x64" + (":fp8" if fp8 else ""))
    layout, num_pages = cases.build_layout(cases.sequences(case, 32), shape.page_size,
                                           np.random.default_rng(0))
    inputs = cases.make_input_set(0, layout, num_pages, shape, fp8)
    meta = cases.step_metadata(backend, layout)
    forward, (const,) = bench.step_and_constants("pallas-v2", backend, 0.25, [inputs], meta)
    pool, want = forward(inputs["kv_pages"], const, meta)
    alone, (q,) = bench.step_and_constants(bench.KERNEL_ROW, backend, 0.25, [inputs], meta)
    same_pool, got = alone(pool, q, meta)
    assert same_pool is pool and got.shape == (3, 4, 16)
    np.testing.assert_array_equal(np.asarray(got, np.float32),
                                  np.asarray(want[np.asarray(meta["decode_tokens"])], np.float32))


def test_missing_kernel_variant_is_a_clear_error(monkeypatch, capsys):
    monkeypatch.setattr(bench, "available_kernels", lambda: ("v1",))  # today's backend
    assert bench.main(["--smoke", "--kernel", "v1", "v2"]) == 2
    assert "kernel variant v2 not available" in capsys.readouterr().err


def test_time_budget_skips_rows_it_cannot_start(tmp_path):
    out = tmp_path / "rows.json"
    assert bench.main(["--smoke", "--time-budget", "1e-6", "--no-xla", "--kernel", "v1", "--cases", "decode:2x64",
                       "ragged:4x64", "--output-json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["case"] for r in rows] == ["decode:2x64", "ragged:4x64"]
    assert all(r["results"] == {"pallas-v1": {"skipped": "time budget"}} for r in rows)


def test_ragged_case_spreads_lengths():
    case = cases.parse_case("ragged:64x4096")
    seqs = cases.sequences(case, prefill_chunk=2048)
    lengths = np.asarray([c + n for c, n in seqs])
    assert len(seqs) == 64 and all(n == 1 for _, n in seqs)
    assert lengths.min() >= 1 and lengths.max() <= 4096 and lengths.std() > 500
    assert seqs == cases.sequences(case, prefill_chunk=2048)            # deterministic
    layout, num_pages = cases.build_layout(seqs, 16, np.random.default_rng(0))
    assert num_pages == 1 + sum(-(-n // 16) for n in lengths)
    shape = cases.Shape(32, 8, 128, 16, "bfloat16")
    assert cases.traffic_bytes(layout, shape, False)["kv_read"] == 2 * lengths.sum() * 8 * 128 * 2
    pages = layout.page_table[layout.page_table > 0]
    assert sorted(pages) == list(range(1, num_pages))                    # each page once


def test_parse_case():
    assert cases.parse_case("decode:64x4096:fp8") == cases.Case("decode", 64, 4096, True)
    assert cases.parse_case("mixed:64x4096").parts() == (cases.Case("decode", 63, 4096),
                                                         cases.Case("prefill", 1, 4096))
    for bad in ("decode:0x64", "mixed:1x64", "sideways:2x64", "decode:2x64:int8", "decode:2"):
        with pytest.raises(ValueError, match="bad case"):
            cases.parse_case(bad)


def test_plan_rotation():
    # batch 1 / context 8192 bf16 at 8B shapes: a 33.6 MB pool -> 4 sets (134 MB), 2 sweeps a
    # call (8 forwards, the most a call holds)
    assert plan_rotation(33_554_432, 128_000_000, 512_000_000) == (4, 2)
    # batch 33: 554 MB a set -> the minimum two sets, one sweep
    assert plan_rotation(554_000_000, 128_000_000, 512_000_000) == (2, 1)
    # tiny sets: capped at 8 forwards a call
    assert plan_rotation(1000, 128_000_000, 512_000_000) == (8, 1)


@pytest.mark.parametrize("name", ["decode:64x4096:fp8", "mixed:64x4096"])
def test_benchmark_step_lowers_for_an_h200_with_pools_donated(name):
    """The jitted call the benchmark times, at Llama-3-8B shapes, cross-lowered for an H200
    (abstract inputs, no memory): Pallas (Triton) kernels for every variant and for the
    decode kernel's own row, and all four pools of its two input sets aliased to outputs, so
    the KV writes stay in place on the GPU (and the kernel row's pools pass through)."""
    case = cases.parse_case(name)
    layout, num_pages = cases.build_layout(cases.sequences(case, 2048), 16,
                                           np.random.default_rng(0))
    abstract = lambda shape_, dtype: jax.ShapeDtypeStruct(shape_, dtype)
    pool = (abstract((num_pages, 16, 8, 128), FP8_DTYPE if case.fp8 else jnp.bfloat16),) * 2
    t = layout.num_tokens
    for name, backend in bench.make_backends(list(bench.available_kernels()), False).items():
        if name == bench.KERNEL_ROW and case.mode != "decode":
            continue
        backend = dataclasses.replace(backend, interpret=False)
        if case.fp8:
            backend = backend.with_kv_scales(*cases.FP8_SCALES)
        meta = {k: abstract(v.shape, v.dtype)
                for k, v in cases.step_metadata(backend, layout).items()}
        const = (abstract((t, 32, 128), jnp.bfloat16), abstract((t, 8, 128), jnp.bfloat16),
                 abstract((t, 8, 128), jnp.bfloat16))
        step = bench.forward_step(backend, 128 ** -0.5)
        if name == bench.KERNEL_ROW:         # the decode kernel alone on the decode queries
            const = (abstract((meta["decode_tokens"].shape[0], 32, 128), jnp.bfloat16),)
            step = bench.kernel_step(backend, 128 ** -0.5)
        with cuda_lowering_context():
            text = jax.jit(make_sweep(step, 1),
                           donate_argnums=0).trace((pool, pool), (const, const), meta).lower(
                lowering_platforms=("cuda",)).as_text()
        assert "__gpu$xla.gpu.triton" in text
        main = text[text.index("func.func public @main"):].split("\n", 1)[0]
        assert [int(i) for i in re.findall(r"tf.aliasing_output = (\d+)", main)] == [0, 1, 2, 3]
