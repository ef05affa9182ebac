"""How long a profiling run will take, said before it starts: the number of timed forwards
(every grid point once per sweep, reps + 1 sweeps per model, the draft's each after a target
forward) and of engine steps (overhead and drafting runs), priced by a linear cost fitted to
a few probe forwards at the grid's corners (the committed profile may be missing or from
another machine, and the rough estimate from the models' shapes is far off on a CPU)."""

from __future__ import annotations

from dataclasses import dataclass

from sloserve.estimator.cost_model import ForwardCost
from sloserve.profiler.fit import fit_forward_cost
from sloserve.profiler.measure import Grid, time_forward

OVERHEAD_STEPS = 4 * 18  # measure_overhead: batches 1, 2, 4, 8, 16 steps + 2 each
DRAFT_STEPS = 3 * 64  # measure_drafting: three batch sizes, 64 tokens, k = 4
DRAFT_K = 4
STEP_EXTRA_S = 2e-3  # the engine's own work per step beyond the forwards (a guess)


@dataclass(frozen=True)
class Estimate:
    forwards: int  # timed forwards of the grid sweeps (both models)
    steps: int  # engine steps after them
    seconds: float

    def line(self) -> str:
        return (f"{self.forwards} timed forwards and about {self.steps} engine steps: "
                f"about {_human(self.seconds)}")


def _human(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def corners(points: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """The grid's smallest and largest points in each direction (4 distinct at most)."""
    b0, b1 = min(p[0] for p in points), max(p[0] for p in points)
    c0, c1 = min(p[1] for p in points), max(p[1] for p in points)
    q0, q1 = min(p[2] for p in points), max(p[2] for p in points)
    fits = set(points)
    want = [(b0, c0, q0), (b1, c1, q1), (b1, c0, q0), (b0, c1, q1), (b1, c0, q1)]
    return [p for p in dict.fromkeys(want) if p in fits]


def probe(runner, alloc, points: list[tuple[int, int, int]]) -> ForwardCost:
    """A linear cost from the fastest of two timings of each corner (after a warm-up)."""
    samples = []
    for b, c, q in corners(points):
        time_forward(runner, alloc, b, c, q)
        t = min(time_forward(runner, alloc, b, c, q) for _ in range(2))
        samples.append((b * (c + q), b * q, t))
    while len(samples) < 3:  # a one-point grid: the fit needs three samples
        samples.append(samples[0])
    return fit_forward_cost(samples, knee=False).cost


def estimate(grid: Grid, points: list[tuple[int, int, int]], target: ForwardCost,
             draft: ForwardCost | None) -> Estimate:
    sweeps = grid.reps + 1
    seconds = sweeps * sum(target.time(b * (c + q), b * q) for b, c, q in points)
    forwards = sweeps * len(points)
    if draft is not None:
        before = target.time(64 + 1, 1)
        seconds += sweeps * sum(draft.time(b * (c + q), b * q) + before for b, c, q in points)
        forwards += sweeps * len(points)
    step = target.time(8 * 80, 8) + STEP_EXTRA_S
    seconds += OVERHEAD_STEPS * step
    steps = OVERHEAD_STEPS
    if draft is not None:
        seconds += DRAFT_STEPS * (step + DRAFT_K * draft.time(8 * 80, 8))
        steps += DRAFT_STEPS
    return Estimate(forwards, steps, seconds)
