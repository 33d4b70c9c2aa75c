"""PNG plots of benchmark results (matplotlib, the ``bench`` extra), written next to the JSON.

* :func:`plot_throughput_by_engine`: output tokens/s of every row of a comparison;
* :func:`plot_serve_latencies`: TTFT and TPOT distributions of a ``bench serve`` run;
* :func:`plot_throughput_vs_max_num_seqs`: jaxpaged's output tokens/s against
  ``--max-num-seqs``;
* :func:`plot_step_phases`: where a decode and a prefill step spend their time, per phase
  (``benchmarks/step_profile.py``);
* :func:`plot_grouped_bars`: panels of grouped bars, one bar per engine in each group
  (``benchmarks/compare_chat.py``).
"""

from __future__ import annotations


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_throughput_by_engine(rows: list[dict], path: str, title: str) -> str:
    """Bar chart of ``output_tokens_per_second`` per ``backend``; returns ``path``."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    names = [r["backend"] for r in rows]
    values = [r["output_tokens_per_second"] for r in rows]
    bars = ax.barh(names[::-1], values[::-1], color="tab:blue")
    ax.bar_label(bars, fmt="%.1f")
    ax.set_xlabel("output tokens/s")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_serve_latencies(result: dict, path: str) -> str:
    """Histograms of per-request TTFT and TPOT (ms) of a ``bench serve`` result."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    for ax, key, label in ((axes[0], "ttfts", "TTFT (ms)"), (axes[1], "tpots", "TPOT (ms)")):
        values = [1000 * v for v in result.get(key, []) if v > 0]
        ax.hist(values, bins=30, color="tab:orange")
        ax.set_xlabel(label)
        ax.set_ylabel("requests")
    fig.suptitle(f"bench serve: rate {result.get('request_rate')}, "
                 f"{result.get('completed')} requests")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_throughput_vs_max_num_seqs(points: list[tuple[int, float]], path: str) -> str:
    """Line of output tokens/s against ``--max-num-seqs``."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    xs, ys = zip(*sorted(points))
    ax.plot(xs, ys, marker="o")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("--max-num-seqs")
    ax.set_ylabel("output tokens/s")
    ax.set_title("jaxpaged throughput against batch limit")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_step_phases(result: dict, path: str) -> str:
    """Stacked bars, one per profiled step (``decode``, ``prefill``): each phase's share of
    the step's summed thread time (``thread_share`` of a ``step_profile`` result), phases in
    the order of the first step's largest first."""
    plt = _pyplot()
    kinds = [k for k in ("decode", "prefill") if k in result]
    phases = list(result[kinds[0]]["thread_share"])
    for k in kinds[1:]:
        phases += [p for p in result[k]["thread_share"] if p not in phases]
    fig, ax = plt.subplots(figsize=(9, 2.6))
    left = [0.0] * len(kinds)
    colors = plt.get_cmap("tab20").colors
    for i, phase in enumerate(phases):
        shares = [100 * result[k]["thread_share"].get(phase, 0.0) for k in kinds]
        ax.barh(kinds, shares, left=left, label=phase, color=colors[i % len(colors)])
        left = [a + b for a, b in zip(left, shares)]
    ax.set_xlim(0, 100)
    ax.invert_yaxis()
    ax.set_xlabel("% of the step's thread time")
    ax.set_title("W1 step time by phase (" + ", ".join(
        f"{k} {result[k]['best_ms']:.0f} ms" for k in kinds) + " best)")
    ax.legend(ncol=2, fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def plot_grouped_bars(panels: list[tuple[str, list[str], dict[str, list[float]]]], path: str,
                      title: str) -> str:
    """One panel per ``(ylabel, group names, {engine: one value per group})`` of ``panels``,
    side by side: in each group a bar per engine, labelled with its value; returns ``path``."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels), 3.4), squeeze=False)
    colors = plt.get_cmap("tab10").colors
    for ax, (label, groups, values) in zip(axes[0], panels):
        width = 0.8 / max(len(values), 1)
        for i, (engine, ys) in enumerate(values.items()):
            xs = [g + (i - (len(values) - 1) / 2) * width for g in range(len(groups))]
            bars = ax.bar(xs, ys, width, label=engine, color=colors[i % len(colors)])
            ax.bar_label(bars, fmt="%.4g", fontsize=7)
        ax.set_xticks(range(len(groups)), groups)
        ax.set_ylabel(label)
        ax.margins(y=0.15)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
