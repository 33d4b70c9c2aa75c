"""Device time of a jitted step, measured so that neither host dispatch nor the L2 cache hides it.

Method (the advice of NVIDIA's and Triton's benchmarking guides: warm up, time asynchronous
work with a synchronisation at the end, rotate inputs larger than the cache, take the median
of repeats):

- The work is cut into *input sets* whose total size is at least ``rotate_bytes`` (128 MB by
  default, against the 50-60 MB L2 of an H100/H200), so consecutive uses of one set are a
  whole rotation apart and its data comes from HBM.
- One jitted *call* runs the step over every set in turn, ``reps`` times (an unrolled Python
  loop inside one jit, at most :data:`MAX_FORWARDS`), so one dispatch carries enough device
  work (``bytes_per_call``) to outlast the host's dispatch of the next call; the step's
  metadata, the same for every set, is passed once a call. Pools are donated and threaded through, so
  the KV writes happen in place as in the engine.
- A *trial* is ``n`` calls dispatched back to back with one ``block_until_ready`` at the end;
  ``n`` is calibrated so that a trial lasts about ``trial_s``. The result is the median over
  trials of trial time / (n x forwards per call). If dispatching alone took nearly the whole
  trial the row is flagged ``host_bound`` (the device then idled between calls).

Compilation is timed apart (``jit(...).lower(...).compile()``) and excluded.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp

#: HBM bandwidth (bytes/s) and dense bf16 tensor-core peak (FLOP/s) by device kind, from
#: NVIDIA's H100 and H200 data sheets (SXM parts); matched as substrings of device_kind.
DEVICE_PEAKS = {"H200": (4.8e12, 989e12), "H100": (3.35e12, 989e12)}


def device_peaks(device) -> tuple[float | None, float | None]:
    """(HBM bytes/s, bf16 tensor-core FLOP/s) of ``device``; (None, None) if unknown (CPU)."""
    kind = getattr(device, "device_kind", "")
    return next((p for name, p in DEVICE_PEAKS.items() if name in kind), (None, None))


@dataclass
class Timing:
    """Seconds per forward (median and min over trials), trial count, compile seconds, and
    whether dispatch rather than the device bounded the trials."""

    seconds: float
    min_seconds: float
    trials: int
    compile_s: float
    host_bound: bool


#: Forwards in one jitted call at most: each is a copy of the step in the compiled program.
MAX_FORWARDS = 8


def plan_rotation(set_bytes: int, rotate_bytes: int, bytes_per_call: int,
                  max_forwards: int = MAX_FORWARDS) -> tuple[int, int]:
    """(number of input sets, repetitions of the sweep per call): at least two sets and at
    least ``rotate_bytes`` over all of them; enough sweeps that one call moves about
    ``bytes_per_call``, at most ``max_forwards`` forwards a call."""
    sets = max(2, math.ceil(rotate_bytes / max(set_bytes, 1)))
    sets = min(sets, max_forwards)
    reps = max(1, min(math.ceil(bytes_per_call / (sets * max(set_bytes, 1))),
                      max_forwards // sets))
    return sets, reps


def make_sweep(step: Callable, reps: int) -> Callable:
    """``sweep(donated, constants, shared) -> (donated, checksum)``: ``step`` over every input
    set in turn, ``reps`` times (unrolled), each set's donated arrays threaded through; the
    float32 checksum adds one element of every output so that no forward is dead code."""
    def sweep(donated, constants, shared):
        checksum = jnp.zeros((), jnp.float32)
        donated = list(donated)
        for _ in range(reps):
            for i, const in enumerate(constants):
                donated[i], out = step(donated[i], const, shared)
                checksum = checksum + out.reshape(-1)[0].astype(jnp.float32)
        return tuple(donated), checksum

    return sweep


def time_sweep(step: Callable, donated: tuple, constants: tuple, shared, *, reps: int,
               trial_s: float, max_trials: int, time_limit_s: float) -> tuple[Timing, tuple]:
    """Time ``step`` over the rotated input sets.

    Args:
        step: ``step(donated_i, constants_i, shared) -> (new donated_i, output)`` for one
            input set, traceable (it is jitted here).
        donated: per-set arrays updated in place (the KV pools), one entry per set.
        constants: per-set read-only arrays (queries, new K/V rows).
        shared: read-only arrays of every set (the step's metadata), passed once a call.
        reps: sweeps over all sets per call.
        trial_s: target seconds per trial; max_trials: trials at most.
        time_limit_s: no new trial starts after this many seconds (one always runs).

    Returns:
        (the :class:`Timing`, the donated arrays after the last call).
    """
    t0 = time.perf_counter()
    call = jax.jit(make_sweep(step, reps), donate_argnums=0).lower(donated, constants,
                                                                    shared).compile()
    compile_s = time.perf_counter() - t0
    start = time.perf_counter()
    donated, checksum = call(donated, constants, shared)                       # warm-up
    jax.block_until_ready((donated, checksum))
    t0 = time.perf_counter()
    donated, checksum = call(donated, constants, shared)
    jax.block_until_ready((donated, checksum))
    per_call = max(time.perf_counter() - t0, 1e-6)
    n = max(1, min(1000, round(trial_s / per_call)))
    forwards = n * reps * len(constants)
    times, dispatch = [], []
    while not times or (len(times) < max_trials
                        and time.perf_counter() - start < time_limit_s):
        t0 = time.perf_counter()
        for _ in range(n):
            donated, checksum = call(donated, constants, shared)
        t_dispatch = time.perf_counter() - t0
        jax.block_until_ready((donated, checksum))
        times.append((time.perf_counter() - t0) / forwards)
        dispatch.append(t_dispatch / forwards)
    median = statistics.median(times)
    host_bound = statistics.median(dispatch) >= 0.9 * median
    return Timing(median, min(times), len(times), compile_s, host_bound), donated


def copy_bandwidth(nbytes: int, trial_s: float = 0.05, trials: int = 5) -> float:
    """Device-to-device copy bandwidth in bytes/s: ``2 * nbytes`` (read and write) per copy of
    an ``nbytes`` buffer (``jnp.copy`` of a non-donated input is a memcpy into a new buffer),
    median of ``trials`` trials of back-to-back copies."""
    x = jnp.zeros((max(nbytes // 4, 1),), jnp.float32)
    copy = jax.jit(jnp.copy).lower(x).compile()
    jax.block_until_ready(copy(x))
    t0 = time.perf_counter()
    jax.block_until_ready(copy(x))
    n = max(1, min(1000, round(trial_s / max(time.perf_counter() - t0, 1e-6))))
    times = []
    for _ in range(trials):
        t0 = time.perf_counter()
        for _ in range(n):          # each result is dropped as the next is queued
            y = copy(x)
        jax.block_until_ready(y)    # one stream: the last copy ends after all the others
        times.append((time.perf_counter() - t0) / n)
    return 2 * x.size * 4 / statistics.median(times)
