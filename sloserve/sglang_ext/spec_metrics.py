"""Prometheus counters of SPECSERVE's speculation inside SGLang (`--enable-metrics`).

SGLang's scheduler writes its metrics with prometheus_client in multiprocess mode (the
launcher sets PROMETHEUS_MULTIPROC_DIR before starting the scheduler) and its HTTP server
serves all processes' values at /metrics. Counters created here, in the scheduler process,
land in the same directory and appear beside SGLang's own `sglang:*` metrics. The names are
those of sloserve's built-in server (server/metrics.py), so dashboards work on both:

    sloserve_spec_proposed_tokens_total            draft tokens drafted (s_r summed)
    sloserve_spec_verified_tokens_total            draft tokens verified (k_r summed)
    sloserve_spec_accepted_tokens_total            draft tokens accepted
    sloserve_spec_{proposed,verified,accepted}_at_position_total{position="j"}
                                                   the same, by draft position j = 1..k_max
    sloserve_spec_draft_length_total{k="k"}        request-steps by verify length k_r
                                                   (0 = the request decoded plainly)

Free of SGLang imports; prometheus_client is imported on construction only (it must come
after PROMETHEUS_MULTIPROC_DIR is set, as in SGLang).
"""

from __future__ import annotations

from typing import Any

import numpy as np

PREFIX = "sloserve"


class SpecCounters:
    """The counters above; `record` adds one decode step's per-request outcome."""

    def __init__(self, k_max: int) -> None:
        from prometheus_client import Counter

        self.k_max = k_max
        doc = " (SPECSERVE in SGLang)"
        self.total: dict[str, Any] = {}
        self.at: dict[str, Any] = {}
        for name, what in (("proposed", "drafted"), ("verified", "verified by the target"),
                           ("accepted", "accepted")):
            self.total[name] = Counter(f"{PREFIX}_spec_{name}_tokens", f"Draft tokens {what}"
                                       + doc)
            self.at[name] = Counter(f"{PREFIX}_spec_{name}_at_position",
                                    f"Draft tokens {what}, by position (1 = first draft token)"
                                    + doc, labelnames=["position"])
        self.draft_length = Counter(f"{PREFIX}_spec_draft_length",
                                    "Request-steps by verify length k (0 = no speculation)"
                                    + doc, labelnames=["k"])
        for j in range(1, k_max + 1):  # every position listed from the start (zeros)
            for c in self.at.values():
                c.labels(position=str(j))
        for k in range(k_max + 1):
            self.draft_length.labels(k=str(k))

    def record(self, drafted: np.ndarray, verified: np.ndarray, accepted: np.ndarray) -> None:
        """One step. drafted, verified, accepted: [B] int, accepted <= verified <= drafted."""
        for name, n in (("proposed", drafted), ("verified", verified), ("accepted", accepted)):
            n = np.asarray(n, dtype=np.int64)
            self.total[name].inc(int(n.sum()))
            # position j counts the requests whose n_r reaches it
            per_pos = np.bincount(np.minimum(n, self.k_max), minlength=self.k_max + 1)
            reach = per_pos[::-1].cumsum()[::-1]  # [k_max + 1]: requests with n_r >= j
            for j in range(1, self.k_max + 1):
                if reach[j]:
                    self.at[name].labels(position=str(j)).inc(int(reach[j]))
        for k, c in enumerate(np.bincount(np.minimum(np.asarray(verified, dtype=np.int64),
                                                     self.k_max), minlength=self.k_max + 1)):
            if c:
                self.draft_length.labels(k=str(k)).inc(int(c))
