"""``python -m jaxpaged.benchmarks.step_compare``: W1's decode and prefill steps
(:func:`jaxpaged.benchmarks.step_profile.build_step`) in float32 and in bfloat16 (weights,
activations and KV pool, ``--dtype bfloat16``), calls interleaved in one process
(float32, bfloat16, float32, ... ``--repeats`` times a round, ``--rounds`` rounds), so the
ratio holds on a shared machine whose load moves. ``--backends xla cpu`` compares attention
backends instead (each step in ``--dtypes``' first dtype; a single backend, e.g.
``--backends cpu``, compares the dtypes with it), and ``--layer`` first times one
layer's decode attention alone (KV write and attention of W1's decode step, per backend).
``--compile-options`` times the XLA:CPU compile-option sets of ``OPTION_SETS`` against the
defaults instead (same interleaving).

Prints one JSON line per step kind: per round and dtype the best and median ms, the best's
ratio to float32's, and whether the greedy tokens equal float32's (dummy weights give
near-ties, so bfloat16 may pick other tokens; accuracy is tested on the bundled model in
``tests/test_bfloat16.py``).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import time

import numpy as np

from jaxpaged.benchmarks.datasets import ROOT
from jaxpaged.benchmarks.results import cpu_model
from jaxpaged.benchmarks.step_profile import build_step

#: Compile-option sets ``--compare-options`` times against the defaults (XLA:CPU in jaxlib
#: 0.12 sends dots, elementwise ops and reductions to YNNPACK by default).
OPTION_SETS = {
    "ynn dot only": {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_DOT"},
    "ynn individual dots": {"xla_cpu_experimental_ynn_fusion_type":
                            "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"},
    "no ynn (eigen dots)": {"xla_cpu_experimental_ynn_fusion_type": ""},
    "onednn dots": {"xla_cpu_experimental_ynn_fusion_type": "", "xla_cpu_use_onednn": True,
                    "xla_cpu_experimental_onednn_fusion_type": "LIBRARY_FUSION_TYPE_DOT"},
    "vector width 512": {"xla_cpu_prefer_vector_width": 512},
}


def compare_options(kind: str, model_dir: str, sets: dict[str, dict], repeats: int,
                    rounds: int) -> dict:
    """Best and median step time of ``kind`` compiled with each option set, calls interleaved
    (defaults, set 1, set 2, ..., repeated), per round; ratios are to the defaults."""
    lowered, state, kv, args, _, _ = build_step(kind, model_dir, compile_=False)
    holder = {"kv": kv}           # one pool, donated from call to call
    fns = {"defaults": lowered.compile(),
           **{name: lowered.compile(compiler_options=opts) for name, opts in sets.items()}}
    calls = {name: step_caller(fn, state, holder, args) for name, fn in fns.items()}
    return {"kind": kind, "rounds": interleave(calls, repeats, rounds)}


def step_caller(fn, state, holder: dict, args):
    """A call of the compiled step ``fn`` on the pool in ``holder["kv"]`` (replaced by the
    returned, donated one) -> (seconds, token ids as numpy)."""
    import jax

    def call():
        t0 = time.perf_counter()
        tok, holder["kv"] = fn(state, holder["kv"], *args)
        jax.block_until_ready(tok)
        return time.perf_counter() - t0, np.asarray(tok)
    return call


def interleave(calls: dict, repeats: int, rounds: int) -> list[dict]:
    """Times ``calls`` (name -> :func:`step_caller`) interleaved, ``repeats`` times a round:
    per round and name best and median ms, the best's ratio to the first name's, and whether
    its tokens equal the first name's."""
    ref = {name: call()[1] for name, call in calls.items()}
    first = next(iter(calls))
    out = []
    for _ in range(rounds):
        times = collections.defaultdict(list)
        for _ in range(repeats):
            for name, call in calls.items():
                times[name].append(call()[0])
        base = min(times[first])
        out.append({name: {"best_ms": round(min(t) * 1e3, 2),
                           "median_ms": round(float(np.median(t)) * 1e3, 2),
                           "ratio": round(min(t) / base, 3),
                           "same_tokens": bool((ref[name] == ref[first]).all())}
                    for name, t in times.items()})
    return out



def compare_dtypes(kind: str, model_dir: str, dtypes: list[str], repeats: int,
                   rounds: int, backend: str = "xla") -> dict:
    """Best and median step time of ``kind`` in each of ``dtypes`` (each its own weights and
    pool) with the attention ``backend``, calls interleaved; ratios are to the first dtype."""
    calls = {}
    for dtype in dtypes:
        fn, state, kv, args, _, _ = build_step(kind, model_dir, dtype=dtype, backend=backend)
        calls[dtype] = step_caller(fn, state, {"kv": kv}, args)
    return {"kind": kind, "backend": backend, "rounds": interleave(calls, repeats, rounds)}


def compare_backends(kind: str, model_dir: str, backends: list[str], dtype: str, repeats: int,
                     rounds: int) -> dict:
    """Best and median step time of ``kind`` with each attention backend in ``backends``,
    calls interleaved; ratios are to the first backend."""
    calls = {}
    for backend in backends:
        fn, state, kv, args, _, _ = build_step(kind, model_dir, dtype=dtype, backend=backend)
        calls[backend] = step_caller(fn, state, {"kv": kv}, args)
    return {"kind": kind, "dtype": dtype, "rounds": interleave(calls, repeats, rounds)}


