"""Reads the scheduler's step clock (sglang_internals.install_step_clock, on with
`SLOSERVE_STEP_CLOCK=<file>` in a server's environment; the SGLang bench's `--step-clock`):
per decode batch its run_batch (start, seconds, batch size), per other batch (prefills) its
run_batch (start, seconds, batch size, new tokens), and the starts and seconds of the
scheduler's result processing (P) and next-batch preparation (N) calls. Starts are
time.perf_counter values, the system-wide monotonic clock on Linux, so a client's
perf_counter windows select a cell's rows. A step's period is one run's start to the next;
less the run, what SGLang's scheduler did between the two forwards, of which P and N are
the parts timed."""

from __future__ import annotations

import bisect
import statistics
from dataclasses import dataclass, field
from pathlib import Path

Row = tuple[float, float, int]  # (start s, run s, batch size): one decode batch's run_batch


@dataclass
class Clock:
    runs: list[Row] = field(default_factory=list)  # decode batches, in order
    # other batches (prefills), in order: (start s, run s, batch size, new tokens)
    extends: list[tuple[float, float, int, int]] = field(default_factory=list)
    # (start s, seconds) of each kind of call between forwards, in order
    calls: dict[str, list[tuple[float, float]]] = field(
        default_factory=lambda: {"P": [], "N": []})


def read_clock(path: Path) -> Clock:
    """The file's lines (a half-written last line, from a server stopped mid-write, left
    out)."""
    clock = Clock()
    if not path.exists():
        return clock
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) == 4 and parts[0] == "R":
            clock.runs.append((float(parts[1]), float(parts[2]), int(parts[3])))
        elif len(parts) == 5 and parts[0] == "E":
            clock.extends.append((float(parts[1]), float(parts[2]), int(parts[3]),
                                  int(parts[4])))
        elif len(parts) == 3 and parts[0] in clock.calls:
            clock.calls[parts[0]].append((float(parts[1]), float(parts[2])))
    return clock


def _inside(calls: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Seconds of the calls that started in [lo, hi)."""
    i = bisect.bisect_left(calls, (lo, float("-inf")))
    total = 0.0
    while i < len(calls) and calls[i][0] < hi:
        total += calls[i][1]
        i += 1
    return total


def cell_clock(clock: Clock, windows: list[tuple[float, float]], bs: int) -> dict | None:
    """Medians over the decode steps at batch size `bs` that started inside one of the
    windows and were followed, inside the same window, by another decode step at `bs`:
    period_ms (start to next start), run_ms (the step's run_batch), between_ms (period less
    run), process_ms and next_ms (the P and N calls between the run's end and the next
    start). None without such a pair."""
    periods, runs, procs, nexts = [], [], [], []
    rows = clock.runs
    for (t, run, b), (t2, _, b2) in zip(rows, rows[1:]):
        if b != bs or b2 != bs:
            continue
        if any(lo <= t and t2 <= hi for lo, hi in windows):
            periods.append(t2 - t)
            runs.append(run)
            procs.append(_inside(clock.calls["P"], t + run, t2))
            nexts.append(_inside(clock.calls["N"], t + run, t2))
    if not periods:
        return None
    return {"steps": len(periods), "period_ms": 1e3 * statistics.median(periods),
            "run_ms": 1e3 * statistics.median(runs),
            "between_ms": 1e3 * statistics.median(p - r for p, r in zip(periods, runs)),
            "process_ms": 1e3 * statistics.median(procs),
            "next_ms": 1e3 * statistics.median(nexts)}


def window_gaps(clock: Clock, lo: float, hi: float) -> dict | None:
    """Where a window's time between decode steps went, over the decode steps that started
    in [lo, hi): decode_steps, decode_s (their runs), gap_s (from each run's end to the next
    decode step's start, the last step's left out), and of the gaps prefill_s (the other
    batches' runs inside them), process_s and next_s (the P and N calls inside them),
    max_gap_s; prefill_tokens: the new tokens of every other batch that started in the
    window (the first prefills, before any decode step, included). None without two
    decode steps in the window."""
    rows = [r for r in clock.runs if lo <= r[0] < hi]
    if len(rows) < 2:
        return None
    starts = [e[0] for e in clock.extends]
    gaps, prefill, proc, nxt = [], 0.0, 0.0, 0.0
    for (t, run, _), (t2, _, _) in zip(rows, rows[1:]):
        end = t + run
        gaps.append(t2 - end)
        i = bisect.bisect_left(starts, end)
        while i < len(starts) and starts[i] < t2:
            prefill += clock.extends[i][1]
            i += 1
        proc += _inside(clock.calls["P"], end, t2)
        nxt += _inside(clock.calls["N"], end, t2)
    return {"decode_steps": len(rows), "decode_s": sum(r[1] for r in rows),
            "gap_s": sum(gaps), "prefill_s": prefill,
            "prefill_tokens": sum(e[3] for e in clock.extends if lo <= e[0] < hi),
            "process_s": proc, "next_s": nxt, "max_gap_s": max(gaps)}
