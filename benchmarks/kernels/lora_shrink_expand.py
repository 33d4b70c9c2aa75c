"""Microbenchmark of the batched LoRA delta ``x[t] @ A[s_t] @ B[s_t]`` over a mixed batch
(``docs/lora.md``): the three ways of ``jaxpaged.layers.lora`` considered, jitted, on the
default device.

- ``dense``: shrink against every adapter slot, one-hot mask, one expand over [S * r]
  (``jaxpaged.layers.lora.lora_delta``, what the engine runs);
- ``gather``: each token's A and B gathered ([T, d_in, r], [T, r, d_out]) then two batched
  vector-matrix products;
- ``ragged``: rows sorted by slot, ``jax.lax.ragged_dot`` for shrink and expand, then
  un-sorted.

    .venv/bin/python -m jaxpaged.benchmarks.kernels.lora_shrink_expand
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.layers.lora import lora_delta


def gather_delta(x, slots, a, b):
    """Per-token gathered weights: [T, d_in] -> [T, d_out]."""
    shrunk = jnp.einsum("td,tdr->tr", x, a[slots])
    return jnp.einsum("tr,tro->to", shrunk, b[slots])


def ragged_delta(x, slots, a, b):
    """Slot-sorted rows through ``jax.lax.ragged_dot``: [T, d_in] -> [T, d_out]."""
    order = jnp.argsort(slots, stable=True)
    sizes = jnp.bincount(slots, length=a.shape[0]).astype(jnp.int32)
    shrunk = jax.lax.ragged_dot(x[order], a, sizes)
    out = jax.lax.ragged_dot(shrunk, b, sizes)
    return jnp.zeros_like(out).at[order].set(out)


VARIANTS = {"dense": lora_delta, "gather": gather_delta, "ragged": ragged_delta}


def time_call(fn, *args, repeats: int) -> float:
    """Median seconds of ``fn(*args)`` after one compiling call."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[64, 256, 2048])
    p.add_argument("--d-in", type=int, default=768)
    p.add_argument("--d-out", type=int, default=768)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--max-loras", type=int, default=4)
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args(argv)
    rng = np.random.default_rng(0)
    s = args.max_loras + 1
    a = jnp.asarray(rng.normal(size=(s, args.d_in, args.rank)), jnp.float32).at[0].set(0)
    b = jnp.asarray(rng.normal(size=(s, args.rank, args.d_out)), jnp.float32).at[0].set(0)
    w = jnp.asarray(rng.normal(size=(args.d_in, args.d_out)), jnp.float32)
    result = {}
    for t in args.tokens:
        x = jnp.asarray(rng.normal(size=(t, args.d_in)), jnp.float32)
        slots = jnp.asarray(rng.integers(0, s, t), jnp.int32)
        want = np.asarray(jax.jit(gather_delta)(x, slots, a, b))
        row = {"base_matmul": time_call(jax.jit(jnp.dot), x, w, repeats=args.repeats)}
        for name, fn in VARIANTS.items():
            got = np.asarray(jax.jit(fn)(x, slots, a, b))
            assert np.allclose(got, want, rtol=1e-4, atol=1e-3), name
            row[name] = time_call(jax.jit(fn), x, slots, a, b, repeats=args.repeats)
        result[t] = row
        print(f"T={t:<5} " + "  ".join(f"{k} {1e3 * v:8.3f} ms" for k, v in row.items()))
    return result


if __name__ == "__main__":
    main()
