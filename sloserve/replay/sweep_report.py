"""A load sweep's report: sweep.json (everything), sweep.md (tables) and three plots.

    goodput_vs_load.png     goodput (requests meeting their own SLOs per second) per policy,
                            mean and min..max over seeds, against the load
    class_attainment.png    SLO attainment per class, one panel per class, against the load
    mean_k_over_time.png    mean verified draft length per step over time, one panel per load
                            (the first seed), with the decode batch size behind it
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

SCHEMA = "sloserve.replay.sweep/1"


def write_sweep(out_dir: Path, report: dict[str, Any], plots: bool = True) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "sweep.json", out_dir / "sweep.md"]
    paths[0].write_text(json.dumps(report, indent=1, allow_nan=False) + "\n")
    paths[1].write_text(render_markdown(report))
    if plots:
        paths += [plot_goodput(report, out_dir / "goodput_vs_load.png"),
                  plot_class_attainment(report, out_dir / "class_attainment.png"),
                  plot_mean_k(report, out_dir / "mean_k_over_time.png")]
    return paths


def _pm(s: dict[str, float] | None, digits: int = 2, pct: bool = False) -> str:
    if s is None:
        return "-"
    f = 100.0 if pct else 1.0
    return f"{f * s['mean']:.{digits}f} ± {f * s['std']:.{digits}f}"


def render_markdown(report: dict[str, Any]) -> str:
    meta, policies = report["meta"], report["policies"]
    default = meta["default_policy"]
    lines = ["# Load sweep", "", f"Command: `{meta['command']}`", "",
             f"Workload: {meta['workload']}", "",
             f"SLO classes (base TTFT {meta['ttft_slo_ms']:g} ms, TPOT {meta['tpot_slo_ms']:g} "
             f"ms): {meta['mix']}. Rate unit: {meta['rate_unit_text']}. {meta['seeds']} seeds x "
             f"{meta['requests_per_cell']} requests per cell; every policy replays the same "
             "requests.", "",
             "Goodput (requests meeting their own TTFT and TPOT SLOs per second), mean ± std "
             "over seeds; bold: the best mean and every policy within its std:", ""]
    head = ["load", "req/s", "x ar capacity"] + policies
    rows = []
    for cell in report["loads"]:
        agg = cell["policies"]
        best = max(policies, key=lambda p: agg[p]["goodput_rps"]["mean"])
        b = agg[best]["goodput_rps"]
        cols = []
        for p in policies:
            g = agg[p]["goodput_rps"]
            text = _pm(g, 3)
            cols.append(f"**{text}**" if g["mean"] >= b["mean"] - b["std"] else text)
        cap = cell.get("x_ar_capacity")
        rows.append([f"{cell['load']:g}x", f"{cell['rate_rps']:.3g}",
                     "-" if cap is None else f"{cap:.2f}"] + cols)
    lines += _table(head, rows)
    lines += ["", f"`{default}` against each policy: paired goodput difference per seed "
              "(same requests), mean [min, max]:", ""]
    others = [p for p in policies if p != default]
    rows = []
    for cell in report["loads"]:
        agg = cell["policies"]
        row = [f"{cell['load']:g}x"]
        for p in others:
            d = cell["paired"].get(p)
            row.append("-" if d is None else
                       f"{100 * d['mean']:+.1f}% [{100 * d['min']:+.1f}, {100 * d['max']:+.1f}]")
        rows.append(row)
    lines += _table(["load"] + [f"vs {p}" for p in others], rows)
    classes = report["classes"]
    lines += ["", "SLO attainment (both SLOs), overall and per class, mean ± std over seeds "
              "(%), and mean verified k per request-step:", ""]
    for cell in report["loads"]:
        lines += ["", f"Load {cell['load']:g}x ({cell['rate_rps']:.3g} req/s):", ""]
        rows = [[p, _pm(cell["policies"][p]["attainment"], 1, True)]
                + [_pm(cell["policies"][p]["class_attainment"].get(c), 1, True) for c in classes]
                + [_pm(cell["policies"][p]["mean_k"], 2)] for p in policies]
        lines += _table(["policy", "overall"] + classes + ["mean k"], rows)
    return "\n".join(lines) + "\n"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return (["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
            + ["| " + " | ".join(r) + " |" for r in rows])


def _save(fig: Figure, title: str, path: Path) -> Path:
    FigureCanvasAgg(fig)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def plot_goodput(report: dict[str, Any], path: Path) -> Path:
    fig = Figure(figsize=(7.5, 4.8))
    ax = fig.subplots()
    loads = [c["load"] for c in report["loads"]]
    for p in report["policies"]:
        g = [c["policies"][p]["goodput_rps"] for c in report["loads"]]
        mean = [x["mean"] for x in g]
        err = [[x["mean"] - x["min"] for x in g], [x["max"] - x["mean"] for x in g]]
        ax.errorbar(loads, mean, yerr=err, marker="o", capsize=3, label=p,
                    linewidth=2.5 if p == report["meta"]["default_policy"] else 1.2)
    ax.set_xscale("log", base=2)
    ax.set_xticks(loads, [f"{x:g}x" for x in loads])
    ax.set_xlabel(f"load ({report['meta']['rate_unit_text']})")
    ax.set_ylabel("goodput (req/s meeting their SLOs)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    return _save(fig, "Goodput vs load (mean, min..max over seeds)", path)


def plot_class_attainment(report: dict[str, Any], path: Path) -> Path:
    classes = report["classes"]
    fig = Figure(figsize=(4.5 * len(classes), 4.3))
    axes = fig.subplots(1, len(classes), squeeze=False)[0]
    loads = [c["load"] for c in report["loads"]]
    for ax, cls in zip(axes, classes):
        for p in report["policies"]:
            a = [100 * c["policies"][p]["class_attainment"][cls]["mean"] for c in report["loads"]]
            ax.plot(loads, a, marker="o", label=p)
        ax.set_xscale("log", base=2)
        ax.set_xticks(loads, [f"{x:g}x" for x in loads])
        ax.set_title(f"class {cls}")
        ax.set_xlabel("load")
        ax.set_ylabel("requests meeting their SLOs (%)")
        ax.set_ylim(0, 102)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize="small")
    return _save(fig, "SLO attainment per class (mean over seeds)", path)


def plot_mean_k(report: dict[str, Any], path: Path) -> Path:
    cells = report["loads"]
    fig = Figure(figsize=(5 * len(cells), 4.3))
    axes = fig.subplots(1, len(cells), squeeze=False)[0]
    for ax, cell in zip(axes, cells):
        for p, series in cell["timeseries"].items():
            if series:
                ax.plot([s[0] for s in series], [s[2] for s in series], label=p, linewidth=1)
        ax.set_title(f"load {cell['load']:g}x (seed {report['meta']['first_seed']})")
        ax.set_xlabel("time (s)")
        ax.set_ylabel("mean verified k per request")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize="small")
    return _save(fig, "Mean draft length over time", path)
