"""Time Qwen3-Next's Gated DeltaNet over one multi-token step: the convolution and the gated
delta rule (``jaxpaged.layers.gated_deltanet.ragged_gated_delta``), token by token (``scan``,
the path before issue 45's chunked prefill) or chunked (``xla``, ``pallas``).

Shapes: ``fixture`` is the test checkpoint's layer (``tests/fixtures/qwen3_next``: 2 key heads
x 16, 4 value heads x 8, width-4 convolution); ``80b`` is Qwen3-Next-80B-A3B's (16 key heads
x 128, 32 value heads x 128). Steps: ``prefill:N`` one fresh N-token prompt; ``mixed:D+N``
D one-token decodes (distinct slots, nonzero states) then an N-token prompt. Inputs are
random float32; each case is jitted once (compile time reported), then timed ``--repeat``
times, the best kept: wall clock (``block_until_ready``) and the process's CPU time (steadier
on a shared machine; it sums XLA's threads).

Usage: ``python -m benchmarks.kernels.deltanet_prefill --shape fixture --step prefill:512
--prefill scan xla``
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.layers.gated_deltanet import ragged_gated_delta

SHAPES = {"fixture": (2, 16, 4, 8), "80b": (16, 128, 32, 128)}
KERNEL = 4


def step_inputs(shape: str, step: str, seed: int = 0):
    """The arguments of ``ragged_gated_delta`` for a step (module docstring) and its real
    mask; slots: one per sequence plus the scratch row."""
    nk, dk, nv, dv = SHAPES[shape]
    kind, sizes = step.split(":")
    decodes, prompt = (0, int(sizes)) if kind == "prefill" else map(int, sizes.split("+"))
    rng = np.random.default_rng(seed)
    slots = np.concatenate([np.arange(decodes), np.full(prompt, decodes)]).astype(np.int32)
    positions = np.concatenate([np.full(decodes, 7), np.arange(prompt)]).astype(np.int32)
    t, c, s = len(slots), 2 * nk * dk + nv * dv, decodes + 2
    f32 = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
    args = (f32(t, c), -jnp.abs(f32(t, nv)), jax.nn.sigmoid(f32(t, nv)), jnp.asarray(slots),
            jnp.asarray(positions == 0), f32(c, KERNEL) * 0.5, f32(s, KERNEL - 1, c),
            f32(s, nv, dk, dv), nk, dk, nv, dv)
    return args, jnp.ones(t, bool)


def time_case(shape: str, step: str, prefill: str, chunk: int,
              repeat: int) -> tuple[float, float, float]:
    """(compile seconds, best wall seconds, best CPU seconds) of one step."""
    args, real = step_inputs(shape, step)
    fn = jax.jit(functools.partial(ragged_gated_delta, distinct=jnp.asarray(False), real=real,
                                   prefill=prefill, chunk=chunk),
                 static_argnums=(8, 9, 10, 11))
    start = time.perf_counter()
    compiled = fn.lower(*args).compile()
    compile_s = time.perf_counter() - start
    wall = cpu = float("inf")
    for _ in range(repeat + 1):                                   # the first one warms up
        start, start_cpu = time.perf_counter(), time.process_time()
        jax.block_until_ready(compiled(*args[:8]))
        wall = min(wall, time.perf_counter() - start)
        cpu = min(cpu, time.process_time() - start_cpu)
    return compile_s, wall, cpu


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="fixture")
    parser.add_argument("--step", nargs="+", default=["prefill:512"])
    parser.add_argument("--prefill", nargs="+", default=["scan", "xla"])
    parser.add_argument("--chunk", type=int, nargs="+", default=[64])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; shape {args.shape}")
    for step in args.step:
        for prefill in args.prefill:
            for chunk in ([args.chunk[0]] if prefill == "scan" else args.chunk):
                compile_s, wall, cpu = time_case(args.shape, step, prefill, chunk,
                                                 args.repeat)
                label = prefill if prefill == "scan" else f"{prefill} chunk {chunk}"
                print(f"{step:>14} {label:>14}: wall {wall * 1e3:8.2f} ms, "
                      f"CPU {cpu * 1e3:8.2f} ms (compile {compile_s:.1f} s)", flush=True)


if __name__ == "__main__":
    main()
