"""Time the C++ CPU attention kernel (``jaxpaged.layers.attention.cpu``) over a decode step
of a whole model: ``--layers`` calls in one jitted program, each over its own K/V pools, every
sequence at ``--context`` keys in pages scattered at random over a pool of ``--pool-pages``.

The default shape is SmolLM2-135M's (9 query heads over 3 KV heads of 64, bfloat16 pool,
pages of 16 rows, 30 layers): at 16 sequences of 120 keys the step reads ~44 MB of K/V, more
than the L3 of the 2-core machines this project is measured on, so the figure is the
kernel's rate from memory. ``--pool-pages`` no larger than a sequence's page count keeps every
page in cache (its compute alone). Prints the median and 10th percentile of ``--repeat``
timed steps and the K/V bytes read per second at the median.

Usage: ``python -m benchmarks.kernels.cpu_decode_attention --batch 16 --context 120``
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.layers.attention.cpu import paged_attention_cpu
from jaxpaged.layers.cpu_build import load_cpu_kernels


def main(argv=None) -> None:
    """Parse the flags (module docstring), time the step and print one line."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=120)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--heads", type=int, nargs=2, default=(9, 3), metavar=("H", "KVH"))
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--pool-pages", type=int, default=800)
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    ap.add_argument("--repeat", type=int, default=200)
    args = ap.parse_args(argv)
    if not load_cpu_kernels():
        raise SystemExit("the C++ CPU kernels did not build (see the warning above)")
    heads, kv_heads = args.heads
    pages = -(-args.context // args.page_size)
    rng = np.random.default_rng(0)
    dtype = jnp.dtype(args.dtype)

    def pool():
        shape = (args.pool_pages, args.page_size, kv_heads, args.head_dim)
        return jnp.asarray(rng.standard_normal(shape, np.float32), dtype)

    pools = [(pool(), pool()) for _ in range(args.layers)]
    page_table = jnp.asarray(np.stack([
        rng.choice(np.arange(1, args.pool_pages), pages, replace=args.pool_pages <= pages)
        for _ in range(args.batch)]).astype(np.int32))
    q = jnp.asarray(rng.standard_normal((args.batch, heads, args.head_dim), np.float32), dtype)
    tokens = jnp.arange(args.batch, dtype=jnp.int32)[:, None]
    positions = jnp.full((args.batch, 1), args.context - 1, jnp.int32)

    @jax.jit
    def step(x, pools, page_table):
        for k, v in pools:
            x = paged_attention_cpu(x, k, v, page_table, tokens, tokens[:, 0], positions,
                                    scale=args.head_dim ** -0.5)
        return x

    step(q, pools, page_table).block_until_ready()
    times = []
    for _ in range(args.repeat):
        start = time.perf_counter()
        step(q, pools, page_table).block_until_ready()
        times.append(time.perf_counter() - start)
    median, p10 = np.median(times), np.percentile(times, 10)
    read = args.batch * args.context * kv_heads * args.head_dim * 2 * dtype.itemsize * args.layers
    print(f"batch {args.batch} context {args.context} {args.dtype}: median {median * 1e3:.3f} ms,"
          f" p10 {p10 * 1e3:.3f} ms, {read / median / 1e9:.1f} GB/s of K/V")


if __name__ == "__main__":
    main()
