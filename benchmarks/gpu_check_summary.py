"""The summary of ``benchmarks/gpu_check.sh``: what each step left in ``$OUT``, in one page.

Usage: ``python -m jaxpaged.benchmarks.gpu_check_summary OUT_DIR LOG_DIR`` (the script runs it after
every step, so the summary covers the steps done so far). Reads ``LOG_DIR/steps.txt`` (one
``NAME rc=N seconds=S box=B`` line per finished step; rc 124 or 137 = cut off by its time
box), ``LOG_DIR/probe.log``, and from ``OUT_DIR`` ``ab.json`` (the kernel microbenchmark),
``kernel_tests.xml`` (pytest's JUnit report) and ``throughput_{pallas,xla}.json``.
"""

from __future__ import annotations

import json
import os
import sys
import xml.etree.ElementTree as ET

from jaxpaged.benchmarks.kernels import attention_report as report


def step_lines(log_dir: str) -> list[str]:
    """One line per finished step: its exit status, seconds and time box."""
    path = os.path.join(log_dir, "steps.txt")
    if not os.path.exists(path):
        return ["steps: none finished"]
    lines = ["steps:"]
    with open(path) as f:
        for line in f:
            fields = dict(kv.split("=", 1) for kv in line.split()[1:])
            rc = int(fields["rc"])
            state = "ok" if rc == 0 else ("TIMED OUT" if rc in (124, 137) else f"FAILED rc={rc}")
            lines.append(f"  {line.split()[0]:10} {state:12} {fields['seconds']:>4}s of "
                         f"{fields['box']}s")
    return lines


def ab_lines(path: str) -> list[str]:
    """The kernel A/B table, its ratios and the goals, from the microbenchmark's JSON."""
    if not os.path.exists(path):
        return ["kernel A/B: no ab.json"]
    with open(path) as f:
        ab = json.load(f)
    copy = ab.get("copy_Bps")
    lines = [f"kernel A/B: {ab['device']} (jax {ab.get('jax')}), device-to-device copy "
             f"{copy / 1e9:.0f} GB/s, {len(ab['rows'])} cases in {ab.get('elapsed_s', 0):.0f} s",
             report.HEADER]
    for row in ab["rows"]:
        vs_xla = row.get("ratios", {}).get("vs_xla", {})
        lines += [report.format_result(row["case"], b, r, vs_xla.get(b))
                  for b, r in row["results"].items()]
        extra = report.format_ratios(row.get("ratios", {}))
        lines += [extra] if extra else []
    goals = ab.get("goals") or report.check_goals(ab["rows"], ab["backends"],
                                                  ab.get("hbm_peak_Bps") is not None)
    return lines + report.format_goals(goals)


def kernel_test_lines(path: str) -> list[str]:
    """Pass/fail counts of the kernel-test subset and the names of failures."""
    if not os.path.exists(path):
        return ["kernel tests: no kernel_tests.xml (cut off before pytest finished?)"]
    suites = ET.parse(path).getroot()
    suite = suites if suites.tag == "testsuite" else suites.find("testsuite")
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    bad = [case.get("name") for case in suite.iter("testcase")
           if case.find("failure") is not None or case.find("error") is not None]
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    lines = [f"kernel tests (compiled): {passed} passed, {counts['failures']} failed, "
             f"{counts['errors']} errors, {counts['skipped']} skipped of {counts['tests']}"]
    return lines + [f"  failed: {name}" for name in bad]


def throughput_lines(out_dir: str) -> list[str]:
    """Output tokens/s of the 8B-shaped engine (8 of its layers) on each backend, and pallas
    over xla."""
    lines, rates = ["8B-shaped throughput (8 of 32 layers):"], {}
    for backend in ("pallas", "xla"):
        path = os.path.join(out_dir, f"throughput_{backend}.json")
        if not os.path.exists(path):
            lines.append(f"  {backend:6} no result")
            continue
        with open(path) as f:
            r = json.load(f)
        rates[backend] = r["output_tokens_per_second"]
        lines.append(f"  {backend:6} {r['output_tokens_per_second']:9.1f} output tok/s, "
                     f"{r['tokens_per_second']:9.1f} total tok/s ({r['num_requests']} requests "
                     f"in {r['elapsed_time']:.2f} s; warm-up {r['warmup_time']:.1f} s; "
                     f"{r['num_compilations_during_run']} compilations in the timed pass)")
    if len(rates) == 2:
        lines.append(f"  pallas / xla: {rates['pallas'] / rates['xla']:.2f}x")
    return lines


def summary(out_dir: str, log_dir: str) -> str:
    """The whole summary text."""
    lines = ["gpu_check summary"] + step_lines(log_dir)
    probe = os.path.join(log_dir, "probe.log")
    if os.path.exists(probe):
        with open(probe) as f:
            lines += ["probe: " + line.strip() for line in f if line.strip()]
    lines += ab_lines(os.path.join(out_dir, "ab.json"))
    lines += kernel_test_lines(os.path.join(out_dir, "kernel_tests.xml"))
    lines += throughput_lines(out_dir)
    return "\n".join(lines)


if __name__ == "__main__":
    print(summary(*sys.argv[1:3]))
