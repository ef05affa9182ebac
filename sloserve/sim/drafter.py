"""The simulator's draft source (sloserve.runtime.drafter.rounds.DraftSource) without a model:
`draft_rounds` calls it exactly as it calls the engine's draft model.

Each call is one draft forward over the requests still drafting. It proposes the dummy token
0 with the confidence the acceptance process drew for that output position, advances
`req.draft_kv_len` as the model drafter's segments would (first forward of a step: catch up
on every token the draft cache has not seen; later forwards: the previous draft token), and
adds the forward's cost-model time to `self.time`:

    T_fwd(draft; N_ctx = sum_r (draft_kv_len_r + q_r), N_q = sum_r q_r)

with q_r the query tokens of request r in this forward (N_ctx counts the KV tokens
attended, the query tokens included, as the profiler measures it).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from sloserve.estimator.cost_model import ForwardCost
from sloserve.runtime.drafter.rounds import DraftRound
from sloserve.runtime.request import Request

DUMMY_TOKEN = 0


class SimDrafter:
    """Stochastic stand-in for the engine's ModelDrafter / NgramDrafter."""

    def __init__(self, cost: ForwardCost, conf: Mapping[str, list[float]], kind: str = "model"):
        if kind not in ("model", "ngram"):
            raise ValueError(f"drafter kind must be model or ngram, got {kind!r}")
        self.cost = cost
        self.conf = conf  # rid -> draft confidence per output position (owned by the runner)
        self._kind = kind
        self.time = 0.0  # simulated seconds of draft forwards since the last reset
        self.forwards = 0

    @property
    def kind(self) -> str:
        return self._kind

    def release(self, rid: str) -> None:
        """Nothing to drop: the runner owns the draws."""

    def step(self, reqs: list[Request], drafts: np.ndarray) -> DraftRound:
        """One draft token per request; drafts: [n, j] this step's drafts so far."""
        conf = self.conf
        j = drafts.shape[1]
        # the proposal is for output position n_out + j (the pending last output token is at
        # position n_out - 1)
        confs = [conf[r.rid][len(r.output_ids) + j] for r in reqs]
        tokens = np.full(len(reqs), DUMMY_TOKEN, dtype=np.int64)
        if self._kind != "model":  # n-gram lookups: no forward, no draft KV
            return DraftRound(tokens, confs)
        n_ctx = 0
        if j:  # feed each request's previous draft token
            n_q = len(reqs)
            for req in reqs:
                kv = req.draft_kv_len + 1
                req.draft_kv_len = kv
                n_ctx += kv  # attended KV tokens: the cached ones plus this forward's query
        else:  # first forward of the step: catch up on every token not yet seen
            n_q = 0
            for req in reqs:
                kv = len(req.prompt_ids) + len(req.output_ids)
                n_q += kv - req.draft_kv_len
                req.draft_kv_len = kv
                n_ctx += kv
        self.time += self.cost.time(n_ctx, n_q)
        self.forwards += 1
        return DraftRound(tokens, confs)
