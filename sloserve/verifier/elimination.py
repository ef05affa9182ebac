"""Confidence-prior verifier: draft token elimination (SpecServe Alg. 2).

After drafting, draft tokens are removed in ascending order of their chain probability
P_{r,j} while removing one raises E = sum_r l_r(k_r) / T_step, and regardless while the
plan breaks the SLO. Since P is non-increasing along a row, the lowest-P token of a row is
always its tail, so every request keeps a prefix of its draft (k_r <= drafted_r).

Cost: the draft forwards already ran, so removing a token only shortens the ragged verify
forward by one query token: T drops by exactly `token_time` (cost.target.b) and the expected
tokens by P_{r,j}. Removing it raises E iff P_{r,j} < token_time * E. Past the target's knee
(cost_model.py) only the verify tokens beyond q0 cost anything: once `paid_tokens` removals
have been made, a removal saves nothing and never raises E. One sort of all
candidate tokens plus prefix sums scores every removal count at once; the greedy stops at
the first removal that does not help, which is also the best prefix (E rises while tokens
below the threshold go, and the threshold falls once E does). Removing the step's last
verified token also saves `fixed`, the verify path's cost over plain decoding
(CostModel.verify_fixed): a jump the greedy cannot see, so verifying nothing is scored
apart and wins when its E is higher. With a `margin` the removals
the SLO does not force are made only if together they raise E by that fraction (the
preference for uniform plans, docs/design.md sec. 5). E leaves out `unscored_time`, the
seconds of the step's prefill chunks, which the SLO rule still counts.
"""

from __future__ import annotations

import numpy as np

from sloserve.estimator.step_time import StepTimer


def eliminate(
    P: np.ndarray,
    drafted: np.ndarray,
    *,
    tokens: float,
    step_time: float,
    token_time: float,
    slo: float,
    paid_tokens: float = float("inf"),
    fixed: float = 0.0,
) -> np.ndarray:
    """[B] int64 k_r: draft tokens each request keeps for verification.

    P: [B, s] chain probabilities of draft positions 1..s (non-increasing per row; entries
    past drafted[r] are ignored). drafted: [B] int. tokens: sum_r l_r(drafted_r), the expected
    tokens if everything is verified; step_time: T_step of that plan; token_time: seconds
    one verified draft token adds; slo: the binding TPOT SLO (inf for none); paid_tokens: how
    many of the verified draft tokens lie past the target's knee (inf: no knee); fixed:
    seconds verifying anything adds (CostModel.verify_fixed).
    """
    drafted = np.asarray(drafted, dtype=np.int64)
    if P.shape[1] == 0 or not drafted.any():
        return drafted.copy()
    padded = np.where(np.arange(P.shape[1]) < drafted[:, None], P, np.inf)  # [B, s]
    return eliminate_padded(
        padded, drafted, tokens=tokens, step_time=step_time, token_time=token_time, slo=slo,
        paid_tokens=paid_tokens, fixed=fixed,
    )


def eliminate_padded(
    P: np.ndarray,
    drafted: np.ndarray,
    *,
    tokens: float,
    step_time: float,
    token_time: float,
    slo: float,
    paid_tokens: float = float("inf"),
    n_drafted: int | None = None,
    unscored_time: float = 0.0,
    margin: float = 0.0,
    fixed: float = 0.0,
) -> np.ndarray:
    """`eliminate` for a P that is +inf exactly past each row's drafted tokens (the SpecServe
    plan keeps it that way), which saves building the candidate list. n_drafted:
    drafted.sum() when the caller has it. unscored_time: seconds of step_time left out of E
    (a step's prefill chunks); the SLO rule still sees all of step_time. margin: removals the
    SLO rule does not force are made only if together they raise E by this fraction
    (SpecServeOptions.uniform_margin). fixed: seconds step_time holds for verifying any
    draft token at all (CostModel.verify_fixed), saved only when every candidate goes."""
    B, s = P.shape
    n = int(drafted.sum()) if n_drafted is None else n_drafted  # candidates: finite entries
    keep = _eliminate(P, drafted, n, tokens, step_time, token_time, slo, paid_tokens,
                      unscored_time, margin)
    if fixed > 0.0 and n:
        # E of verifying nothing against E of what elimination kept: the first `paid_tokens`
        # removals save token_time each (as in _eliminate), the last one `fixed` too
        kept = np.arange(s) < keep[:, None]  # [B, s]
        p_all = float(P[P < np.inf].sum())
        e_none = _rate(tokens - p_all, step_time - fixed - token_time * min(float(n), paid_tokens),
                       unscored_time)
        removed = float(n - int(keep.sum()))
        e_keep = _rate(tokens - p_all + float(P[kept].sum()),
                       step_time - token_time * min(removed, paid_tokens), unscored_time)
        if removed < n and e_none > e_keep:
            return np.zeros_like(keep)
    return keep


