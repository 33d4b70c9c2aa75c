"""Figures of the paged-attention microbenchmark: per-backend rates, the ratios between rows,
and the issue-19 kernel goals (``docs/benchmarks.md``, "Kernel goals").

A row is one case (``benchmarks.kernels.attention_cases``) with one result per backend
(``pallas-v1``, ``pallas-v2``, ``xla``). The ratios put each result beside the others:
``vs_xla`` (xla time / this time), ``v2_over_v1`` (v1 time / v2 time), ``fp8_speedup`` (time of
the same case on a bf16 pool / time on the fp8 pool) and ``mixed_over_parts`` (mixed time /
(decode-part time + prefill-part time), 1.0 when mixing costs nothing).
"""

from __future__ import annotations

#: (case, figure, comparison, threshold) of issue 19, checked for every Pallas variant.
#: ``fp8_speedup`` applies to every fp8 decode case, given as "decode:*:fp8".
GOALS = (
    ("decode:64x4096", "pct_hbm", ">=", 80.0),
    ("decode:33x4096", "pct_hbm", ">=", 70.0),
    ("decode:1x8192", "pct_hbm", ">=", 70.0),
    ("decode:*:fp8", "fp8_speedup", ">=", 1.7),
    ("prefill:1x4096", "pct_tc", ">=", 45.0),
    ("mixed:64x4096", "mixed_over_parts", "<=", 1.3),
)


def rates(seconds: float, traffic: dict, flops: int, peaks: tuple, copy_bps: float | None,
          with_flops: bool) -> dict:
    """GB/s of the ideal traffic and its % of HBM peak and of the measured copy bandwidth;
    TFLOP/s and % of the tensor-core peak when ``with_flops`` (prefill and mixed steps)."""
    hbm, tc = peaks
    bps = traffic["total"] / seconds
    out = {"ms": seconds * 1e3, "GBps": bps / 1e9,
           "pct_hbm": 100 * bps / hbm if hbm else None,
           "pct_copy": 100 * bps / copy_bps if copy_bps else None}
    if with_flops:
        out["TFLOPs"] = flops / seconds / 1e12
        out["pct_tc"] = 100 * flops / seconds / tc if tc else None
    return out


def _ms(row: dict | None, backend: str) -> float | None:
    result = (row or {}).get("results", {}).get(backend, {})
    return result.get("ms")


def add_ratios(row: dict, rows_by_case: dict) -> None:
    """Fill ``row["ratios"]`` from its own results and the rows of its bf16 twin and parts."""
    ratios = {}
    names = [b for b in row["results"] if b != "xla"]
    xla = _ms(row, "xla")
    ratios["vs_xla"] = {b: xla / _ms(row, b) for b in names if xla and _ms(row, b)}
    if _ms(row, "pallas-v1") and _ms(row, "pallas-v2"):
        ratios["v2_over_v1"] = _ms(row, "pallas-v1") / _ms(row, "pallas-v2")
    if row["kv_dtype"] == "fp8":
        twin = rows_by_case.get(row["case"].removesuffix(":fp8"))
        ratios["fp8_speedup"] = {b: _ms(twin, b) / _ms(row, b) for b in row["results"]
                                 if _ms(twin, b) and _ms(row, b)}
    if row.get("parts"):
        decode, prefill = (rows_by_case.get(p) for p in row["parts"])
        ratios["mixed_over_parts"] = {
            b: _ms(row, b) / (_ms(decode, b) + _ms(prefill, b)) for b in row["results"]
            if _ms(row, b) and _ms(decode, b) and _ms(prefill, b)}
    row["ratios"] = ratios


def _figure(row: dict, backend: str, figure: str) -> float | None:
    if figure in ("fp8_speedup", "mixed_over_parts"):
        return row.get("ratios", {}).get(figure, {}).get(backend)
    return row.get("results", {}).get(backend, {}).get(figure)


def check_goals(rows: list[dict], backends: list[str], known_device: bool) -> list[dict]:
    """Every goal of :data:`GOALS` against every Pallas variant's measured figure: ``met``
    is True/False, or None (``unmeasured``) where the row was not run or ``known_device`` is
    false (no H100/H200 peaks: a CPU, whose figures say nothing about the goals)."""
    out = []
    for case, figure, op, threshold in GOALS:
        matching = [r for r in rows if r["case"] == case or (
            case == "decode:*:fp8" and r["mode"] == "decode" and r["kv_dtype"] == "fp8")]
        for row in matching or [{"case": case}]:
            for b in (b for b in backends if b.startswith("pallas")):
                value = _figure(row, b, figure)
                met = None if value is None or not known_device else (value >= threshold if op == ">=" else
                                                  value <= threshold)
                out.append({"case": row["case"], "backend": b, "figure": figure,
                            "goal": f"{op} {threshold:g}", "value": value, "met": met})
    return out


def _num(x, fmt, width):
    return f"{'-':>{width}}" if x is None else f"{x:{width}{fmt}}"


HEADER = (f"{'case':22} {'backend':10} {'ms':>9} {'GB/s':>8} {'%HBM':>6} {'%copy':>6} "
          f"{'TFLOP/s':>8} {'%TC':>6} {'x xla':>6} {'compile':>7}")


def format_result(case: str, backend: str, r: dict, vs_xla: float | None) -> str:
    """One table line (``HEADER``'s columns) for one backend's result of one case."""
    if "ms" not in r:
        return f"{case:22} {backend:10} {r.get('error') or r.get('skipped')}"
    flag = " host-bound" if r.get("host_bound") else ""
    return (f"{case:22} {backend:10} {r['ms']:9.4f} {r['GBps']:8.1f} "
            f"{_num(r['pct_hbm'], '.1f', 6)} {_num(r['pct_copy'], '.1f', 6)} "
            f"{_num(r.get('TFLOPs'), '.1f', 8)} {_num(r.get('pct_tc'), '.1f', 6)} "
            f"{_num(vs_xla, '.2f', 6)} {r['compile_s']:6.1f}s{flag}")


def format_ratios(ratios: dict) -> str | None:
    """The row's cross-row ratios on one line (None if it has none)."""
    parts = []
    if "v2_over_v1" in ratios:
        parts.append(f"v2 over v1 {ratios['v2_over_v1']:.2f}x")
    for key, label in (("fp8_speedup", "fp8 over bf16"), ("mixed_over_parts",
                                                          "mixed / (decode + prefill)")):
        if ratios.get(key):
            parts.append(f"{label}: " + ", ".join(f"{b} {v:.2f}" for b, v in ratios[key].items()))
    return "    " + "; ".join(parts) if parts else None


def format_goals(goals: list[dict]) -> list[str]:
    """Lines of the goal table."""
    lines = ["goals (issue 19):"]
    for g in goals:
        state = {True: "met", False: "NOT met", None: "unmeasured"}[g["met"]]
        value = "-" if g["value"] is None else f"{g['value']:.2f}"
        lines.append(f"  {g['case']:20} {g['backend']:10} {g['figure']:17} {g['goal']:>7}: "
                     f"{value:>7} {state}")
    return lines
