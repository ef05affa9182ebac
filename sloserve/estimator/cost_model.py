"""Forward-time cost model (docs/design.md sec. 2), with a roofline knee:

    T_fwd = a * N_ctx + b * max(0, N_q - q0) + c

q0 = 0 gives the linear model a * N_ctx + b * N_q + c. A forward over few query tokens is
bound by reading the weights, so its time hardly moves with N_q until the matmuls turn
compute-bound; q0 is that knee, in query tokens per forward (on this CPU the built-in
target is flat up to ~8 query rows, its draft up to ~16). The profiler fits q0 with a, b, c;
the GPU profiles from published figures keep q0 = 0.

This file is the contract between the profiler (which fits the coefficients), the estimator
(which scores plans with them) and the simulator (which replaces forwards with them).
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, replace
from typing import Protocol


@dataclass(frozen=True)
class ForwardCost:
    """Time of one forward pass of one model over a batch, in seconds."""

    a: float  # seconds per context (KV) token read by attention, summed over the batch
    b: float  # seconds per query token computed in the pass, beyond the first q0
    c: float  # fixed seconds per pass (weights load, launch and Python overheads)
    q0: float = 0.0  # query tokens a pass computes for the fixed cost alone (the knee)
    # seconds the first of a step's forwards pays on top (a drafter's per-step setup, not in
    # time(): draft_time adds it once for a step that drafts). SGLang's CPU draft: the draft
    # batch's metadata, the first round's extend over the catch-up and the chain's verify
    # input made ~3 ms (2-4.6 by batch size) on top of ~6 ms forwards (smollm2 pair, 2-core
    # EPYC, 2026-12-05); priced per forward instead, the online correction's draft scale
    # rose to ~1.5 and priced every later round half again too dear
    first: float = 0.0

    def time(self, n_ctx: float, n_q: float) -> float:
        return self.a * n_ctx + self.b * self.paid(n_q) + self.c

    def paid(self, n_q: float) -> float:
        """Query tokens of a pass that cost b each: max(0, n_q - q0)."""
        return max(0.0, n_q - self.q0)

    def scaled(self, s: float) -> ForwardCost:
        """Every time s times longer (same knee)."""
        return ForwardCost(self.a * s, self.b * s, self.c * s, self.q0, self.first * s)

    @staticmethod
    def free() -> ForwardCost:
        """A drafter with no forward pass (the n-gram drafter)."""
        return ForwardCost(0.0, 0.0, 0.0)


@dataclass(frozen=True)
class CostModel:
    """Costs of one speculative step: draft forwards + one ragged target verify forward."""

    target: ForwardCost
    draft: ForwardCost
    overhead: float = 0.0  # seconds per step outside the forwards (scheduling, sampling)
    # seconds a target forward that verifies any draft token pays over a plain decode
    # forward of the same tokens: the runtime's verify path (SGLang: an extend over a tree
    # mask and the verify bookkeeping, ~14 ms at batch 1 on the 2-core CPU, where its decode
    # forward is 60 ms) against its decode path. 0: one path for both (the built-in engine)
    verify_fixed: float = 0.0
    # the price of a verified draft token is target.b (or verify_token's) times this (the
    # online correction's own scale for verified tokens over its plain forward's,
    # estimator/online_cost.py)
    token_scale: float = 1.0
    # the price of a verified draft token by decode batch size, in target.b's units (scaled
    # with the target): ((batch, seconds a token), ...) ascending in batch, interpolated
    # linearly and held flat past both ends. A forward's matrix products cost far from
    # linearly in their rows on a CPU: on SGLang's CPU engine a verified token cost 4.9 ms
    # at batch 1 and 1.8-2.3 ms at 4-16 against one fitted b of 2.2 ms (2026-12-02); the
    # online correction's one scale for verified tokens, learnt where they are dear, then
    # priced them at twice their cost at batch 16 (and speculation off). The SGLang profiler
    # measures it per batch size (cli/sglang_profile.py); empty: target.b at every batch
    verify_token: tuple[tuple[float, float], ...] = ()
    # True: a stand-in from the models' shapes (rough_cost), no measurement of this machine;
    # the online correction may then move it by ROUGH_MAX_SCALE, not a profile's 2x
    rough: bool = False

    def without_draft(self) -> CostModel:
        """The same costs with a drafter that runs no forward (the n-gram drafter)."""
        return replace(self, draft=ForwardCost.free())

    def fit_features(self, context: float, queries: float, batch: int,
                     verified: float) -> tuple[float, float]:
        """A decode step's features for the online correction (online_cost.py, three
        features): (the target forward's profiled seconds at its context and `queries`
        tokens with no draft verified, the profiled seconds of its `verified` draft tokens
        past the target's knee at token_time(batch)). The SpecServe policy feeds its steps
        through this and price_replay replays a server's steps through it, so both fit the
        same features."""
        paid = max(0.0, verified - max(0.0, self.target.q0 - queries))
        return self.target.time(context, queries), self.token_time(batch) * paid

    def token_time(self, batch: float) -> float:
        """Seconds one more verified draft token adds to the target forward of a decode
        batch of this size (past the target's knee), token_scale included."""
        table = self.verify_token
        if not table:
            return self.target.b * self.token_scale
        i = bisect_right(table, (batch, float("inf")))
        if i == 0:
            return table[0][1] * self.token_scale
        if i == len(table):
            return table[-1][1] * self.token_scale
        (b0, s0), (b1, s1) = table[i - 1], table[i]
        return (s0 + (s1 - s0) * (batch - b0) / (b1 - b0)) * self.token_scale

    def scaled_target(self, s: float) -> tuple[ForwardCost, tuple[tuple[float, float], ...]]:
        """The target's forward cost and verify_token, every time s times longer."""
        return self.target.scaled(s), tuple((b, t * s) for b, t in self.verify_token)


class ModelShape(Protocol):
    """What rough_cost reads of a model's config (runtime.models.config.ModelConfig)."""

    # read-only: a frozen dataclass's fields satisfy it
    @property
    def num_layers(self) -> int: ...
    @property
    def hidden_size(self) -> int: ...
    @property
    def num_heads(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def intermediate_size(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...


def rough_cost(target_cfg: ModelShape, draft_cfg: ModelShape | None) -> CostModel:
    """A stand-in cost model from parameter counts, used until a profile exists (CPU-ish)."""

    def fc(cfg: ModelShape) -> ForwardCost:
        params = cfg.num_layers * (
            cfg.hidden_size * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
            + cfg.num_heads * cfg.head_dim * cfg.hidden_size
            + 3 * cfg.hidden_size * cfg.intermediate_size
        ) + 2 * cfg.vocab_size * cfg.hidden_size
        return ForwardCost(a=2e-9 * cfg.num_layers, b=2 * params / 100e9, c=4 * params / 40e9 + 1e-4 * cfg.num_layers)

    return CostModel(fc(target_cfg), fc(draft_cfg) if draft_cfg else ForwardCost.free(), 5e-4,
                     rough=True)
