"""Profile files: the fitted cost model of one (target, draft, device, dtype) combination.

Files live under <configs>/profiles/ and are named

    <target_key>__<draft_key>__<device>__<dtype>.json

with every part slugged to [a-z0-9._-]. A model key is `model_key(name, fingerprint)`: the
model's directory or hub name plus a short fingerprint of its weights/config, so a retrained
model with the same name gets a new profile. The n-gram drafter uses the key "ngram".

Schema (version 1):

    {"schema": "sloserve.profile", "version": 1,
     "sloserve_version": "0.1.0", "created": "2025-01-01T00:00:00+00:00",
     "device": "cpu", "dtype": "float32", "mode": "quick" | "full",
     "target": {"name": ..., "fingerprint": ..., "key": ...,
                "cost": {"a": s/ctx token, "b": s/query token past q0, "c": s,
                         "q0": query tokens per forward inside the fixed cost (0 if absent),
                         "first": s the first forward of a step pays on top (0 if absent)},
                "fit": {"r2": ..., "mape": ..., "max_ape": ..., "n_samples": ...}},
     "draft": {same as target},
     "overhead": seconds per step outside the forwards,
     "verify_fixed": seconds a target forward verifying draft tokens pays over a plain
                     decode forward (its verify path; optional, 0 if absent),
     "verify_token": [[batch, seconds], ...] (optional): the price of a verified draft
                     token by decode batch size (CostModel.verify_token),
     "calibration": [[rejected per bin], [accepted per bin]] (optional): draft confidence ->
                    conditional acceptance outcomes of the pair, 16 equal confidence bins,
     "grid": {"batch_sizes": [...], "context_lens": [...], "query_lens": [...]}}
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from sloserve import __version__
from sloserve.estimator.cost_model import CostModel, ForwardCost


@dataclass(frozen=True)
class FitStats:
    """Quality of a fit on its own samples."""

    r2: float  # coefficient of determination on seconds
    mape: float  # mean absolute percentage error as a fraction (0.02 = 2 %)
    max_ape: float  # worst absolute percentage error as a fraction
    n_samples: int


SCHEMA = "sloserve.profile"
VERSION = 1
PROFILES_DIR = "profiles"


def slug(text: str) -> str:
    """Lower-case, with runs of characters outside [a-z0-9._-] replaced by '-'."""
    return re.sub(r"[^a-z0-9._-]+", "-", text.lower()).strip("-") or "x"


def model_key(name: str, fingerprint: str) -> str:
    """Key of a model in profile file names: last path component of `name` + fingerprint."""
    base = Path(name.rstrip("/")).name or name
    return slug(f"{base}-{fingerprint[:12]}") if fingerprint else slug(base)


@dataclass(frozen=True)
class ModelProfile:
    name: str
    fingerprint: str
    cost: ForwardCost
    fit: FitStats | None = None

    @property
    def key(self) -> str:
        return model_key(self.name, self.fingerprint)


@dataclass(frozen=True)
class Profile:
    target: ModelProfile
    draft: ModelProfile
    device: str
    dtype: str
    overhead: float = 0.0
    verify_fixed: float = 0.0  # CostModel.verify_fixed
    grid: dict[str, list[int]] = field(default_factory=dict)
    mode: str = "full"
    calibration: tuple[tuple[float, ...], ...] | None = None  # [2, n_bins] counts
    verify_token: tuple[tuple[float, float], ...] = ()  # CostModel.verify_token
    sloserve_version: str = __version__
    created: str = field(
        default_factory=lambda: datetime.now(timezone.utc).isoformat(timespec="seconds")
    )

    def cost_model(self) -> CostModel:
        return CostModel(target=self.target.cost, draft=self.draft.cost, overhead=self.overhead,
                         verify_fixed=self.verify_fixed, verify_token=self.verify_token)


def profile_filename(target_key: str, draft_key: str, device: str, dtype: str) -> str:
    return "__".join(slug(p) for p in (target_key, draft_key, device, dtype)) + ".json"


def profile_path(configs_dir: str | Path, profile: Profile) -> Path:
    """Where `profile` belongs under configs_dir."""
    name = profile_filename(profile.target.key, profile.draft.key, profile.device, profile.dtype)
    return Path(configs_dir) / PROFILES_DIR / name


def _model_json(m: ModelProfile) -> dict:
    return {
        "name": m.name,
        "fingerprint": m.fingerprint,
        "key": m.key,
        # (`first` only where measured: files stay as they were for the costs without it)
        "cost": {k: v for k, v in asdict(m.cost).items() if k != "first" or v},
        "fit": asdict(m.fit) if m.fit is not None else None,
    }


def to_json(profile: Profile) -> dict:
    return {
        "schema": SCHEMA,
        "version": VERSION,
        "sloserve_version": profile.sloserve_version,
        "created": profile.created,
        "device": profile.device,
        "dtype": profile.dtype,
        "mode": profile.mode,
        "target": _model_json(profile.target),
        "draft": _model_json(profile.draft),
        "overhead": profile.overhead,
        **({"verify_fixed": profile.verify_fixed} if profile.verify_fixed else {}),
        **({"verify_token": [list(p) for p in profile.verify_token]}
           if profile.verify_token else {}),
        "grid": profile.grid,
        **({"calibration": [list(row) for row in profile.calibration]}
           if profile.calibration is not None else {}),
    }


def _model_from(d: dict) -> ModelProfile:
    fit = FitStats(**d["fit"]) if d.get("fit") else None
    return ModelProfile(d["name"], d["fingerprint"], ForwardCost(**d["cost"]), fit)


def from_json(d: dict) -> Profile:
    if d.get("schema") != SCHEMA or d.get("version") != VERSION:
        raise ValueError(f"not a {SCHEMA} v{VERSION} file: {d.get('schema')} v{d.get('version')}")
    try:
        return Profile(
            target=_model_from(d["target"]),
            draft=_model_from(d["draft"]),
            device=d["device"],
            dtype=d["dtype"],
            overhead=float(d.get("overhead", 0.0)),
            verify_fixed=float(d.get("verify_fixed", 0.0)),
            verify_token=_verify_token(d.get("verify_token", ())),
            grid=dict(d.get("grid", {})),
            mode=d.get("mode", "full"),
            calibration=(tuple(tuple(float(x) for x in row) for row in d["calibration"])
                         if d.get("calibration") else None),
            sloserve_version=d.get("sloserve_version", "unknown"),
            created=d.get("created", ""),
        )
    except (KeyError, TypeError) as err:
        raise ValueError(f"malformed profile file: {err!r}") from err


def _verify_token(rows: list) -> tuple[tuple[float, float], ...]:
    """verify_token's [[batch, seconds], ...] checked: ascending distinct batches >= 1,
    seconds >= 0 (ValueError otherwise)."""
    table = tuple((float(b), float(s)) for b, s in rows)
    if any(b < 1.0 or s < 0.0 for b, s in table) or any(
            b1 <= b0 for (b0, _), (b1, _) in zip(table, table[1:])):
        raise ValueError(f"malformed verify_token table: {rows!r}")
    return table


def write_profile(profile: Profile, path: str | Path) -> Path:
    """Write atomically (temp file + rename); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(to_json(profile), indent=2) + "\n")
    tmp.replace(path)
    return path


def read_profile(path: str | Path) -> Profile:
    return from_json(json.loads(Path(path).read_text()))


def find_profile(
    configs_dir: str | Path, target_key: str, draft_key: str, device: str, dtype: str
) -> Path | None:
    """The profile file for this combination under configs_dir/profiles, or None if there
    is none (or the file there belongs to another combination after slugging)."""
    path = Path(configs_dir) / PROFILES_DIR / profile_filename(target_key, draft_key, device, dtype)
    if not path.is_file():
        return None
    p = read_profile(path)
    same = (
        slug(p.target.key) == slug(target_key)
        and slug(p.draft.key) == slug(draft_key)
        and slug(p.device) == slug(device)
        and slug(p.dtype) == slug(dtype)
    )
    return path if same else None
