"""Reads the scheduler's step clock (sglang_internals.install_step_clock, on with
`SLOSERVE_STEP_CLOCK=<file>` in a server's environment; the SGLang bench's `--step-clock`):
per decode batch its start (time.perf_counter, the system-wide monotonic clock on Linux,
so a client's perf_counter windows select a cell's rows), its run_batch seconds and its
batch size. A step's period is one start to the next; less the run, what SGLang's scheduler
did between the two forwards (the last result's processing, streaming, the next batch)."""

from __future__ import annotations

import statistics
from pathlib import Path

Row = tuple[float, float, int]  # (start s, run s, batch size)


def read_clock(path: Path) -> list[Row]:
    """The file's rows in order (a half-written last line, from a server stopped mid-write,
    left out)."""
    rows: list[Row] = []
    if not path.exists():
        return rows
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) == 3:
            rows.append((float(parts[0]), float(parts[1]), int(parts[2])))
    return rows


def cell_clock(rows: list[Row], windows: list[tuple[float, float]], bs: int) -> dict | None:
    """Medians over the decode steps at batch size `bs` that started inside one of the
    windows and were followed, inside the same window, by another decode step at `bs`:
    period_ms (start to next start), run_ms (the step's run_batch), between_ms (period less
    run). None without such a pair."""
    periods, runs = [], []
    for (t, run, b), (t2, _, b2) in zip(rows, rows[1:]):
        if b != bs or b2 != bs:
            continue
        if any(lo <= t and t2 <= hi for lo, hi in windows):
            periods.append(t2 - t)
            runs.append(run)
    if not periods:
        return None
    return {"steps": len(periods), "period_ms": 1e3 * statistics.median(periods),
            "run_ms": 1e3 * statistics.median(runs),
            "between_ms": 1e3 * statistics.median(p - r for p, r in zip(periods, runs))}