def compare_matmuls(kind: str, model_dir: str, dtype: str, repeats: int, rounds: int) -> dict:
    """Best and median step time of ``kind`` with the ``cpu`` attention backend, its few-row
    projections by XLA's dot and by the C++ kernel (:mod:`jaxpaged.layers.cpu_matmul`), calls
    interleaved; ratios are to XLA's dot."""
    calls = {}
    for name, use in (("xla dot", False), ("cpu matmul", True)):
        fn, state, kv, args, _, _ = build_step(kind, model_dir, dtype=dtype, backend="cpu",
                                               cpu_matmuls=use)
        calls[name] = step_caller(fn, state, {"kv": kv}, args)
    return {"kind": kind, "dtype": dtype, "rounds": interleave(calls, repeats, rounds)}


def compare_decode_layer(model_dir: str, backends: list[str], dtype: str, repeats: int,
                         rounds: int) -> dict:
    """One layer's attention (``forward``: KV write and attention, the pool donated) in W1's
    decode step for each backend, random q/k/v and pool, calls interleaved; also the largest
    difference of each backend's output from the first's and the KV bytes the layer reads
    (``GB/s`` = those over the best time)."""
    import jax
    import jax.numpy as jnp
    from jaxpaged.config import ModelConfig
    from jaxpaged.layers.attention.selection import get_attention_backend
    from jaxpaged.runner.input_batch import attention_metadata
    from jaxpaged.benchmarks.step_profile import PAGE_SIZE, w1_layout

    cfg = ModelConfig.from_pretrained(model_dir)
    layout, _, num_pages = w1_layout("decode")
    rng = np.random.default_rng(0)
    h, kvh, d, t = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, layout.positions.shape[0]
    new = lambda heads: jnp.asarray(rng.normal(size=(t, heads, d)), dtype)  # noqa: E731
    q, k, v = new(h), new(kvh), new(kvh)
    pools = [rng.normal(size=(num_pages, PAGE_SIZE, kvh, d)) for _ in range(2)]
    calls, outs = {}, {}
    for name in backends:
        backend = get_attention_backend(name)
        meta = {n: jnp.asarray(a) for n, a in attention_metadata(backend, layout).items()}
        fn = jax.jit(lambda q, k, v, kv, meta, b=backend: b.forward(q, k, v, kv, meta,
                                                                    scale=d ** -0.5),
                     donate_argnums=(3,))
        holder = {"kv": tuple(jnp.asarray(p, dtype) for p in pools)}   # the same pool each

        def call(fn=fn, meta=meta, holder=holder):
            t0 = time.perf_counter()
            out, holder["kv"] = fn(q, k, v, holder["kv"], meta)
            jax.block_until_ready(out)
            return time.perf_counter() - t0, np.asarray(out, np.float32)[:layout.num_tokens]
        calls[backend.name] = call
        outs[backend.name] = call()[1]
    first = next(iter(outs))
    kv_bytes = 2 * int((layout.positions[:layout.num_tokens] + 1).sum()) * kvh * d \
        * jnp.dtype(dtype).itemsize
    result = interleave(calls, repeats, rounds)
    for r in result:
        for name, row in r.items():
            del row["same_tokens"]
            row["GB/s"] = round(kv_bytes / row["best_ms"] / 1e6, 1)
    return {"layer": "decode attention", "dtype": dtype, "kv_mb": round(kv_bytes / 1e6, 1),
            "max_abs_diff": {n: float(np.abs(o - outs[first]).max()) for n, o in outs.items()},
            "rounds": result}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=os.path.join(ROOT, "configs", "models", "stories110m-shape"))
    p.add_argument("--steps", nargs="+", default=["decode", "prefill"],
                   choices=["decode", "prefill"])
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--backends", nargs="+", default=None,
                   help="compare these attention backends (e.g. xla cpu) instead of dtypes; "
                        "one backend: compare --dtypes with it")
    p.add_argument("--matmuls", action="store_true",
                   help="compare XLA's dot with the C++ small-rows matmul instead (cpu "
                        "attention backend, the first of --dtypes)")
    p.add_argument("--layer", action="store_true",
                   help="with --backends: time one layer's decode attention first")
    p.add_argument("--compile-options", action="store_true",
                   help="time the XLA:CPU compile-option sets of OPTION_SETS against the "
                        "defaults instead")
    p.add_argument("--repeats", type=int, default=6)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args(argv)
    result = {"cpu": cpu_model(), "load_average": os.getloadavg()}
    if args.backends and args.layer:
        result["layer"] = compare_decode_layer(args.model, args.backends, args.dtypes[0],
                                               args.repeats, args.rounds)
        print(json.dumps({"layer": result["layer"]}), flush=True)
    for kind in args.steps:
        if args.compile_options:
            result[kind] = compare_options(kind, args.model, OPTION_SETS, args.repeats,
                                           args.rounds)
        elif args.matmuls:
            result[kind] = compare_matmuls(kind, args.model, args.dtypes[0], args.repeats,
                                           args.rounds)
        elif args.backends and len(args.backends) == 1:
            result[kind] = compare_dtypes(kind, args.model, args.dtypes, args.repeats,
                                          args.rounds, args.backends[0])
        elif args.backends:
            result[kind] = compare_backends(kind, args.model, args.backends, args.dtypes[0],
                                            args.repeats, args.rounds)
        else:
            result[kind] = compare_dtypes(kind, args.model, args.dtypes, args.repeats,
                                          args.rounds)
        print(json.dumps({kind: result[kind]}), flush=True)
    result["load_average_after"] = os.getloadavg()
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
