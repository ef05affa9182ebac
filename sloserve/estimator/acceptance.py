"""Acceptance model (docs/design.md sec. 3).

Conditional acceptance p_{r,j} = g(c_{r,j}) from the draft confidence c through a calibration
map g learned online; chain probabilities P_{r,j} = prod_{m<=j} p_{r,m}; expected emitted
tokens l_r(k) = 1 + sum_{j=1..k} P_{r,j} (the bonus token included). Also the closed form of
SmartSpec / TurboSpec, l(a, k) = (1 - a^(k+1)) / (1 - a), with a moving-average acceptance.

Array convention: P is [B, s] with P[:, j - 1] = P_{r,j} for draft position j = 1..s and 0
past a request's drafted tokens; P_{r,0} = 1 is implicit.
"""

from __future__ import annotations

from collections import deque

import numpy as np

try:  # the compiled kernel behind np.interp: skips ~1 us of argument checks per call
    from numpy._core.multiarray import interp as _interp
except ImportError:  # numpy < 2
    try:
        from numpy.core.multiarray import interp as _interp  # type: ignore[no-redef]
    except ImportError:
        _interp = np.interp  # type: ignore[assignment]


def isotonic(values: list[float], weights: list[float]) -> list[float]:
    """Weighted least-squares non-decreasing fit (pool adjacent violators)."""
    means: list[float] = []
    sizes: list[float] = []
    counts: list[int] = []
    for v, w in zip(values, weights):
        means.append(v)
        sizes.append(w)
        counts.append(1)
        while len(means) > 1 and means[-2] > means[-1]:
            w2 = sizes[-2] + sizes[-1]
            means[-2] = (means[-2] * sizes[-2] + means[-1] * sizes[-1]) / w2
            sizes[-2] = w2
            counts[-2] += counts[-1]
            del means[-1], sizes[-1], counts[-1]
    out: list[float] = []
    for m, c in zip(means, counts):
        out.extend([m] * c)
    return out


class ConfidenceCalibrator:
    """Online monotone map g: draft confidence -> conditional acceptance probability.

    Confidences fall in n_bins equal bins over [0, 1]. Each bin has prior_weight
    pseudo-observations at its prior: its centre scaled by the pooled evidence of all bins
    (prior_map), so g starts as the identity (the paper's assumption), and learns from
    verify outcomes: every verified draft position up to and including the
    first rejection is one Bernoulli sample of "accepted given all earlier accepted" with its
    confidence. Positions after the first rejection (or never verified) say nothing about
    the conditional probability and are skipped. The per-bin rates are made non-decreasing
    by pool-adjacent-violators, and g interpolates linearly between bin centres.

    One instance per engine (model pair); counts are scaled down once they exceed max_count
    so the map keeps tracking a drifting workload. The map is refitted every `refit_every`
    updates (verify steps): it moves slowly, and a refit with pool-adjacent-violators costs
    tens of microseconds, a sizeable share of the controller's per-step time if done every
    step.
    """

    def __init__(
        self,
        n_bins: int = 16,
        prior_weight: float = 4.0,
        max_count: float = 2e5,
        refit_every: int = 16,
    ) -> None:
        self.n_bins = n_bins
        self.refit_every = refit_every  # updates between refits of the map
        self.centers = (np.arange(n_bins) + 0.5) / n_bins  # [n_bins]
        self.prior_weight = prior_weight
        self.max_count = max_count
        # [2, n_bins] sample counts per bin: row 0 rejected, row 1 accepted
        self.counts = np.zeros((2, n_bins))
        self._table = self.centers.copy()  # [n_bins] g at the bin centres
        self._dirty = False
        self._updates = 0

    @property
    def hits(self) -> np.ndarray:
        """[n_bins] accepted samples per bin."""
        return self.counts[1]

    @property
    def total(self) -> np.ndarray:
        """[n_bins] all samples per bin."""
        return self.counts[0] + self.counts[1]

    @property
    def online(self) -> bool:
        """Whether any verify outcome with confidences was counted (seeding is not)."""
        return self._updates > 0

    @property
    def pooled(self) -> float | None:
        """The accepted share of every sample counted (seeded ones included), None before
        any: the pair's mean conditional acceptance, whatever the confidence."""
        total = float(self.counts.sum())
        return float(self.hits.sum()) / total if total > 0.0 else None

    @property
    def top(self) -> float:
        """The map's highest value, g(1): the most any draft token is predicted to be
        accepted (g is non-decreasing)."""
        return float(self.table[-1])

    @property
    def table(self) -> np.ndarray:
        """[n_bins] the current map at the bin centres (refitted lazily)."""
        if self._dirty:
            self.refit()
        return self._table

    def __call__(self, conf: np.ndarray) -> np.ndarray:
        """g(conf), elementwise, for a float64 array; NaN stays NaN."""
        return _interp(conf, self.centers, self.table)

    def update(self, confidences: np.ndarray, verified: np.ndarray, accepted: np.ndarray) -> None:
        """Learn from one verify pass. confidences: [B, s]; verified, accepted: [B] int."""
        conf = np.asarray(confidences, dtype=np.float64)
        if conf.ndim != 2 or conf.shape[1] == 0:
            return
        acc = np.asarray(accepted)[:, None]  # [B, 1]
        seen = np.minimum(acc + 1, np.asarray(verified)[:, None])  # [B, 1] observed positions
        pos = np.arange(conf.shape[1])  # [s]
        mask = pos < seen  # [B, s]: accepted positions and the first rejection
        n = self.n_bins
        # bin of each sample, +n for accepted ones; fmin maps NaN (a broken caller) to the
        # top bin instead of an invalid index
        code = np.fmin(conf[mask] * n, n - 0.5)
        code += (pos < acc)[mask] * n
        self.counts += np.bincount(code.astype(np.intp), minlength=2 * n).reshape(2, n)
        self._updates += 1
        if self._updates % self.refit_every == 0:
            total = self.counts.sum()
            if total > self.max_count:
                self.counts *= self.max_count / total
            self._dirty = True

    def seed(self, counts: np.ndarray, max_samples: float = 400.0) -> None:
        """Start from an offline calibration of the same model pair ([2, n_bins] rejected /
        accepted counts, e.g. a profile's): added to the counts, scaled down to at most
        `max_samples` samples so the online outcomes take over within a few hundred."""
        counts = np.asarray(counts, dtype=np.float64)
        if counts.shape != self.counts.shape or np.any(counts < 0):
            raise ValueError(f"calibration counts must be non-negative {self.counts.shape}, "
                             f"got {counts.shape}")
        total = counts.sum()
        if total > max_samples:
            counts = counts * (max_samples / total)
        self.counts += counts
        self.refit()

    def prior_map(self) -> np.ndarray:
        """[n_bins] each bin's prior: the identity scaled down by the pooled evidence, by
        (accepted + k) / (the accepted the identity predicts for the samples + k) where that
        is below 1, k = prior_weight x 4 pseudo-samples. A bin with few samples of its own
        then starts where the draft's other confidences say, not at the identity: a draft
        whose confidences mean little (3 of the distilled draft's 4 layers silenced: 0.08
        accepted a drafting step at C = 1) kept verifying, bin by bin, tokens the target
        rejected (2026-12-02, BENCHMARKS.md). Only down: a draft that is accepted more often
        than its confidences say keeps the identity where it has no samples, as a
        calibrated one does (raised, the empty top bins said a chain of 7 would hold)."""
        k = 4.0 * self.prior_weight
        expected = float(self.total @ self.centers)
        if expected + k <= 0.0:
            return self.centers
        return self.centers * min((float(self.hits.sum()) + k) / (expected + k), 1.0)

    def refit(self) -> None:
        """Refit the map from the counts now (otherwise every `refit_every` updates)."""
        w = self.total + self.prior_weight  # [n_bins]
        rate = (self.hits + self.prior_weight * self.prior_map()) / w
        if np.all(np.diff(rate) >= 0.0):
            self._table = rate
        else:
            self._table = np.array(isotonic(rate.tolist(), w.tolist()))
        self._dirty = False


