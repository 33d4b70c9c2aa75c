"""Measure the page-size tuning table of ``--block-size auto`` (``jaxpaged.runner.page_size``).

For each attention shape (``HEADSxKV_HEADSxHEAD_DIM``) and each candidate page size, the
step time of a few attention cases of one layer (``benchmarks.kernels.attention_cases``:
by default a decode step of 64 sequences at 512 tokens and 15 such decodes mixed with a
256-token prefill chunk, the shape of a serving step), through the backend the engine
would use (``--backend``; ``auto`` resolves as the engine does), timed as the kernel
microbenchmark times them (``benchmarks.kernels.paged_attention.run_case``), the fastest of
``--rounds`` interleaved rounds. An entry per
(device kind, backend, shape, dtype) records the summed milliseconds by page size;
``--write`` puts the entries into the package's table (replacing those of the same key,
keeping the others) so the next start-up with ``--block-size auto`` uses them.

Usage (repository root)::

    python -m jaxpaged.benchmarks.kernels.page_size_table --write           # CPU: cpu backend
    python -m jaxpaged.benchmarks.kernels.page_size_table --backend pallas \\
        --dtype bfloat16 --shapes 32x8x128 64x8x128 --write                  # on the GPU
"""

from __future__ import annotations

import argparse
import json
import os
import time
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.benchmarks.kernels import attention_cases as cases_mod
from jaxpaged.benchmarks.kernels.device_timing import device_peaks
from jaxpaged.benchmarks.kernels.paged_attention import run_case
from jaxpaged.benchmarks.results import cpu_model
from jaxpaged.layers.attention import get_attention_backend
from jaxpaged.runner.page_size import CANDIDATES, TABLE_PATH, load_table

#: The shapes measured by default: the W1 model's (stories110M: 12 heads of 64) and a
#: Llama-3-8B's (32 query heads, 8 KV heads of 128).
DEFAULT_SHAPES = ("12x12x64", "32x8x128")
DEFAULT_CASES = ("decode:64x512", "mixed:16x512")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backend", default="auto", help="attention backend (auto: the engine's)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--shapes", nargs="+", default=list(DEFAULT_SHAPES),
                   help="attention shapes HEADSxKV_HEADSxHEAD_DIM")
    p.add_argument("--cases", nargs="+", default=list(DEFAULT_CASES))
    p.add_argument("--page-sizes", nargs="+", type=int, default=list(CANDIDATES))
    p.add_argument("--prefill-chunk", type=int, default=256)
    p.add_argument("--trial-ms", type=float, default=50.0)
    p.add_argument("--trials", type=int, default=7)
    p.add_argument("--rounds", type=int, default=3,
                   help="measure every page size this many times, interleaved; keep the "
                        "fastest (a burst of load on a shared machine then hits one round)")
    p.add_argument("--write", action="store_true", help=f"update {TABLE_PATH}")
    p.add_argument("--table", default=TABLE_PATH, help="the table file --write updates")
    return p.parse_args(argv)


def measure_entry(args, heads: int, kv_heads: int, head_dim: int) -> dict:
    """The table entry of one shape: ms summed over ``args.cases`` per page size."""
    device = jax.devices()[0]
    dtype = jnp.dtype(args.dtype)
    backend = get_attention_backend(args.backend, num_kv_heads=kv_heads, num_heads=heads,
                                    head_dim=head_dim, dtype=dtype)
    timing = SimpleNamespace(prefill_chunk=args.prefill_chunk, rotate_bytes=64e6,
                             bytes_per_call=64e6, trial_ms=args.trial_ms, trials=args.trials,
                             row_time_limit=30.0)
    by_case: dict[str, dict[str, float]] = {}
    for _ in range(args.rounds):
        for page in args.page_sizes:
            shape = cases_mod.Shape(heads, kv_heads, head_dim, page, args.dtype)
            for name in args.cases:
                row = run_case(cases_mod.parse_case(name), {backend.name: backend}, shape,
                               timing, device_peaks(device), None, float("inf"), {})
                result = row["results"][backend.name]
                if "ms" not in result:
                    raise RuntimeError(f"{name} at page size {page}: {result}")
                times = by_case.setdefault(name, {})
                times[str(page)] = round(min(result["ms"], times.get(str(page), np.inf)), 4)
    ms = {str(p): round(sum(c[str(p)] for c in by_case.values()), 4) for p in args.page_sizes}
    return {"platform": device.platform, "device_kind": device.device_kind,
            "backend": backend.name, "dtype": args.dtype, "num_heads": heads,
            "num_kv_heads": kv_heads, "head_dim": head_dim, "ms": ms, "ms_by_case": by_case,
            "machine": cpu_model() if device.platform == "cpu" else device.device_kind,
            "load_average": round(os.getloadavg()[0], 2),
            "date": time.strftime("%Y-%m-%d", time.gmtime())}


def write_table(path: str, new: list[dict]) -> None:
    """Replace ``path``'s entries of the same (platform, device kind, backend, dtype,
    head_dim) as ``new``'s with them; keep the rest."""
    key = lambda e: (e["platform"], e["device_kind"], e["backend"], e["dtype"], e["head_dim"])
    keys = {key(e) for e in new}
    entries = [e for e in load_table(path) if key(e) not in keys] + new
    with open(path, "w") as f:
        json.dump({"about": "page-size tuning table of --block-size auto (jaxpaged/runner/"
                            "page_size.py): ms of one layer's attention cases per page size; "
                            "regenerate with python -m jaxpaged.benchmarks.kernels."
                            "page_size_table --write",
                   "entries": sorted(entries, key=key)}, f, indent=1)
        f.write("\n")


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    entries = []
    for text in args.shapes:
        heads, kv_heads, head_dim = (int(x) for x in text.split("x"))
        entry = measure_entry(args, heads, kv_heads, head_dim)
        best = min(entry["ms"].values())
        print(f"{entry['backend']} {entry['device_kind']} {text} {args.dtype}: " + ", ".join(
            f"{p}: {t:.3f} ms ({t / best:.3f})" for p, t in entry["ms"].items()))
        entries.append(entry)
    if args.write:
        write_table(args.table, entries)
        print(f"wrote {len(entries)} entries to {args.table}")
    return entries


if __name__ == "__main__":
    main()
