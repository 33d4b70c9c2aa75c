"""Result helpers shared by the benchmark commands: percentiles, JSON output, the summary."""

from __future__ import annotations

import argparse

import importlib.util
import json
import os
from datetime import datetime, timezone

import numpy as np

#: Percentiles reported for latency distributions (vLLM's defaults).
PERCENTILES = (10, 25, 50, 75, 90, 99)


def distribution(values_s: list[float], name: str, unit_scale: float = 1000.0) -> dict:
    """``mean_/median_/std_/pXX_{name}_ms`` of ``values_s`` seconds (vLLM's field names)."""
    v = np.asarray(values_s, dtype=np.float64) * unit_scale if values_s else np.zeros(1)
    out = {f"mean_{name}_ms": float(v.mean()), f"median_{name}_ms": float(np.median(v)),
           f"std_{name}_ms": float(v.std())}
    for p in PERCENTILES:
        out[f"p{p}_{name}_ms"] = float(np.percentile(v, p))
    return out


def spec_decode_totals(llm):
    """The acceptance counters (a :class:`~jaxpaged.core.spec_decode.scheduling.SpecDecodingStats`)
    of ``llm``'s speculative decoding over every pass it ran, data-parallel replicas summed;
    None with speculation off."""
    from jaxpaged.core.spec_decode.scheduling import SpecDecodingStats

    specs = [r.scheduler.spec for r in getattr(llm.engine, "replicas", [llm.engine])]
    if specs[0] is None:
        return None
    total = SpecDecodingStats(specs[0].totals.num_spec_tokens)
    for t in (spec.totals for spec in specs):
        total.num_drafts += t.num_drafts
        total.num_draft_tokens += t.num_draft_tokens
        total.num_accepted_tokens += t.num_accepted_tokens
        total.num_accepted_tokens_per_pos = [
            a + b for a, b in zip(total.num_accepted_tokens_per_pos, t.num_accepted_tokens_per_pos)]
    return total


def spec_decode_line(totals) -> str:
    """The one-line acceptance summary of :func:`spec_decode_totals`' counters that
    ``jaxpaged bench`` and ``jaxpaged generate`` print."""
    return (f"Speculative decoding: mean acceptance length {totals.mean_acceptance_length:.2f}, "
            f"draft acceptance rate {100 * _acceptance_rate(totals):.1f}% "
            f"({totals.num_accepted_tokens} of "
            f"{totals.num_draft_tokens} proposed tokens accepted, by position "
            f"{totals.num_accepted_tokens_per_pos})")


def _acceptance_rate(totals) -> float:
    """Accepted / proposed tokens (0.0 before any proposal)."""
    return (totals.num_accepted_tokens / totals.num_draft_tokens
            if totals.num_draft_tokens else 0.0)


def add_spec_decode(result: dict, llm) -> None:
    """With speculative decoding on, add (and print) its acceptance figures over every pass
    the engine ran (warm-up included): ``mean_acceptance_length`` (1 + accepted / drafts),
    ``draft_acceptance_rate`` (accepted / proposed) and the per-position acceptance counts."""
    t = spec_decode_totals(llm)
    if t is None:
        return
    rate = _acceptance_rate(t)
    result["spec_decode"] = {"num_drafts": t.num_drafts, "num_draft_tokens": t.num_draft_tokens,
                             "num_accepted_tokens": t.num_accepted_tokens,
                             "num_accepted_tokens_per_pos": t.num_accepted_tokens_per_pos,
                             "mean_acceptance_length": t.mean_acceptance_length,
                             "draft_acceptance_rate": rate}
    print(spec_decode_line(t))


def write_outputs(result: dict, output_json: str | None) -> None:
    """Write ``result`` to ``output_json`` (if given) and print it as one JSON line."""
    if output_json:
        os.makedirs(os.path.dirname(os.path.abspath(output_json)), exist_ok=True)
        with open(output_json, "w") as f:
            json.dump(result, f, indent=2)
    print(json.dumps(result, separators=(",", ":")))


def _usd(text: str) -> float:
    """A ``--cost-per-hour`` value: a positive finite number (argparse reports the error
    before the benchmark runs)."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (np.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a positive number of USD, got {text!r}")
    return value


def add_cost_arg(parser) -> None:
    """``--cost-per-hour USD``: the machine's price, for :func:`add_cost`."""
    parser.add_argument("--cost-per-hour", type=_usd, default=None, metavar="USD",
                        help="the machine's price in USD per hour: report the cost per "
                             "million output and total tokens")


def add_cost(result: dict, cost_per_hour: float | None, seconds: float, output_tokens: int,
             total_tokens: int) -> None:
    """Add ``cost_per_million_output_tokens`` and ``cost_per_million_total_tokens`` (USD) to
    ``result`` and print them, for ``output_tokens`` and ``total_tokens`` (prompt and output)
    processed in ``seconds`` of wall time on a machine that costs ``cost_per_hour`` USD an hour:
    ``cost_per_hour * seconds / 3600 / tokens * 1e6``. Nothing when ``cost_per_hour`` is None.

    Raises:
        ValueError: ``cost_per_hour`` not a positive finite number.
    """
    if cost_per_hour is None:
        return
    if not (np.isfinite(cost_per_hour) and cost_per_hour > 0):
        raise ValueError(f"--cost-per-hour must be a positive number of USD, got {cost_per_hour}")
    dollars = cost_per_hour * seconds / 3600
    result["cost_per_hour"] = cost_per_hour
    for name, tokens in (("output", output_tokens), ("total", total_tokens)):
        result[f"cost_per_million_{name}_tokens"] = dollars / tokens * 1e6 if tokens else None
    per = {k: result[f"cost_per_million_{k}_tokens"] for k in ("output", "total")}
    text = ", ".join(f"${v:.4f} per million {k} tokens" if v is not None else f"no {k} tokens"
                     for k, v in per.items())
    print(f"Cost at ${cost_per_hour:g}/hour: {text}")


def plot_next_to(json_path: str, draw) -> str | None:
    """``draw(png_path)`` for the PNG beside ``json_path``; skipped (None) without matplotlib
    (``pip install -e ".[bench]"``)."""
    if importlib.util.find_spec("matplotlib") is None:
        print("matplotlib is not installed: no plot (pip install -e '.[bench]')")
        return None
    return draw(os.path.splitext(json_path)[0] + ".png")



def cpu_model() -> str:
    """The host CPU as ``/proc/cpuinfo`` names it, with what a VM's masked name hides: e.g.
    ``AMD EPYC (family 25 model 17, 2 cores, avx512f avx512_bf16)`` (cores: those this
    process may use; the flags: AVX-512, BF16 and AMX ones present). 'unknown' elsewhere."""
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read().split("\n\n")[0]
    except OSError:
        return "unknown"
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    flags = [f for f in fields.get("flags", "").split()
             if f in ("avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile")]
    cores = len(os.sched_getaffinity(0))
    return (f"{fields.get('model name', 'unknown')} (family {fields.get('cpu family', '?')} "
            f"model {fields.get('model', '?')}, {cores} cores"
            + (f", {' '.join(flags)}" if flags else "") + ")")


def machine(load_before: float) -> dict:
    """Where and when a benchmark ran: ``date`` (UTC), ``cpu`` (:func:`cpu_model`) and the
    1-minute load average at its start (``load_before``, from ``os.getloadavg()``) and now;
    on a shared machine the load says how far its figures can be trusted."""
    return {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "cpu": cpu_model(), "load_average_before_after": [round(load_before, 2),
                                                              round(os.getloadavg()[0], 2)]}
