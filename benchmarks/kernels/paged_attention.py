"""Microbenchmark: the Pallas paged-attention kernels (v1, v2) against the engine's ``xla``
backend, timed on the device.

Each case (``MODE:BATCHxCONTEXT[:fp8]``, see ``benchmarks.kernels.attention_cases``: decode,
ragged-length decode, prefill chunk, mixed decodes + a prefill chunk, on a bf16 or fp8 pool)
is one engine step of one layer, run through the backend-level interface the model uses:
``BatchLayout`` -> ``backend.build_metadata`` + the layout's arrays -> ``backend.forward(q, k,
v, kv_pages, metadata, scale=...)``, i.e. the step's KV write plus its attention (what a
decoder layer calls), with the pool donated. Backends: ``pallas-v1`` / ``pallas-v2``
(``PallasAttentionBackend`` with ``kernel="v1"|"v2"``; a backend without that field has v1
only) and ``xla`` (``XlaAttentionBackend``, the engine's jnp backend; not the full-gather
reference).

Timing (``benchmarks.kernels.device_timing``): > 100 MB of distinct input sets rotated so the
L2 cannot serve them, several forwards per jitted call, calls dispatched back to back with
one block at the end, median over trials; compilation excluded. Reported: ms per step, GB/s of
the step's ideal traffic and its % of the HBM peak (H200 4.8 TB/s, H100 3.35 TB/s) and of a
device-to-device copy measured in the same run, TFLOP/s and % of the bf16 tensor-core peak
(989 TFLOP/s) for prefill and mixed steps, and the ratios of ``attention_report`` (vs xla,
v2 over v1, fp8 over bf16, mixed over its parts), then the issue-19 goals.

Budget: ``--row-time-limit`` bounds each backend's trials and ``--time-budget`` the whole run
(rows not started in time are recorded as skipped); the JSON is rewritten after every case,
so a run cut off by ``timeout`` keeps what it measured.

Usage (GPU, repository root, ``PYTHONPATH=.``)::

    python benchmarks/kernels/paged_attention.py                        # the goal cases
    python benchmarks/kernels/paged_attention.py --kernel v1 v2 --cases decode:64x4096 \
        decode:64x4096:fp8 --time-budget 60 --output-json ab.json

``--smoke`` runs tiny shapes (interpret mode on a CPU) to check the script.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.benchmarks.kernels import attention_cases as cases_mod
from jaxpaged.benchmarks.kernels import attention_report as report
from jaxpaged.benchmarks.kernels.device_timing import copy_bandwidth, device_peaks, plan_rotation, time_sweep
from jaxpaged.layers.attention.pallas import PallasAttentionBackend
from jaxpaged.layers.attention.xla import XlaAttentionBackend

#: The row that times v2's decode kernel alone (``PallasAttentionBackend.decode``: no KV
#: write, no query gather, no scatter back) beside ``pallas-v2``'s whole ``backend.forward``, so that
#: a missed goal is the kernel's or its glue's; decode cases only.
KERNEL_ROW = "v2-kernel"

#: The issue-19 goal cases, most important first (a time budget cuts the tail).
DEFAULT_CASES = ("decode:64x4096", "decode:64x4096:fp8", "decode:33x4096", "decode:33x4096:fp8",
                 "decode:1x8192", "decode:1x8192:fp8", "prefill:1x4096", "mixed:64x4096",
                 "ragged:64x4096", "ragged:64x4096:fp8")
SMOKE_CASES = ("decode:2x64", "decode:2x64:fp8", "mixed:3x64")


def available_kernels() -> tuple[str, ...]:
    """Kernel variants this checkout's ``PallasAttentionBackend`` offers: ("v1", "v2") once it
    has a ``kernel`` field, ("v1",) before (today's kernel)."""
    fields = {f.name for f in dataclasses.fields(PallasAttentionBackend)}
    return ("v1", "v2") if "kernel" in fields else ("v1",)


def make_backends(kernels: list[str], with_xla: bool) -> dict:
    """{name: backend}: ``pallas-<variant>`` for each kernel variant (and :data:`KERNEL_ROW`
    beside v2), then ``xla``.

    Raises:
        ValueError: a variant this checkout does not have ("kernel variant v2 not available").
    """
    have = available_kernels()
    backends = {}
    for k in kernels:
        if k not in have:
            raise ValueError(f"kernel variant {k} not available: this PallasAttentionBackend "
                             f"offers {', '.join(have)}")
        backends[f"pallas-{k}"] = (PallasAttentionBackend(kernel=k) if len(have) > 1
                                   else PallasAttentionBackend())
    if "pallas-v2" in backends:
        backends[KERNEL_ROW] = backends["pallas-v2"]
    if with_xla:
        backends["xla"] = XlaAttentionBackend()
    return backends


def expand_cases(names: list[str]) -> list[cases_mod.Case]:
    """Parsed cases in order, each mixed case preceded by its parts (once each)."""
    out = []
    for case in map(cases_mod.parse_case, names):
        for c in (*(case.parts() or ()), case):
            if c not in out:
                out.append(c)
    return out


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", nargs="+", default=list(DEFAULT_CASES),
                   help="MODE:BATCHxCONTEXT[:fp8], MODE in decode, ragged, prefill, mixed")
    p.add_argument("--kernel", nargs="+", default=None,
                   help="Pallas kernel variants to A/B (default: all available)")
    p.add_argument("--no-xla", action="store_true", help="skip the xla baseline")
    p.add_argument("--num-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--prefill-chunk", type=int, default=2048,
                   help="tokens of a prefill chunk (prefill and mixed cases)")
    p.add_argument("--rotate-bytes", type=float, default=128e6,
                   help="distinct input bytes rotated per case (> L2)")
    p.add_argument("--bytes-per-call", type=float, default=512e6,
                   help="device bytes one jitted call should move (hides dispatch)")
    p.add_argument("--copy-bytes", type=float, default=1 << 30,
                   help="buffer of the device-to-device copy measurement")
    p.add_argument("--trial-ms", type=float, default=50.0)
    p.add_argument("--trials", type=int, default=7)
    p.add_argument("--row-time-limit", type=float, default=10.0,
                   help="seconds of trials per backend and case (one trial always runs)")
    p.add_argument("--time-budget", type=float, default=None,
                   help="seconds for the whole run; later rows are skipped")
    p.add_argument("--output-json", default=None, help="write the rows here (after every case)")
    p.add_argument("--smoke", action="store_true",
                   help="tiny shapes (interpret mode on a CPU) to check the script: the cases "
                        "keep their mode and pool, shrunk to at most 4 sequences of 64 tokens")
    args = p.parse_args(argv)
    if args.smoke:
        args.num_heads, args.num_kv_heads, args.head_dim, args.prefill_chunk = 4, 2, 16, 32
        args.rotate_bytes = args.bytes_per_call = 1
        args.copy_bytes, args.trial_ms, args.trials = 1 << 20, 1.0, 2
        args.cases = list(SMOKE_CASES) if args.cases == list(DEFAULT_CASES) else \
            [shrunk(name) for name in args.cases]
    return args


