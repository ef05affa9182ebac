"""Reports: a JSON with everything, a markdown summary and PNG plots.

The JSON (`report.json`) is the source of truth; the markdown (`report.md`) and the plots
(plots.py) are rendered from the JSON dict, so an old report can be re-rendered. Layout:

    {"schema", "meta", "slo": {ttft_ms, tpot_ms, scales},
     "cells": [{"trace", "load", "scaling", "scaling_text", "trace_summary",
                "runs": [RunSummary fields + "requests": [per-request metrics],
                         "spec_stats": SpecStats | null]}]}

A cell is one (trace, load) combination; its runs are the policies, side by side.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from sloserve.replay.metrics import (
    RequestMetrics,
    SloConfig,
    request_metrics,
    summarize_run,
    with_speedups,
)
from sloserve.replay.records import PolicyRun
from sloserve.replay.shaping import Scaling

SCHEMA = "sloserve.replay.report/1"


@dataclass(frozen=True)
class Cell:
    """The runs of all policies on one trace at one load."""

    trace: str
    load: str
    runs: tuple[PolicyRun, ...]
    scaling: Scaling | None = None
    trace_summary: dict[str, Any] | None = None  # trace.describe() of the replayed trace


@dataclass(frozen=True)
class ReportFiles:
    json: Path
    markdown: Path
    plots: tuple[Path, ...]
    records: Path | None


def build_report(
    cells: Sequence[Cell], slo: SloConfig, meta: dict[str, Any] | None = None,
    baseline: str = "ar",
) -> dict[str, Any]:
    """The report as a JSON-compatible dict (no NaN: undefined values are None)."""
    return {
        "schema": SCHEMA,
        "meta": dict(meta or {}),
        "slo": {"ttft_ms": slo.ttft_s * 1000.0, "tpot_ms": slo.tpot_s * 1000.0,
                "scales": list(slo.scales), "speedup_baseline": baseline},
        "cells": [_cell_dict(c, slo, baseline) for c in cells],
    }


def _cell_dict(cell: Cell, slo: SloConfig, baseline: str) -> dict[str, Any]:
    per_run = [[request_metrics(rec, slo, itls=False) for rec in r.records] for r in cell.runs]
    summaries = with_speedups([summarize_run(r, slo, m) for r, m in zip(cell.runs, per_run)],
                              baseline)
    runs = []
    for run, summary, metrics in zip(cell.runs, summaries, per_run):
        d = asdict(summary)
        d["requests"] = [_request_dict(m, rec.error, rec.category)
                         for m, rec in zip(metrics, run.records)]
        d["spec_stats"] = run.spec_stats.to_dict() if run.spec_stats is not None else None
        runs.append(d)
    return {
        "trace": cell.trace,
        "load": cell.load,
        "scaling": cell.scaling.to_dict() if cell.scaling is not None else None,
        "scaling_text": cell.scaling.describe() if cell.scaling is not None else "none",
        "trace_summary": cell.trace_summary,
        "runs": runs,
    }


def _request_dict(m: RequestMetrics, error: str | None, category: str | None) -> dict[str, Any]:
    def ms(x: float | None) -> float | None:
        return None if x is None else x * 1000.0

    return {
        "id": m.request_id, "success": m.success, "error": error, "category": category,
        "ttft_ms": ms(m.ttft_s), "tpot_ms": ms(m.tpot_s), "e2e_ms": ms(m.e2e_s),
        "prompt_tokens": m.prompt_tokens, "output_tokens": m.output_tokens,
        "num_chunks": m.num_chunks,
    }


def write_report(
    out_dir: str | Path,
    cells: Sequence[Cell],
    slo: SloConfig,
    *,
    meta: dict[str, Any] | None = None,
    plots: bool = True,
    raw_records: bool = True,
) -> ReportFiles:
    """Write report.json, report.md, the plots and (optionally) records.jsonl (raw chunk
    timings of every request) into out_dir."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    report = build_report(cells, slo, meta)
    json_path = out / "report.json"
    # no indent: json's C encoder only runs without one (~10x faster on a full trace's
    # per-request entries); report.md is the human-readable form
    json_path.write_text(json.dumps(report, allow_nan=False) + "\n")
    md_path = out / "report.md"
    md_path.write_text(render_markdown(report))
    pngs: tuple[Path, ...] = ()
    if plots:
        from sloserve.replay.plots import write_plots

        pngs = tuple(write_plots(report, out))
    records_path = None
    if raw_records:
        records_path = out / "records.jsonl"
        with open(records_path, "w", encoding="utf-8") as f:
            for cell in cells:
                for run in cell.runs:
                    for rec in run.records:
                        row = {"trace": cell.trace, "load": cell.load, "policy": run.policy}
                        f.write(json.dumps({**row, **rec.to_dict()}) + "\n")
    return ReportFiles(json_path, md_path, pngs, records_path)


