"""The simulator's acceptance process: draft confidences and verify outcomes without models.

Model (greedy verification; docs/design.md sec. 3). Under greedy decoding the draft model's
proposal for output position q, given a correct prefix, is fixed; so is whether the target
agrees. The simulator therefore draws, once per request, a sequence over output positions:

    mu_r   ~ Beta(m * K_req, (1 - m) * K_req)         per-request mean confidence (m: the
                                                      request's category mean)
    c_q    ~ Beta(mu_r * K_tok, (1 - mu_r) * K_tok)   draft confidence of the token at q
    ok_q   ~ Bernoulli(g(c_q))                        the target accepts it (given the prefix)

g is the calibration map (confidence -> conditional acceptance), piecewise linear through
measured (mean confidence, acceptance) knots. A draft token at output position q, proposed
at draft position j of a step, carries confidence c_q; verifying k tokens starting at
position p accepts the leading run of ok_p, ok_{p+1}, ... capped at k, so draft position j
is accepted with probability g(c_{p+j-1}) given positions before it were accepted, exactly
the chain of section 3. Conditional acceptance does not depend on the draft position (the
built-in pair measures ~0.72-0.82 at positions 1-4). The simulator draws each request's
sequence on arrival from one seeded generator, so every policy replays the same per-token
difficulty (common random numbers).

Alternative ("pairs"): (confidence, accepted) pairs logged from real verify outcomes, drawn
i.i.d. with replacement per output position (no per-request correlation).

Limitation: a Beta is smoother than the measured histogram; fitted by moments to the bins
below it puts ~33% of the tokens in [0.2, 0.4) where the pair has 42%, and 28% in [0.4, 0.6)
(21% measured); the mean confidence and E[g(c)] (0.744 vs 0.739 pooled) match.

Defaults are fitted to the built-in pair's measurement (`python -m sloserve.bench.
builtin_pair`, out/bench_builtin_pair.json): greedy acceptance 0.73 at position 1; bins
[0,.2) .52, [.2,.4) .69, [.4,.6) .85, [.6,.8) .98, [.8,1] 1.0 holding 20/42/21/12/5 % of
the verified draft tokens.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

SCHEMA = "sloserve.sim.acceptance"

# out/bench_builtin_pair.json "calibration" (2026-11-21, this repo's CPU machine)
BUILTIN_PAIR_BINS: tuple[dict, ...] = (
    {"n": 371, "acceptance": 0.520, "mean_confidence": 0.151},
    {"n": 782, "acceptance": 0.687, "mean_confidence": 0.294},
    {"n": 402, "acceptance": 0.848, "mean_confidence": 0.489},
    {"n": 226, "acceptance": 0.978, "mean_confidence": 0.701},
    {"n": 90, "acceptance": 1.000, "mean_confidence": 0.879},
)
REQUEST_VARIANCE_SHARE = 0.5  # share of the confidence variance that is between requests
BIN_WIDTH = 0.2  # the bench's bins; within-bin variance ~ width^2 / 12


@dataclass(frozen=True)
class Calibration:
    """g(c): piecewise linear through the knots, flat beyond the outer ones."""

    confidence: tuple[float, ...]  # increasing
    acceptance: tuple[float, ...]  # in [0, 1]

    def __post_init__(self) -> None:
        if len(self.confidence) != len(self.acceptance) or not self.confidence:
            raise ValueError("calibration needs equally many (>= 1) confidence/acceptance knots")
        if any(b <= a for a, b in zip(self.confidence, self.confidence[1:])):
            raise ValueError("calibration confidences must increase")
        if any(not 0.0 <= p <= 1.0 for p in self.acceptance):
            raise ValueError("calibration acceptances must lie in [0, 1]")

    def __call__(self, c: np.ndarray) -> np.ndarray:
        return np.interp(c, self.confidence, self.acceptance)


def calibration_counts(cal: Calibration, n_bins: int = 16, per_bin: float = 25.0) -> np.ndarray:
    """[2, n_bins] rejected / accepted pseudo-counts of g at the calibrator's bin centres: how
    a simulated policy starts from this pair's calibration, as the engine starts from its
    profile's (ConfidenceCalibrator.seed)."""
    g = cal((np.arange(n_bins) + 0.5) / n_bins)
    return np.stack([(1.0 - g) * per_bin, g * per_bin])


