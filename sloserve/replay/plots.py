"""PNG plots of a report dict (report.py), rendered by matplotlib's Agg backend.

Figures are built with `matplotlib.figure.Figure` (no pyplot, no global backend switch), so
plotting works headless and does not disturb a caller's matplotlib state.

Per cell (trace / load), one line per policy:
- `<cell>_latency_cdf.png`: CDFs of TTFT, TPOT and E2E, with the SLOs marked;
- `<cell>_slo_attainment.png`: share of requests meeting both SLOs vs the SLO scale;
- `<cell>_timeseries.png`: decode batch size and mean draft length per step over time
  (from the engine time series; a note when the target exposes none).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure


def cell_slug(cell: dict[str, Any]) -> str:
    """A file-name-safe name of a cell (trace + load)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", f"{cell['trace']}__{cell['load']}").strip("_")


def write_plots(report: dict[str, Any], out_dir: str | Path) -> list[Path]:
    """Write the three plots of every cell; returns the paths."""
    out = Path(out_dir)
    paths = []
    for cell in report["cells"]:
        stem = out / cell_slug(cell)
        title = f"{cell['trace']} / {cell['load']}"
        paths.append(plot_latency_cdf(cell, report["slo"], title, Path(f"{stem}_latency_cdf.png")))
        paths.append(plot_slo_attainment(cell, title, Path(f"{stem}_slo_attainment.png")))
        paths.append(plot_timeseries(cell, title, Path(f"{stem}_timeseries.png")))
    return paths


def plot_latency_cdf(cell: dict[str, Any], slo: dict[str, Any], title: str, path: Path) -> Path:
    metrics = (("ttft_ms", "TTFT", slo["ttft_ms"]), ("tpot_ms", "TPOT", slo["tpot_ms"]),
               ("e2e_ms", "E2E latency", None))
    fig = Figure(figsize=(15, 4.5))
    axes = fig.subplots(1, 3)
    for ax, (key, label, slo_ms) in zip(axes, metrics):
        for run in cell["runs"]:
            values = np.sort([r[key] for r in run["requests"] if r[key] is not None])
            if len(values):
                ax.plot(values, np.arange(1, len(values) + 1) / len(values),
                        label=run["policy"], drawstyle="steps-post")
        if slo_ms is not None:
            ax.axvline(slo_ms, color="gray", linestyle="--", linewidth=1,
                       label=f"SLO {slo_ms:g} ms")
        ax.set_title(f"{label} CDF")
        ax.set_xlabel(f"{label} (ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    return _save(fig, f"Latency CDF per policy: {title}", path)


def plot_slo_attainment(cell: dict[str, Any], title: str, path: Path) -> Path:
    fig = Figure(figsize=(6.5, 4.5))
    ax = fig.subplots()
    for run in cell["runs"]:
        curve = run["slo_curve"]
        ax.plot([p["scale"] for p in curve], [100.0 * p["both"] for p in curve],
                marker="o", label=run["policy"])
    ax.set_xlabel("SLO scale (x TTFT and TPOT SLOs)")
    ax.set_ylabel("requests meeting both SLOs (%)")
    ax.set_ylim(0, 102)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    return _save(fig, f"SLO attainment vs SLO scale: {title}", path)


def plot_timeseries(cell: dict[str, Any], title: str, path: Path) -> Path:
    fig = Figure(figsize=(10, 6.5))
    ax_b, ax_k = fig.subplots(2, 1, sharex=True)
    plotted = False
    for run in cell["runs"]:
        series = (run.get("spec_stats") or {}).get("timeseries") or []
        if not series:
            continue
        t = [s["t_s"] for s in series]
        ax_b.plot(t, [s["batch_size"] for s in series], label=run["policy"], linewidth=1)
        ax_k.plot(t, [s["mean_draft_len"] for s in series], label=run["policy"], linewidth=1)
        plotted = True
    ax_b.set_ylabel("decode batch size")
    ax_b.set_title("Batch size over time")
    ax_k.set_ylabel("mean draft length (tokens)")
    ax_k.set_title("Draft length over time")
    ax_k.set_xlabel("time since run start (s)")
    for ax in (ax_b, ax_k):
        ax.grid(alpha=0.3)
        if plotted:
            ax.legend(fontsize="small")
        else:
            ax.text(0.5, 0.5, "no engine time series from this target",
                    ha="center", va="center", transform=ax.transAxes, color="gray")
    return _save(fig, f"Engine time series: {title}", path)


def _save(fig: Figure, suptitle: str, path: Path) -> Path:
    FigureCanvasAgg(fig)  # attach the Agg canvas explicitly
    fig.suptitle(suptitle)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path
