"""Plots of `utils.bench` results: throughput, latency percentiles and latency CDFs, one line per target, and
where a request's time went (`plot_time_split`).

Figures are built with ``matplotlib.figure.Figure`` rather than pyplot: no global state, no GUI backend
(works headless, in tests and in papermill), and a notebook shows the returned figure exactly once.
Every function returns its Figure and, given ``path``, also saves it as PNG. In a notebook the inline
backend (``%matplotlib inline``, ipykernel's default once matplotlib is in use) draws a returned Figure.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

AXIS_LABELS = {"concurrency": "concurrent clients (closed loop)", "request_rate": "request rate, req/s (open loop)"}
METRIC_LABELS = {"ttft": "time to first token", "itl": "inter-token latency", "e2e": "end-to-end latency"}


def _save(figure: Figure, path: str | Path | None) -> Figure:
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        figure.savefig(path, dpi=120, bbox_inches="tight")
    return figure


def _by_target(summary: pd.DataFrame, x: str) -> list[tuple[str, pd.DataFrame]]:
    """The rows that have an ``x`` (closed-loop rows for concurrency, open-loop ones for rate), per target."""
    rows = summary[summary[x].notna()]
    if rows.empty:
        raise ValueError(f"no rows with a {x}: nothing to plot against it")
    return [(target, group.sort_values(x)) for target, group in rows.groupby("target", sort=False)]


def _x_axis(axes, x: str, values: pd.Series) -> None:
    axes.set_xlabel(AXIS_LABELS.get(x, x))
    if x == "concurrency" and values.max() / max(values.min(), 1) >= 8:
        axes.set_xscale("log", base=2)  # 1, 16, 64, 256: evenly spaced
    axes.set_xticks(sorted(values.unique()))
    axes.set_xticklabels([f"{v:g}" for v in sorted(values.unique())])
    axes.grid(True, alpha=0.3)


def plot_throughput(summary: pd.DataFrame, x: str = "concurrency", path: str | Path | None = None) -> Figure:
    """Requests/s and output tokens/s against load, per target; error bars show the std across repeats."""
    figure = Figure(figsize=(11, 4.2), layout="constrained")
    left, right = figure.subplots(1, 2)
    for target, rows in _by_target(summary, x):
        for axes, column in ((left, "requests_per_s"), (right, "output_tokens_per_s")):
            spread = rows.get(f"{column}_std")
            axes.errorbar(rows[x], rows[column], yerr=spread, marker="o", capsize=3, label=target)
    for axes, title in ((left, "requests per second"), (right, "output tokens per second")):
        axes.set_title(title)
        axes.set_ylim(bottom=0)
        _x_axis(axes, x, summary[x].dropna())
    left.legend()
    return _save(figure, path)


def plot_latency(summary: pd.DataFrame, metric: str = "ttft", x: str = "concurrency", path: str | Path | None = None) -> Figure:
    """p50 (solid) and p99 (dashed) of ``metric`` (ttft, itl or e2e) against load, per target, in ms."""
    if metric not in METRIC_LABELS:
        raise ValueError(f"metric must be one of {', '.join(METRIC_LABELS)}, got {metric!r}")
    figure = Figure(figsize=(6.5, 4.2), layout="constrained")
    axes = figure.subplots()
    for number, (target, rows) in enumerate(_by_target(summary, x)):
        color = f"C{number}"
        axes.plot(rows[x], rows[f"{metric}_p50_ms"], marker="o", color=color, label=f"{target} p50")
        axes.plot(rows[x], rows[f"{metric}_p99_ms"], marker="^", linestyle="--", color=color, label=f"{target} p99")
    axes.set_title(METRIC_LABELS[metric])
    axes.set_ylabel("ms")
    axes.set_ylim(bottom=0)
    _x_axis(axes, x, summary[x].dropna())
    axes.legend(fontsize="small")
    return _save(figure, path)


def plot_latency_cdf(
    records: pd.DataFrame,
    metric: str = "e2e_ms",
    concurrency: int | None = None,
    path: str | Path | None = None,
) -> Figure:
    """The CDF of one latency (``e2e_ms`` or ``ttft_ms``) over the successful requests of one closed-loop
    level per target: ``concurrency`` (default: the highest measured)."""
    closed = records[(records["mode"] == "closed") & (records["error"] == "")]
    if closed.empty:
        raise ValueError("no successful closed-loop requests to draw a CDF from")
    level = concurrency if concurrency is not None else closed["concurrency"].max()
    chosen = closed[closed["concurrency"] == level]
    if chosen.empty:
        raise ValueError(f"no successful requests at concurrency {level}")
    figure = Figure(figsize=(6.5, 4.2), layout="constrained")
    axes = figure.subplots()
    for target, rows in chosen.groupby("target", sort=False):
        values = np.sort(rows[metric].to_numpy())
        fractions = np.arange(len(values) + 1) / len(values)  # from 0 below the fastest to 1 at the slowest
        axes.step(np.r_[values[0], values], fractions, where="post", label=f"{target} (n={len(values)})")
    name = METRIC_LABELS.get(metric.removesuffix("_ms"), metric)
    axes.set_title(f"{name}, {level:g} concurrent clients")
    axes.set_xlabel("ms")
    axes.set_ylabel("fraction of requests")
    axes.set_ylim(0, 1.02)
    axes.grid(True, alpha=0.3)
    axes.legend()
    return _save(figure, path)


TIME_PARTS = {  # utils.bench's means, stacked in the order a request meets them (end to end, for the client)
    "engine_queue_ms": "waiting in the engine's queue",
    "engine_inference_ms": "in the engine: scheduled to last token",
    "vllm_frontend_ms": "between vLLM's event loop and its engine",
    "outside_vllm_ms": "outside vLLM: server, backend, network, client",
}


def plot_time_split(summary: pd.DataFrame, path: str | Path | None = None) -> Figure:
    """Where a request's time went, per target and concurrency: one bar each, stacked from vLLM's own
    histograms (``utils.bench.engine_time_split``; means, so they add up to the client's mean end to end).
    A part below zero (clocks of two processes, a few ms) is drawn as zero."""
    rows = summary[summary["concurrency"].notna()] if "concurrency" in summary else summary.iloc[0:0]
    missing = [column for column in TIME_PARTS if column not in rows]
    if rows.empty or missing:
        raise ValueError(f"no closed-loop levels with the engine's time split (missing: {missing or 'levels'})")
    rows = rows.sort_values(["concurrency", "target"], kind="stable")
    labels = [f"{target}, {concurrency:g}" for target, concurrency in zip(rows["target"], rows["concurrency"])]
    figure = Figure(figsize=(9, 0.45 * len(rows) + 1.6), layout="constrained")
    axes = figure.subplots()
    left = np.zeros(len(rows))
    for number, (column, label) in enumerate(TIME_PARTS.items()):
        width = rows[column].fillna(0).clip(lower=0).to_numpy()
        axes.barh(labels, width, left=left, color=f"C{number}", label=label)
        left += width
    axes.invert_yaxis()  # the lowest concurrency on top, as read
    axes.set_xlabel("ms per request (mean)")
    axes.set_title("where a request's time went (target, concurrent clients)")
    axes.grid(True, axis="x", alpha=0.3)
    figure.legend(loc="outside lower center", ncols=2, fontsize="small")  # below the bars, never over them
    return _save(figure, path)


def save_benchmark_plots(summary: pd.DataFrame, records: pd.DataFrame, out_dir: str | Path) -> list[Path]:
    """Every plot the data allows, as PNGs in ``out_dir``: against concurrency (closed-loop levels) and
    against request rate (open-loop levels), the CDFs of the highest concurrency, and where the time went
    (when every target had a metrics page to read vLLM's histograms from)."""
    out = Path(out_dir)
    written = []
    for x, suffix in (("concurrency", ""), ("request_rate", "_rate")):
        if summary[x].notna().any():
            plot_throughput(summary, x, out / f"throughput{suffix}.png")
            written.append(out / f"throughput{suffix}.png")
            for metric in ("ttft", "itl"):
                plot_latency(summary, metric, x, out / f"{metric}{suffix}.png")
                written.append(out / f"{metric}{suffix}.png")
    if ((records["mode"] == "closed") & (records["error"] == "")).any():
        for metric in ("e2e_ms", "ttft_ms"):
            name = f"cdf_{metric.removesuffix('_ms')}.png"
            plot_latency_cdf(records, metric, path=out / name)
            written.append(out / name)
    if set(TIME_PARTS) <= set(summary.columns) and summary["concurrency"].notna().any():
        plot_time_split(summary, out / "time_split.png")
        written.append(out / "time_split.png")
    return written
