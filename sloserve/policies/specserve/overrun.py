"""The SLO guard's measure of how far steps run over the cost model (docs/design.md sec. 4).

The SLO rule compares predicted step times against SLO / scale, scale = the largest
measured / predicted time over the last `window` steps with an SLO (clipped to [1, 2]), so
neither a cost model that under-prices the slowest steps nor a machine whose steps now and
then run long (a shared CPU: single decode steps at 1.5-1.8x their usual time) lets
speculation break the SLO. Until `window` steps have measured it, steps are assumed to run
`initial` x the model. Steps with prefill chunks count as 1 (their error is the prefill's),
so an overrun ages out and speculation is tried again rather than off for good.
"""

from __future__ import annotations

from collections import deque


class OverrunGuard:
    """Running maximum of the overrun over a sliding window of steps."""

    def __init__(self, window: int, initial: float) -> None:
        self.window = window
        # (step number, overrun) with decreasing overruns, so the head is the maximum (a
        # monotone queue: O(1) a step for any window length)
        self.queue: deque[tuple[int, float]] = deque([(0, initial)])
        self.steps = 1  # overruns recorded so far, the initial one included
        self.scale = initial  # what the SLO is divided by

    def record(self, ratio: float) -> None:
        """Add one step's measured / predicted time."""
        t = self.steps
        self.steps = t + 1
        q = self.queue
        while q and q[-1][1] <= ratio:
            q.pop()
        q.append((t, ratio))
        if q[0][0] <= t - self.window:  # aged out of the window
            q.popleft()
        self.scale = min(2.0, max(1.0, q[0][1]))