@dataclass(frozen=True)
class ConfidenceDist:
    """Beta-distributed confidences with a Beta-distributed per-request mean."""

    mean: float  # m: mean confidence over requests
    request_concentration: float  # K_req: larger = requests more alike
    token_concentration: float  # K_tok: larger = tokens of one request more alike

    def __post_init__(self) -> None:
        if not 0.0 < self.mean < 1.0:
            raise ValueError(f"confidence mean must be in (0, 1), got {self.mean}")
        if self.request_concentration <= 0 or self.token_concentration <= 0:
            raise ValueError("concentrations must be > 0")


@dataclass(frozen=True)
class RequestDraws:
    """One request's draws over output positions 0..n-1 (position 0, the prefill token, is
    never drafted). run[q] = number of consecutive accepted positions starting at q."""

    conf: list[float]  # [n]
    run: list[int]  # [n]


@dataclass(frozen=True)
class AcceptanceModel:
    """The stochastic acceptance process (module docstring); `draw` is its only sampler."""

    calibration: Calibration
    default: ConfidenceDist
    categories: Mapping[str, ConfidenceDist] = field(default_factory=dict)
    pairs: tuple[tuple[float, bool], ...] = ()  # logged outcomes: use them instead of Beta
    _table: np.ndarray | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.pairs:  # [P, 2] confidence, accepted
            object.__setattr__(self, "_table", np.asarray(self.pairs, dtype=np.float64))

    def dist(self, category: str | None) -> ConfidenceDist:
        return self.categories.get(category, self.default) if category else self.default

    def draw(self, rng: np.random.Generator, n: int, category: str | None = None) -> RequestDraws:
        """Draws for output positions 0..n-1 of one request."""
        if self._table is not None:
            idx = rng.integers(0, len(self._table), size=n)
            conf, ok = self._table[idx, 0], self._table[idx, 1] > 0.5
        else:
            d = self.dist(category)
            mu = rng.beta(d.mean * d.request_concentration, (1 - d.mean) * d.request_concentration)
            mu = min(max(mu, 1e-4), 1 - 1e-4)
            conf = rng.beta(mu * d.token_concentration, (1 - mu) * d.token_concentration, size=n)
            ok = rng.random(n) < self.calibration(conf)
        return RequestDraws(conf.tolist(), run_lengths(ok).tolist())

    def expected_acceptance(self, category: str | None = None, samples: int = 200_000,
                            seed: int = 0) -> float:
        """E[g(c)]: the conditional acceptance rate at any draft position (Monte Carlo)."""
        rng = np.random.default_rng(seed)
        if self.pairs:
            return float(np.mean([a for _, a in self.pairs]))
        d = self.dist(category)
        mu = rng.beta(d.mean * d.request_concentration, (1 - d.mean) * d.request_concentration,
                      size=samples)
        mu = np.clip(mu, 1e-4, 1 - 1e-4)
        conf = rng.beta(mu * d.token_concentration, (1 - mu) * d.token_concentration)
        return float(self.calibration(conf).mean())


def run_lengths(ok: np.ndarray) -> np.ndarray:
    """[n] bool -> [n] int: consecutive True values starting at each position."""
    n = len(ok)
    falses = np.append(np.flatnonzero(~ok), n)  # positions of rejections, then the end
    pos = np.arange(n)
    return falses[np.searchsorted(falses, pos)] - pos


def fit_from_bins(bins: Sequence[Mapping], request_share: float = REQUEST_VARIANCE_SHARE,
                  bin_width: float = BIN_WIDTH) -> AcceptanceModel:
    """Fit g and the Beta confidence process to binned calibration measurements: bins with
    n (tokens), acceptance and mean_confidence, as `sloserve.bench.builtin_pair` writes.
    The Beta moments match the binned mean and variance (within-bin variance added as
    bin_width^2 / 12); `request_share` of the variance is put between requests."""
    used = [b for b in bins if b.get("n") and b.get("acceptance") is not None
            and b.get("mean_confidence") is not None]
    if not used:
        raise ValueError("no calibration bins with tokens in them")
    n = np.array([float(b["n"]) for b in used])
    mc = np.array([float(b["mean_confidence"]) for b in used])
    acc = np.array([float(b["acceptance"]) for b in used])
    order = np.argsort(mc)
    g = Calibration(tuple(mc[order].tolist()), tuple(np.clip(acc[order], 0, 1).tolist()))
    w = n / n.sum()
    m = float(w @ mc)
    var = float(w @ (mc - m) ** 2) + bin_width**2 / 12.0
    var = min(var, 0.9 * m * (1 - m))  # a Beta needs var < m (1 - m)
    return AcceptanceModel(g, beta_dist(m, var, request_share))


