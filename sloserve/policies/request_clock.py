"""Each live request's decode progress as a policy sees it: seconds spent in decode steps and
tokens those steps emitted, learned from the step feedback (`VerifyOutcome`).

A request's TPOT (docs/design.md sec. 11) is (E2E - TTFT) / (output tokens - 1): the time of
its decode steps over the tokens they emitted (its first token comes from its prefill). So
after `elapsed` seconds and `tokens` tokens of decoding, a request with TPOT SLO s is
`slack = s * tokens - elapsed` seconds ahead of its SLO (negative: behind). The SLO-customized
policies (specserve-slo, adaserve) size each request's speculation from it.

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

    def record(self, request_ids: Sequence[str], step_time: float, emitted: np.ndarray) -> None:
        """One decode step of `step_time` seconds gave request i emitted[i] tokens."""
        e, t = self._elapsed, self._tokens
        for rid, n in zip(request_ids, np.asarray(emitted).tolist()):
            if rid in e:
                e[rid] += step_time
                t[rid] += int(n)

    def release(self, request_id: str) -> None:
        self._elapsed.pop(request_id, None)
        self._tokens.pop(request_id, None)
