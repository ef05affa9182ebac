"""sloserve.bench.step_clock: the scheduler's step clock file read back, and a cell's
medians taken from the steps inside its windows at its batch size alone."""

from __future__ import annotations

import pytest

from sloserve.bench.step_clock import cell_clock, read_clock


def test_a_cells_medians_come_from_its_windows_at_its_batch_size(tmp_path):
    f = tmp_path / "clock.txt"
    rows = [(10.0, 0.08, 4), (10.1, 0.08, 4), (10.2, 0.09, 4), (10.32, 0.08, 3),
            (10.4, 0.07, 4), (50.0, 0.08, 4), (50.1, 0.05, 4)]
    lines = [f"R {t:.6f} {r:.6f} {b}\n" for t, r, b in rows]
    # between each run's end and the next start: its result processed, the next batch
    # prepared (one step's processing twice: a prefill's and a decode's)
    calls = [("P", 10.081, 0.005), ("N", 10.09, 0.004), ("P", 10.181, 0.006),
             ("P", 10.185, 0.002), ("N", 10.19, 0.003), ("P", 50.081, 0.007),
             ("N", 50.09, 0.001)]
    lines += [f"{k} {t:.6f} {d:.6f}\n" for k, t, d in calls]
    f.write_text("".join(lines) + "R 51.0 0.0")
    clock = read_clock(f)
    assert clock.runs == rows  # the half-written last line left out
    assert clock.calls["P"][0] == (10.081, 0.005) and len(clock.calls["N"]) == 3
    got = cell_clock(clock, [(9.9, 10.45), (49.9, 50.2)], 4)
    # pairs at batch 4 inside one window: 10.0-10.1, 10.1-10.2 and 50.0-50.1 (10.2 is
    # followed by a batch of 3; 10.4 by 50.0, in another window)
    assert got is not None and got["steps"] == 3
    assert got["period_ms"] == pytest.approx(100.0)
    assert got["run_ms"] == pytest.approx(80.0)
    assert got["between_ms"] == pytest.approx(20.0)
    assert got["process_ms"] == pytest.approx(7.0)  # of 5, 6 + 2, 7
    assert got["next_ms"] == pytest.approx(3.0)  # of 4, 3, 1
    assert cell_clock(clock, [(9.9, 10.45)], 2) is None
    assert read_clock(tmp_path / "absent.txt").runs == []