def load_report(path: str | Path) -> dict[str, Any]:
    report = json.loads(Path(path).read_text())
    if report.get("schema") != SCHEMA:
        raise ValueError(f"{path}: not a {SCHEMA} report")
    return report


# ---- markdown -------------------------------------------------------------------------------

SUMMARY_COLUMNS = (
    ("policy", lambda r: r["policy"]),
    ("ok/sent", lambda r: f"{r['completed']}/{r['num_requests']}"),
    ("TTFT mean ms", lambda r: _num(r["ttft_ms"]["mean"])),
    ("TTFT p99 ms", lambda r: _num(r["ttft_ms"]["p99"])),
    ("TPOT mean ms", lambda r: _num(r["tpot_ms"]["mean"])),
    ("TPOT p99 ms", lambda r: _num(r["tpot_ms"]["p99"])),
    ("ITL mean ms", lambda r: _num(r["itl_ms"]["mean"])),
    ("E2E mean ms", lambda r: _num(r["e2e_ms"]["mean"])),
    ("E2E p99 ms", lambda r: _num(r["e2e_ms"]["p99"])),
    ("SLO att.", lambda r: _pct(r["slo_attainment"])),
    ("goodput req/s", lambda r: _num(r["goodput_rps"], 3)),
    ("speedup", lambda r: _num(r["speedup"], 2, "x")),
    ("out tok/s", lambda r: _num(r["output_throughput_tps"])),
    ("acc. rate", lambda r: _pct((r["spec"] or {}).get("acceptance_rate"))),
    ("acc. len", lambda r: _num((r["spec"] or {}).get("mean_accepted_len"), 2)),
    ("mean k", lambda r: _num((r["spec"] or {}).get("mean_verified_k"), 2)),
)


def render_markdown(report: dict[str, Any]) -> str:
    """Markdown: per cell, the scaling, a table of policies side by side and SLO curves."""
    slo = report["slo"]
    lines = [
        "# Replay report", "",
        (f"SLOs: TTFT {slo['ttft_ms']:g} ms, TPOT {slo['tpot_ms']:g} ms (per-request SLOs "
         f"override); speedup = mean E2E of `{slo['speedup_baseline']}` / mean E2E."),
        "Latencies in ms; TPOT = (E2E - TTFT) / (output tokens - 1); ITL per streamed chunk.",
    ]
    for cell in report["cells"]:
        lines += ["", f"## {cell['trace']} / {cell['load']}", "",
                  f"Scaling: {cell['scaling_text']}", ""]
        if cell.get("trace_summary"):
            lines += [f"Replayed trace: {_trace_line(cell['trace_summary'])}", ""]
        lines += _table([name for name, _ in SUMMARY_COLUMNS],
                        [[fmt(r) for _, fmt in SUMMARY_COLUMNS] for r in cell["runs"]])
        lines += ["", "SLO attainment (TTFT and TPOT) vs SLO scale:", ""]
        lines += _table(["policy"] + [f"x{s:g}" for s in slo["scales"]],
                        [[r["policy"]] + [_pct(p["both"]) for p in r["slo_curve"]]
                         for r in cell["runs"]])
    return "\n".join(lines) + "\n"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return out + ["| " + " | ".join(row) + " |" for row in rows]


def _trace_line(s: dict[str, Any]) -> str:
    if not s.get("num_requests"):
        return "0 requests"
    rate = f"{s['rate_rps']:.3g} req/s" if s.get("rate_rps") is not None else "n/a req/s"
    return (f"{s['num_requests']} requests over {s['span_s']:.1f} s ({rate}), "
            f"input mean {s['mean_input_tokens']:.0f} tokens, "
            f"output mean {s['mean_output_tokens']:.0f} tokens")


def _num(x: float | None, digits: int = 1, suffix: str = "") -> str:
    return "-" if x is None else f"{x:.{digits}f}{suffix}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100.0 * x:.1f}%"