def _rate(tokens: float, time: float, unscored_time: float) -> float:
    t = time - unscored_time
    return tokens / t if t > 0.0 else float("inf")


def _eliminate(P: np.ndarray, drafted: np.ndarray, n: int, tokens: float, step_time: float,
               token_time: float, slo: float, paid_tokens: float, unscored_time: float,
               margin: float) -> np.ndarray:
    """eliminate_padded without the verify path's fixed cost."""
    if step_time <= slo:  # nothing forced: if the lowest-P token stays, every token stays
        if paid_tokens <= 0.0:
            return drafted.copy()
        p_min = float(P.min())  # the padding is +inf
        if p_min * (step_time - unscored_time) >= token_time * tokens:
            return drafted.copy()
    B, s = P.shape
    f_order = P.flags.f_contiguous and not P.flags.c_contiguous  # e.g. a transposed view
    flat = P.ravel(order="F" if f_order else "C")  # a view when P is contiguous either way
    order = flat.argsort()[:n]  # flat indices, ascending P; a row loses its tail
    p_sorted = flat.take(order)  # [n]
    # state before removing candidate i: tokens_prev[i], time_prev[i]
    tokens_prev = (tokens + p_sorted) - np.add.accumulate(p_sorted)  # [n]
    removed = np.arange(n, dtype=np.float64)  # [n] removals made before candidate i
    if paid_tokens >= n:  # every removal saves token_time (no knee in reach)
        time_prev = step_time - token_time * removed  # [n]
        # P < token_time * E_prev
        remove = p_sorted * (time_prev - unscored_time) < token_time * tokens_prev
    else:
        saving = np.where(removed < paid_tokens, token_time, 0.0)  # [n] seconds removing i saves
        time_prev = step_time - token_time * np.minimum(removed, paid_tokens)  # [n]
        # P < saving * E_prev
        remove = p_sorted * (time_prev - unscored_time) < saving * tokens_prev
    if slo < float("inf"):
        remove |= time_prev > slo  # the SLO rule: remove regardless
    n_remove = int(remove.argmin()) if n else 0
    if n and remove[n_remove]:  # every candidate goes
        n_remove = n
    if margin and n_remove:
        # removals the SLO does not force happen only if they raise E by `margin`
        forced = int(np.count_nonzero(time_prev > slo)) if slo < float("inf") else 0
        if n_remove > forced:
            def e_after(i: int) -> float:
                if i == 0:
                    return tokens / (step_time - unscored_time)
                t = step_time - token_time * min(i, paid_tokens)
                return (tokens_prev[i - 1] - p_sorted[i - 1]) / (t - unscored_time)
            if e_after(n_remove) < e_after(forced) * (1.0 + margin):
                n_remove = forced
    if n_remove == 0:
        return drafted.copy()
    rows = order[:n_remove] % B if f_order else order[:n_remove] // s  # row of each removal
    return drafted - np.bincount(rows, minlength=B)


def eliminate_plan(timer: StepTimer, P: np.ndarray, drafted: np.ndarray, slo: float,
                   unscored_time: float = 0.0, margin: float = 0.0) -> np.ndarray:
    """`eliminate` for a plan whose token sum and step time are not tracked yet."""
    drafted = np.asarray(drafted, dtype=np.int64)
    if P.shape[1] == 0 or not drafted.any():
        return drafted.copy()
    valid = np.arange(P.shape[1]) < drafted[:, None]  # [B, s]
    tokens = float(timer.batch_size) + float(P[valid].sum())
    t = timer.plan(drafted, drafted)
    return eliminate_padded(
        np.where(valid, P, np.inf),
        drafted,
        tokens=tokens,
        step_time=t,
        token_time=timer.token_time,
        slo=slo,
        paid_tokens=timer.paid_verify(float(drafted.sum())),
        unscored_time=unscored_time,
        margin=margin,
        fixed=timer.verify_fixed,
    )