def shrunk(name: str) -> str:
    """A case's ``--smoke`` size: its mode and pool, at most 4 sequences of 64 tokens (a
    malformed name is returned as it is, for :func:`expand_cases` to refuse)."""
    try:
        case = cases_mod.parse_case(name)
    except ValueError:
        return name
    return cases_mod.Case(case.mode, min(case.batch, 4), min(case.context, 64), case.fp8).name


def forward_step(backend, scale: float):
    """``step(kv_pages, (q, k, v), metadata) -> (kv_pages, output)``: one ``backend.forward``
    (the step's KV write, then attention), the unit that ``device_timing`` rotates."""
    def step(kv_pages, const, metadata):
        q, k, v = const
        out, kv_pages = backend.forward(q, k, v, kv_pages, metadata, scale=scale)
        return kv_pages, out

    return step


def kernel_step(backend, scale: float):
    """``step(kv_pages, (q_decode,), metadata) -> (kv_pages, output)``: the decode kernel
    alone on queries already in decode order (:data:`KERNEL_ROW`); the pool is read, not
    written."""
    def step(kv_pages, const, metadata):
        return kv_pages, backend.decode(const[0], kv_pages, metadata, scale=scale)

    return step


def step_and_constants(name, backend, scale, sets, meta):
    """What a backend's row times and the per-set arrays it reads: ``backend.forward`` on
    (q, k, v), or for :data:`KERNEL_ROW` the kernel on each set's decode queries."""
    if name != KERNEL_ROW:
        return forward_step(backend, scale), tuple((s["q"], s["k"], s["v"]) for s in sets)
    queries = tuple(jnp.concatenate([s["q"], jnp.zeros_like(s["q"][:1])])[meta["decode_tokens"]]
                    for s in sets)
    return kernel_step(backend, scale), tuple((q,) for q in queries)


