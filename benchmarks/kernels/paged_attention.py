"""Microbenchmark: Pallas ragged paged attention vs the xla backend on the same inputs.

Shapes default to Llama-3-8B attention (32 query heads, 8 KV heads, head_dim 128, page 16,
bf16). For each (mode, batch, context) both backends run the same jitted call; the script
prints the median time, the achieved K/V bandwidth (bytes of K and V that the batch's
sequences hold, read once, divided by the time), its fraction of the device's HBM peak, and the
pallas/xla speedup. Compile time is measured separately and excluded from the timings.

Modes: ``decode`` (every sequence has one new token at position ``context - 1``) and ``mixed``
(``batch - 1`` decodes plus one 256-token prefill chunk ending at ``context``).

Usage (GPU; from the repository root, with the project installed or ``PYTHONPATH=.``)::

    python benchmarks/kernels/paged_attention.py                       # full sweep
    python benchmarks/kernels/paged_attention.py --batch 64 --context 4096 --mode decode

``--smoke`` runs tiny shapes in interpret mode so the script can be checked on a CPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.paged_attention import paged_attention
from pallas_kernels.reference import paged_attention_reference

#: HBM peak bandwidth in bytes/s by device kind (NVIDIA data sheets).
HBM_PEAK = {"H200": 4.8e12, "H100": 3.35e12}
PREFILL_CHUNK = 256
BLOCK_Q = 16


def hbm_peak(device) -> float | None:
    kind = getattr(device, "device_kind", "")
    return next((bw for name, bw in HBM_PEAK.items() if name in kind), None)


def make_inputs(rng, mode, batch, context, args):
    """Query blocks, a shuffled pool holding exactly the batch's pages, and the K/V byte count."""
    dtype = jnp.dtype(args.dtype)
    s, kvh, d, qh = args.page_size, args.num_kv_heads, args.head_dim, args.num_heads
    pages_per_seq = -(-context // s)
    num_pages = batch * pages_per_seq + 1
    page_table = rng.permutation(np.arange(1, num_pages)).reshape(batch, pages_per_seq)
    if mode == "decode":
        block_q, nb = 1, batch
        block_seq = np.arange(batch)
        positions = np.full((batch, 1), context - 1)
    else:
        chunk = min(PREFILL_CHUNK, context)
        chunk_blocks = chunk // BLOCK_Q
        block_q, nb = BLOCK_Q, batch - 1 + chunk_blocks
        block_seq = np.concatenate([np.arange(batch - 1), np.full(chunk_blocks, batch - 1)])
        positions = np.full((nb, BLOCK_Q), -1)
        positions[: batch - 1, 0] = context - 1
        start = context - chunk
        positions[batch - 1:] = (start + np.arange(chunk)).reshape(chunk_blocks, BLOCK_Q)
    pool_shape = (num_pages, s, kvh, d)
    key = jax.random.key(0)
    k_pages = jax.random.normal(key, pool_shape, dtype)
    v_pages = jax.random.normal(jax.random.fold_in(key, 1), pool_shape, dtype)
    q = jax.random.normal(jax.random.fold_in(key, 2), (nb, block_q, qh, d), dtype)
    kv_bytes = 2 * batch * context * kvh * d * dtype.itemsize
    return (q, k_pages, v_pages, jnp.asarray(page_table, jnp.int32),
            jnp.asarray(block_seq, jnp.int32), jnp.asarray(positions, jnp.int32)), kv_bytes


def time_call(fn, inputs, iters, warmup):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*inputs))
    compile_s = time.perf_counter() - t0
    for _ in range(warmup):
        jax.block_until_ready(fn(*inputs))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*inputs))
        times.append(time.perf_counter() - t0)
    return statistics.median(times), compile_s


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mode", choices=("decode", "mixed", "both"), default="both")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64, 256])
    p.add_argument("--context", type=int, nargs="+", default=[512, 2048, 4096, 8192])
    p.add_argument("--num-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--output-json", default=None, help="write all rows to this file")
    p.add_argument("--smoke", action="store_true",
                   help="tiny shapes in interpret mode (checks the script on a CPU)")
    args = p.parse_args(argv)
    interpret = None
    if args.smoke:
        args.batch, args.context, args.iters, args.warmup = [2], [64], 2, 0
        args.num_heads, args.num_kv_heads, args.head_dim = 4, 2, 16
        interpret = True

    device = jax.devices()[0]
    peak = hbm_peak(device)
    scale = args.head_dim ** -0.5
    backends = {
        "pallas": jax.jit(lambda *a: paged_attention(*a, scale=scale, interpret=interpret)),
        "xla": jax.jit(lambda *a: paged_attention_reference(*a, scale=scale)),
    }
    print(f"device: {device.device_kind} ({jax.default_backend()}), HBM peak "
          f"{peak / 1e12 if peak else float('nan'):.2f} TB/s; heads {args.num_heads}/"
          f"{args.num_kv_heads}, head_dim {args.head_dim}, page {args.page_size}, {args.dtype}")
    print(f"{'mode':6} {'batch':>5} {'context':>7} | {'pallas ms':>9} {'GB/s':>7} {'%peak':>6} | "
          f"{'xla ms':>8} {'GB/s':>7} {'%peak':>6} | {'speedup':>7}")
    rows = []
    rng = np.random.default_rng(0)
    modes = ("decode", "mixed") if args.mode == "both" else (args.mode,)
    for mode in modes:
        for batch in args.batch:
            for context in args.context:
                if mode == "mixed" and batch < 2:
                    continue
                inputs, kv_bytes = make_inputs(rng, mode, batch, context, args)
                row = {"mode": mode, "batch": batch, "context": context, "kv_bytes": kv_bytes}
                for name, fn in backends.items():
                    try:
                        t, compile_s = time_call(fn, inputs, args.iters, args.warmup)
                    except Exception as e:  # noqa: BLE001 - e.g. out of memory for xla's gather
                        row[name] = {"error": f"{type(e).__name__}: {str(e)[:120]}"}
                        continue
                    bw = kv_bytes / t
                    row[name] = {"ms": t * 1e3, "compile_s": compile_s, "GBps": bw / 1e9,
                                 "frac_peak": bw / peak if peak else None}
                rows.append(row)
                print(format_row(row))
                del inputs
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"device": device.device_kind, "hbm_peak": peak, "rows": rows}, f, indent=1)
    print(json.dumps({"device": device.device_kind, "rows": len(rows)}))
    return 0


def format_row(row) -> str:
    def cell(r):
        if "error" in r:
            return f"{'error':>9} {'':>7} {'':>6}"
        frac = f"{100 * r['frac_peak']:5.1f}%" if r["frac_peak"] is not None else f"{'n/a':>6}"
        return f"{r['ms']:9.3f} {r['GBps']:7.1f} {frac}"

    pa, xa = row["pallas"], row["xla"]
    speed = (f"{xa['ms'] / pa['ms']:6.2f}x" if "ms" in pa and "ms" in xa else f"{'n/a':>7}")
    return (f"{row['mode']:6} {row['batch']:5d} {row['context']:7d} | {cell(pa)} | {cell(xa)} | "
            f"{speed}")


if __name__ == "__main__":
    sys.exit(main())