def chain_probs(p: np.ndarray) -> np.ndarray:
    """[B, s] chain probabilities P from conditional acceptances p [B, s] (NaN -> 0)."""
    return np.cumprod(np.fmax(p, 0.0), axis=1)  # fmax turns NaN into 0


def expected_tokens(P: np.ndarray, k: np.ndarray) -> np.ndarray:
    """[B] l_r(k_r) = 1 + sum_{j=1..k_r} P_{r,j}; P: [B, s], k: [B] int <= s."""
    k = np.asarray(k, dtype=np.int64)
    if P.shape[1] == 0:
        return np.ones(P.shape[0])
    cum = np.concatenate([np.zeros((P.shape[0], 1)), np.cumsum(P, axis=1)], axis=1)  # [B, s+1]
    return 1.0 + cum[np.arange(P.shape[0]), k]


def geometric_tokens(a: float | np.ndarray, k: np.ndarray | int) -> np.ndarray:
    """SmartSpec / TurboSpec l(a, k) = (1 - a^(k+1)) / (1 - a); k + 1 when a = 1."""
    if np.ndim(a) == 0:
        a = min(float(a), 1.0 - 1e-12)
    else:
        a = np.minimum(np.asarray(a, dtype=np.float64), 1.0 - 1e-12)
    k = np.asarray(k, dtype=np.float64)
    return (1.0 - a ** (k + 1.0)) / (1.0 - a)


def acceptance_samples(verified: np.ndarray, accepted: np.ndarray) -> tuple[int, int]:
    """(accepted tokens, observed positions) of one verify pass. A request that verified k
    tokens and accepted m observed m acceptances and, when m < k, one rejection; the ratio
    is the maximum-likelihood per-token acceptance of the geometric model behind l(a, k)."""
    verified = np.asarray(verified)
    accepted = np.asarray(accepted)
    hits = int(accepted.sum())
    return hits, hits + int((accepted < verified).sum())


class MovingAverageAcceptance:
    """Global per-token acceptance rate a, averaged over the last `window` verify steps
    (SmartSpec sec. 4.4 / TurboSpec sec. 4.1.3). Starts at `prior` until steps arrive."""

    def __init__(self, window: int = 32, prior: float = 0.7) -> None:
        self.prior = prior
        self._rates: deque[float] = deque(maxlen=window)
        self._sum = 0.0

    @property
    def value(self) -> float:
        return self._sum / len(self._rates) if self._rates else self.prior

    def update(self, verified: np.ndarray, accepted: np.ndarray) -> None:
        hits, seen = acceptance_samples(verified, accepted)
        if seen == 0:
            return
        if len(self._rates) == self._rates.maxlen:
            self._sum -= self._rates[0]
        rate = hits / seen
        self._rates.append(rate)
        self._sum += rate