def run_case(case, backends, shape, args, peaks, copy_bps, deadline, rows_by_case):
    """Measure ``case`` on every backend; returns its row."""
    rng = np.random.default_rng(case.batch * 7 + case.context)
    layout, num_pages = cases_mod.build_layout(
        cases_mod.sequences(case, args.prefill_chunk), shape.page_size, rng)
    traffic = cases_mod.traffic_bytes(layout, shape, case.fp8)
    flops = cases_mod.attention_flops(layout, shape)
    set_bytes = cases_mod.input_set_bytes(layout, num_pages, shape, case.fp8)
    num_sets, reps = plan_rotation(set_bytes, int(args.rotate_bytes), int(args.bytes_per_call))
    row = {"case": case.name, "mode": case.mode, "batch": case.batch, "context": case.context,
           "kv_dtype": "fp8" if case.fp8 else shape.dtype, "num_tokens": layout.num_tokens,
           "kv_tokens": int(layout.seq_lens.sum()), "bytes": traffic, "flops": flops,
           "input_sets": num_sets, "reps_per_call": reps,
           "rotated_bytes": num_sets * set_bytes, "results": {}}
    if case.parts():
        row["parts"] = [p.name for p in case.parts()]
    if time.perf_counter() >= deadline:
        row["results"] = {name: {"skipped": "time budget"} for name in backends}
        report.add_ratios(row, rows_by_case)
        return row
    sets = [cases_mod.make_input_set(i, layout, num_pages, shape, case.fp8)
            for i in range(num_sets)]
    pools = tuple(s.pop("kv_pages") for s in sets)
    scale = shape.head_dim ** -0.5
    for name, backend in backends.items():
        left = deadline - time.perf_counter()
        if left <= 0:
            row["results"][name] = {"skipped": "time budget"}
            continue
        if name == KERNEL_ROW and case.mode not in ("decode", "ragged"):
            row["results"][name] = {"skipped": "decode cases only"}
            continue
        if case.fp8:
            backend = backend.with_kv_scales(*cases_mod.FP8_SCALES)
        meta = cases_mod.step_metadata(backend, layout)
        step, constants = step_and_constants(name, backend, scale, sets, meta)
        try:
            timing, pools = time_sweep(step, pools, constants, meta,
                                       reps=reps, trial_s=args.trial_ms / 1e3,
                                       max_trials=args.trials,
                                       time_limit_s=min(args.row_time_limit, left))
        except Exception as e:  # noqa: BLE001 - one backend failing (e.g. memory) ends only its row
            row["results"][name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            if any(p.is_deleted() for pair in pools for p in pair):     # donated, then failed
                pools = tuple(cases_mod.make_input_set(i, layout, num_pages,
                                                       shape, case.fp8)["kv_pages"]
                              for i in range(num_sets))
            continue
        result = report.rates(timing.seconds, traffic, flops, peaks, copy_bps,
                              case.mode in ("prefill", "mixed"))
        result.update(min_ms=timing.min_seconds * 1e3, trials=timing.trials,
                      compile_s=timing.compile_s, host_bound=timing.host_bound)
        row["results"][name] = result
    report.add_ratios(row, rows_by_case)
    return row


def main(argv=None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    deadline = start + args.time_budget if args.time_budget else float("inf")
    try:
        backends = make_backends(args.kernel or list(available_kernels()), not args.no_xla)
        case_list = expand_cases(args.cases)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    shape = cases_mod.Shape(args.num_heads, args.num_kv_heads, args.head_dim, args.page_size,
                            args.dtype)
    device = jax.devices()[0]
    peaks = device_peaks(device)
    copy_bps = copy_bandwidth(int(args.copy_bytes))
    summary = {"device": device.device_kind, "platform": jax.default_backend(),
               "jax": jax.__version__, "hbm_peak_Bps": peaks[0], "tensor_core_peak_flops":
               peaks[1], "copy_Bps": copy_bps, "shape": dataclasses.asdict(shape),
               "prefill_chunk": args.prefill_chunk, "backends": list(backends), "rows": []}
    hbm = f"{peaks[0] / 1e12:.2f} TB/s" if peaks[0] else "unknown"
    print(f"device: {device.device_kind} ({jax.default_backend()}, jax {jax.__version__}); HBM "
          f"peak {hbm}; device-to-device copy {copy_bps / 1e9:.1f} GB/s; heads "
          f"{shape.num_heads}/{shape.num_kv_heads}, head_dim {shape.head_dim}, page "
          f"{shape.page_size}, {shape.dtype}; timed: backend.forward (KV write + attention)")
    print(report.HEADER)
    rows_by_case = {}
    for case in case_list:
        row = run_case(case, backends, shape, args, peaks, copy_bps, deadline, rows_by_case)
        rows_by_case[case.name] = row
        summary["rows"].append(row)
        for name, r in row["results"].items():
            print(report.format_result(case.name, name, r,
                                       row["ratios"].get("vs_xla", {}).get(name)), flush=True)
        line = report.format_ratios(row["ratios"])
        if line:
            print(line, flush=True)
        summary["elapsed_s"] = time.perf_counter() - start
        write_json(summary, args.output_json)
    summary["goals"] = report.check_goals(summary["rows"], list(backends),
                                          peaks[0] is not None)
    write_json(summary, args.output_json)
    print("\n".join(report.format_goals(summary["goals"])))
    print(json.dumps({"device": summary["device"], "rows": len(summary["rows"]),
                      "elapsed_s": round(summary["elapsed_s"], 1)}))
    return 0


def write_json(summary: dict, path: str | None) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
