"""The SLO guard's measure of how far steps run over the cost model (docs/design.md sec. 4).

The SLO rule compares predicted step times against SLO / scale, scale = the largest
measured / predicted time over the last `window` steps with an SLO (clipped to [1, 2]), so
neither a cost model that under-prices the slowest steps nor a machine whose steps now and
then run long (a shared CPU: single decode steps at 1.5-1.8x their usual time) lets
speculation break the SLO. Until `window` steps have measured it, steps are assumed to run
`initial` x the model. Steps with prefill chunks count as 1 (their error is the prefill's),
so an overrun ages out and speculation is tried again rather than off for good.

The guard also keeps the mean overrun (an EMA over the measured steps, clipped to the same
[1, 2]): what a step runs over the model on average, for a rule that holds requests to
their SLOs in expectation (specserve-slo, budgets.py) rather than on every step. On a shared
CPU the window's worst sat at the clip, 2, in most steps of SGLang's load sweep while the
online prices ran within 3% of the measured steps at the median (docs/design.md sec. 14).
"""

from __future__ import annotations

from collections import deque

MEAN_EMA = 1.0 / 32.0  # the newest measured step's weight in the mean overrun


class OverrunGuard:
    """Running maximum of the overrun over a sliding window of steps."""

    def __init__(self, window: int, initial: float) -> None:
        self.window = window
        # (step number, overrun) with decreasing overruns, so the head is the maximum (a
        # monotone queue: O(1) a step for any window length)
        self.queue: deque[tuple[int, float]] = deque([(0, initial)])
        self.steps = 1  # overruns recorded so far, the initial one included
        self.scale = initial  # what the SLO is divided by
        self.mean = initial  # the mean overrun of the measured steps (module docstring)

    def record(self, ratio: float, measured: bool = True) -> None:
        """Add one step's measured / predicted time; `measured` False: a step whose error is
        not the model's (a prefill's), counted in the window as 1 and not in the mean."""
        if measured:
            self.mean = min(2.0, max(1.0, self.mean + MEAN_EMA * (ratio - self.mean)))
        else:
            ratio = 1.0
        t = self.steps
        self.steps = t + 1
        q = self.queue
        while q and q[-1][1] <= ratio:
            q.pop()
        q.append((t, ratio))
        if q[0][0] <= t - self.window:  # aged out of the window
            q.popleft()
        self.scale = min(2.0, max(1.0, q[0][1]))
