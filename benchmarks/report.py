"""``python -m jaxpaged.benchmarks.report``: regenerate docs/benchmarks.md's result tables and
plots from the results JSON the benchmarks wrote (``docs/results/``).

The doc marks each generated block with a pair of HTML comments naming the kind of result and
its JSON file(s), relative to the doc's folder::

    <!-- generated: compare results/compare-W1.json -->
    ... (replaced on every run)
    <!-- end generated -->

Kinds: ``compare`` (one ``benchmarks/compare.py`` result: the run's date, CPU model and load,
every row's wall time, output tokens/s, ratio and MFU; plot: throughput by engine),
``step-profile`` (one ``benchmarks/step_profile.py --output-json`` result: per-phase shares
of a decode and a prefill step; plot: the phase breakdown) and ``serve`` (one or more
``jaxpaged bench serve`` results, a row each; plots: TTFT and TPOT). Plots are PNGs next to
their JSON
(matplotlib, the ``bench`` extra). The prose around the blocks stays hand-written.

``--check`` writes nothing and exits 1 when the doc is not what the JSON gives (a test runs
it on the repository's doc).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import sys

from jaxpaged.benchmarks.datasets import ROOT
from jaxpaged.benchmarks.plots import (plot_serve_latencies, plot_step_phases,
                                       plot_throughput_by_engine)

DOC = os.path.join(ROOT, "docs", "benchmarks.md")
BLOCK = re.compile(r"(<!-- generated: (\S+) ([^>]+?) -->\n)(.*?)(<!-- end generated -->)",
                   re.S)


def _machine(result: dict) -> str:
    if "cpu" not in result:
        return "CPU model not recorded in this JSON (written before compare.py recorded it)."
    load = result.get("load_average_before_after")
    return (f"Run {result['date']} on **{result['cpu']}**"
            + (f", load average {load[0]:.1f} at the start and {load[1]:.1f} at the end"
               if load else "") + ".")


def render_compare(results: list[dict], names: list[str]) -> str:
    """Markdown for one compare.py result: machine line, table, peak line, plot link."""
    (r,), (name,) = results, names
    lines = [_machine(r), "",
             "| engine | wall s | out tok/s | jaxpaged x | MFU |", "|---|---|---|---|---|"]
    for row in r["rows"]:
        ratio = row.get("ratio_jaxpaged_over_this")
        lines.append(f"| {row['backend']} | {row['elapsed_time']:.2f} | "
                     f"{row['output_tokens_per_second']:.1f} | "
                     f"{'-' if ratio is None else f'{ratio:.2f}'} | {100 * row['mfu']:.1f}% |")
    lines += ["", f"float32 matmul peak {r['matmul_peak_gflops']:.1f} GFLOP/s (`jnp.dot`, same "
              f"run); workload {r['model_tflops']:.2f} TFLOP; roofline "
              f"{r['roofline_seconds']:.1f} s (`{name}`).", "",
              f"![{r['workload']} throughput by engine]({name[:-5]}.png)"]
    return "\n".join(lines)


def render_step_profile(results: list[dict], names: list[str]) -> str:
    """Markdown for one step_profile result: phase | decode | prefill (share, ms)."""
    (r,), (name,) = results, names
    kinds = [k for k in ("decode", "prefill") if k in r]
    phases = list(r[kinds[0]]["thread_share"])
    for k in kinds[1:]:
        phases += [p for p in r[k]["thread_share"] if p not in phases]
    lines = [_machine(r), "", "| phase | " + " | ".join(kinds) + " |",
             "|---|" + "---|" * len(kinds)]
    for p in phases:
        shares = [r[k]["thread_share"].get(p) for k in kinds]
        cells = ["" if s is None else f"{100 * s:.1f}% ({s * r[k]['best_ms']:.1f})"
                 for s, k in zip(shares, kinds)]
        lines.append(f"| {p} | " + " | ".join(cells) + " |")
    lines.append("| **step, best (median) ms** | " + " | ".join(
        f"{r[k]['best_ms']:.0f} ({r[k]['median_ms']:.0f})" for k in kinds) + " |")
    lines += ["", f"Share of the step's summed thread time, in parentheses that share of the "
              f"best wall time in ms; 4096² `jnp.dot` {r.get('peak_gflops', '?')} GFLOP/s in "
              f"the same process (`{name}`).", "",
              f"![W1 step time by phase]({name[:-5]}.png)"]
    return "\n".join(lines)


def render_serve(results: list[dict], names: list[str]) -> str:
    """Markdown for ``bench serve`` results: one row per file."""
    lines = ["| request rate | completed / failed | duration (s) | output tok/s | median TTFT "
             "(ms) | p99 TTFT (ms) | median TPOT (ms) | p99 ITL (ms) | JSON |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r, name in zip(results, names):
        lines.append(f"| {r['request_rate']} | {r['completed']} / {r['failed']} | "
                     f"{r['duration']:.2f} | {r['output_throughput']:.1f} | "
                     f"{r['median_ttft_ms']:.1f} | {r['p99_ttft_ms']:.1f} | "
                     f"{r['median_tpot_ms']:.2f} | {r['p99_itl_ms']:.2f} | `{name}` |")
    return "\n".join(lines)


RENDERERS = {"compare": render_compare, "step-profile": render_step_profile,
             "serve": render_serve}
PLOTS = {"compare": lambda r, path: plot_throughput_by_engine(
             r["rows"], path, f"{r['workload']}: output tokens/s (same machine, same run)"),
         "step-profile": plot_step_phases, "serve": plot_serve_latencies}


def regenerate(doc: str, plots: bool) -> tuple[str, list[str]]:
    """(the doc with every generated block re-rendered, the PNGs written).

    Raises:
        ValueError: an unknown kind, or a block's JSON file is missing.
    """
    with open(doc) as f:
        text = f.read()
    base, written = os.path.dirname(os.path.abspath(doc)), []

    def block(m: re.Match) -> str:
        kind, names = m.group(2), m.group(3).split()
        if kind not in RENDERERS:
            raise ValueError(f"{doc}: unknown generated block kind {kind!r}; "
                             f"known: {sorted(RENDERERS)}")
        results = []
        for name in names:
            path = os.path.join(base, name)
            if not os.path.isfile(path):
                raise ValueError(f"{doc}: block {kind} names {name}, which does not exist")
            with open(path) as f:
                results.append(json.load(f))
        for r, name in zip(results, names) if plots and kind in PLOTS else ():
            written.append(PLOTS[kind](r, os.path.join(base, name[:-5] + ".png")))
        return m.group(1) + RENDERERS[kind](results, names) + "\n" + m.group(5)

    return BLOCK.sub(block, text), written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="regenerate docs/benchmarks.md's result tables")
    p.add_argument("--doc", default=DOC)
    p.add_argument("--check", action="store_true",
                   help="write nothing; exit 1 if the doc is out of date")
    p.add_argument("--no-plots", action="store_true")
    args = p.parse_args(argv)
    plots = not (args.check or args.no_plots)
    if plots and importlib.util.find_spec("matplotlib") is None:
        print("matplotlib is not installed: tables only (pip install -e '.[bench]')")
        plots = False
    new, written = regenerate(args.doc, plots)
    with open(args.doc) as f:
        old = f.read()
    if args.check:
        if new != old:
            print(f"{args.doc} is out of date: run python -m jaxpaged.benchmarks.report")
            return 1
        return 0
    if new != old:
        with open(args.doc, "w") as f:
            f.write(new)
    print(f"{args.doc}: {len(BLOCK.findall(new))} generated blocks"
          + (f"; plots: {', '.join(os.path.relpath(w, ROOT) for w in written)}" if written else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