def beta_dist(mean: float, var: float, request_share: float) -> ConfidenceDist:
    """ConfidenceDist with total variance `var`, `request_share` of it between requests."""
    if not 0.0 < request_share < 1.0:
        raise ValueError(f"request variance share must be in (0, 1), got {request_share}")
    total = mean * (1 - mean)
    var_req = request_share * var
    k_req = total / var_req - 1.0
    k_tok = (total - var_req) / ((1.0 - request_share) * var) - 1.0
    return ConfidenceDist(mean, k_req, k_tok)


def builtin_pair_model() -> AcceptanceModel:
    """The default: fitted to the built-in pair's calibration bins (module docstring)."""
    return fit_from_bins(BUILTIN_PAIR_BINS)


def with_categories(model: AcceptanceModel, means: Mapping[str, float]) -> AcceptanceModel:
    """Per-category mean confidences; concentrations stay the default's."""
    d = model.default
    cats = {k: ConfidenceDist(float(v), d.request_concentration, d.token_concentration)
            for k, v in means.items()}
    return AcceptanceModel(model.calibration, d, {**model.categories, **cats}, model.pairs)


def load_acceptance(path: str | Path) -> AcceptanceModel:
    """Read an acceptance file. Accepted layouts:

    - the bench JSON (`sloserve.bench.builtin_pair`): {"calibration": [bins...]};
    - {"schema": "sloserve.sim.acceptance", "calibration": {"confidence": [...],
      "acceptance": [...]}, "confidence": {"mean", "request_concentration",
      "token_concentration"}, "categories": {name: mean confidence}};
    - {"schema": ..., "pairs": [[confidence, accepted], ...]} logged verify outcomes
      (positions up to and including the first rejection of each verify);
    - either of the last two with "bins" instead of an explicit process: fitted like the
      bench JSON.
    """
    d = json.loads(Path(path).read_text())
    if isinstance(d.get("calibration"), list):
        model = fit_from_bins(d["calibration"])
    elif "pairs" in d:
        model = from_pairs([(float(c), bool(a)) for c, a in d["pairs"]])
    elif "bins" in d:
        model = fit_from_bins(d["bins"], float(d.get("request_share", REQUEST_VARIANCE_SHARE)))
    elif isinstance(d.get("calibration"), dict) and isinstance(d.get("confidence"), dict):
        c = d["calibration"]
        model = AcceptanceModel(
            Calibration(tuple(c["confidence"]), tuple(c["acceptance"])),
            ConfidenceDist(**d["confidence"]),
        )
    else:
        raise ValueError(f"{path}: not an acceptance file (see sloserve.sim.acceptance)")
    if d.get("categories"):
        model = with_categories(model, d["categories"])
    return model


def from_pairs(pairs: Sequence[tuple[float, bool]], n_bins: int = 5) -> AcceptanceModel:
    """Replay logged (confidence, accepted) outcomes; g is binned from them (for reference
    and for `expected_acceptance`; drawing uses the pairs themselves)."""
    if not pairs:
        raise ValueError("no logged outcomes")
    c = np.array([p[0] for p in pairs])
    a = np.array([p[1] for p in pairs], dtype=np.float64)
    edges = np.linspace(0, 1, n_bins + 1)
    edges[-1] += 1e-9
    bins = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        m = (c >= lo) & (c < hi)
        if m.any():
            bins.append({"n": int(m.sum()), "acceptance": float(a[m].mean()),
                         "mean_confidence": float(c[m].mean())})
    fitted = fit_from_bins(bins, bin_width=1.0 / n_bins)
    return AcceptanceModel(fitted.calibration, fitted.default, {}, tuple(
        (float(x), bool(y)) for x, y in zip(c, a > 0.5)))
