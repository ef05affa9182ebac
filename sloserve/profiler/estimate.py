"""How long a profiling run will take, said before it starts: the number of timed forwards
(every grid point once per sweep, reps + 1 sweeps per model, the draft's each after a target
forward) and of engine steps (overhead and drafting runs), each priced by the engine's current
cost model (the committed profile, or the rough estimate from the models' shapes)."""

from __future__ import annotations

from dataclasses import dataclass

from sloserve.estimator.cost_model import CostModel
from sloserve.profiler.measure import Grid

OVERHEAD_STEPS = 4 * 18  # measure_overhead: batches 1, 2, 4, 8, 16 steps + 2 each
DRAFT_STEPS = 3 * 64  # measure_drafting: three batch sizes, 64 tokens, k = 4
DRAFT_K = 4


@dataclass(frozen=True)
class Estimate:
    forwards: int  # timed forwards of the grid sweeps (both models)
    steps: int  # engine steps after them
    seconds: float

    def line(self) -> str:
        return (f"{self.forwards} timed forwards and about {self.steps} engine steps: "
                f"about {_human(self.seconds)} (estimated from the current cost model)")


def _human(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def estimate(grid: Grid, points: list[tuple[int, int, int]], cost: CostModel,
             draft: bool) -> Estimate:
    sweeps = grid.reps + 1
    target = sum(cost.target.time(b * (c + q), b * q) for b, c, q in points)
    seconds = sweeps * target
    forwards = sweeps * len(points)
    if draft:
        before = cost.target.time(64 + 1, 1)
        seconds += sweeps * sum(cost.draft.time(b * (c + q), b * q) + before
                                for b, c, q in points)
        forwards += sweeps * len(points)
    step = cost.target.time(8 * 80, 8) + cost.overhead
    seconds += OVERHEAD_STEPS * step
    steps = OVERHEAD_STEPS
    if draft:
        seconds += DRAFT_STEPS * (step + DRAFT_K * cost.draft.time(8 * 80, 8))
        steps += DRAFT_STEPS
    return Estimate(forwards, steps, seconds)
