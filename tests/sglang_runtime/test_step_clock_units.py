"""sloserve.bench.step_clock: the scheduler's step clock file read back, a cell's medians
taken from the steps inside its windows at its batch size alone, and a window's time between
decode steps split into prefills and the scheduler's calls."""

from __future__ import annotations

import pytest

from sloserve.bench.step_clock import cell_clock, read_clock, window_gaps


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


def test_a_windows_gaps_between_decode_steps_are_split_into_their_parts(tmp_path):
    f = tmp_path / "clock.txt"
    f.write_text("".join([
        "E 9.000000 0.400000 2 300\n",  # before the window: left out
        "R 10.000000 0.100000 2\n",
        "P 10.100000 0.010000\n", "N 10.110000 0.005000\n",
        "E 10.120000 0.500000 1 200\n",  # a prefill between two decode steps
        "P 10.620000 0.020000\n", "N 10.640000 0.010000\n",
        "R 10.700000 0.100000 3\n",
        "P 10.800000 0.010000\n",
        "R 10.850000 0.100000 3\n",
        "E 10.960000 0.300000 1 50\n",  # after the window's last decode step: left out
        "R 20.000000 0.100000 3\n",  # after the window
    ]))
    clock = read_clock(f)
    assert clock.extends[1] == (10.12, 0.5, 1, 200)
    got = window_gaps(clock, 9.5, 11.0)
    assert got is not None and got["decode_steps"] == 3
    assert got["decode_s"] == pytest.approx(0.3)
    assert got["gap_s"] == pytest.approx(0.6 + 0.05)
    assert got["prefill_s"] == pytest.approx(0.5)
    assert got["prefill_tokens"] == 200 + 50  # every prefill in the window
    assert got["process_s"] == pytest.approx(0.04)
    assert got["next_s"] == pytest.approx(0.015)
    assert got["max_gap_s"] == pytest.approx(0.6)
    assert window_gaps(clock, 19.0, 21.0) is None  # one decode step
