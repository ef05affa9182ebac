"""Each live request's decode progress as a policy sees it: seconds since its decoding began
and tokens its decode steps emitted, learned from the step feedback (`VerifyOutcome`).

A request's TPOT (docs/design.md sec. 11) is (E2E - TTFT) / (output tokens - 1): the wall time
after its first token over the tokens emitted since (its first token comes from its prefill).
So after `elapsed` seconds and `tokens` tokens of decoding, a request with TPOT SLO s is
`slack = s * tokens - elapsed` seconds ahead of its SLO (negative: behind). The SLO-customized
policies (specserve-slo, adaserve) size each request's speculation from it.

The wall time is not the sum of the request's decode steps: between two of them an engine
may run other work that every decoding request waits through (SGLang runs a new request's
prefill as a forward of its own). Where the caller tells each step's end on its clock
(`VerifyOutcome.end_time`), a request's seconds are the time since its previous step's end;
its first step, or a step without an end time, counts the step's own time. `StepStalls`
learns how much such time a step brings on average, for the plans to budget ahead.

Entries are created at `plan` time (`track`) and updated by `record` only while they exist:
an engine may release a finished request before its last step's feedback, which must not
bring it back.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class RequestClock:
    """Decode seconds and tokens per live request, keyed by request id."""

    def __init__(self) -> None:
        self._elapsed: dict[str, float] = {}
        self._tokens: dict[str, int] = {}
        self._last_end: dict[str, float] = {}  # the caller's clock at its last step's end

    def __len__(self) -> int:
        return len(self._elapsed)

    def track(self, request_ids: Sequence[str]) -> None:
        """Start the clock of every request not seen yet (0 s, 0 tokens)."""
        for rid in request_ids:
            if rid not in self._elapsed:
                self._elapsed[rid] = 0.0
                self._tokens[rid] = 0

    def progress(self, request_ids: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """([B] decode seconds, [B] decode tokens) of the requests (0 for unknown ones)."""
        e, t = self._elapsed, self._tokens
        return (np.array([e.get(r, 0.0) for r in request_ids], dtype=np.float64),
                np.array([t.get(r, 0) for r in request_ids], dtype=np.float64))

    def slack(self, request_ids: Sequence[str], tpot_slo: np.ndarray) -> np.ndarray:
        """[B] seconds each request is ahead of its TPOT SLO (inf without an SLO)."""
        elapsed, tokens = self.progress(request_ids)
        slo = np.asarray(tpot_slo, dtype=np.float64)
        with np.errstate(invalid="ignore"):  # inf * 0 tokens
            out = slo * tokens - elapsed
        out[~np.isfinite(slo)] = np.inf
        return out

    def record(self, request_ids: Sequence[str], step_time: float, emitted: np.ndarray,
               end_time: float | None = None) -> None:
        """One decode step of `step_time` seconds, ending at `end_time` on the caller's clock
        (None: unknown), gave request i emitted[i] tokens. Request i's seconds grow by the
        time since its previous step's end (the module docstring), at least the step's."""
        e, t, last = self._elapsed, self._tokens, self._last_end
        for rid, n in zip(request_ids, np.asarray(emitted).tolist()):
            if rid in e:
                t[rid] += int(n)
                if end_time is None:
                    e[rid] += step_time
                    continue
                prev = last.get(rid)
                e[rid] += step_time if prev is None else max(step_time, end_time - prev)
                last[rid] = end_time

    def release(self, request_id: str) -> None:
        self._elapsed.pop(request_id, None)
        self._tokens.pop(request_id, None)
        self._last_end.pop(request_id, None)


STALL_EMA = 0.05  # weight of one step's stall in StepStalls.mean (~20 steps' memory)


class StepStalls:
    """The seconds a decode step brings beyond its own time, which every request continuing
    through it waits: end_t - end_(t-1) - step_time_t, the engine's work between two decode
    steps (other requests' prefills, scheduling). `mean` is its moving average over steps
    that continue a request of the step before (after an idle engine nobody waited); 0 until
    a caller tells end times (the simulator's steps run back to back: it stays ~0 there)."""

    def __init__(self, ema: float = STALL_EMA) -> None:
        self.ema = ema
        self.mean = 0.0
        self._end: float | None = None
        self._ids: frozenset[str] = frozenset()

    def record(self, request_ids: Sequence[str], step_time: float,
               end_time: float | None) -> None:
        if end_time is None:
            return
        ids = frozenset(request_ids)
        if self._end is not None and not ids.isdisjoint(self._ids):
            stall = max(0.0, end_time - self._end - step_time)
            self.mean += self.ema * (stall - self.mean)
        self._end, self._ids = end_time, ids
