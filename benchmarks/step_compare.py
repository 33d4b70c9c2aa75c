"""``python -m jaxpaged.benchmarks.step_compare``: W1's decode and prefill steps
(:func:`jaxpaged.benchmarks.step_profile.build_step`) in float32 and in bfloat16 (weights,
activations and KV pool, ``--dtype bfloat16``), calls interleaved in one process
(float32, bfloat16, float32, ... ``--repeats`` times a round, ``--rounds`` rounds), so the
ratio holds on a shared machine whose load moves. Also home of ``step_profile
--compare-options`` (XLA:CPU compile-option sets against the defaults, same interleaving).

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
                   rounds: int) -> dict:
    """Best and median step time of ``kind`` in each of ``dtypes`` (each its own weights and
    pool), calls interleaved; ratios are to the first dtype."""
    calls = {}
    for dtype in dtypes:
        fn, state, kv, args, _, _ = build_step(kind, model_dir, dtype=dtype)
        calls[dtype] = step_caller(fn, state, {"kv": kv}, args)
    return {"kind": kind, "rounds": interleave(calls, repeats, rounds)}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=os.path.join(ROOT, "configs", "models", "stories110m-shape"))
    p.add_argument("--steps", nargs="+", default=["decode", "prefill"],
                   choices=["decode", "prefill"])
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--repeats", type=int, default=6)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args(argv)
    result = {"cpu": cpu_model(), "load_average": os.getloadavg()}
    for kind in args.steps:
        result[kind] = compare_dtypes(kind, args.model, args.dtypes, args.repeats, args.rounds)
        print(json.dumps({kind: result[kind]}), flush=True)
    result["load_average_after"] = os.getloadavg()
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
