"""Where a new profile goes: the profile the engine loads (configs/profiles/<key>.json) is
replaced only when asked (--replace) and only by a fit that is not worse; otherwise the new
one is written next to it as <key>.new.json, which the engine does not load.

"Worse" compares R^2 of the forward-cost fits, model by model (target, draft): the new
profile replaces the existing one only if no model's R^2 fell.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from sloserve.estimator.profile_file import Profile, read_profile

NEW_SUFFIX = ".new.json"


@dataclass(frozen=True)
class Placement:
    path: Path  # where to write the new profile
    replaces: bool  # path is the profile the engine loads
    refused: bool  # --replace was asked for and refused: the new fit is worse
    message: str


def side_path(canonical: Path) -> Path:
    """<key>.new.json next to <key>.json."""
    return canonical.with_name(canonical.name.removesuffix(".json") + NEW_SUFFIX)


def r2_pairs(new: Profile, old: Profile) -> list[tuple[str, float, float]]:
    """(model, new R^2, existing R^2) for each model fitted in both profiles."""
    out = []
    for name in ("target", "draft"):
        n, o = getattr(new, name).fit, getattr(old, name).fit
        if n is not None and o is not None:
            out.append((name, n.r2, o.r2))
    return out


def _describe(pairs: list[tuple[str, float, float]]) -> str:
    return ", ".join(f"{m} R^2 {n:.4f} new vs {o:.4f} existing" for m, n, o in pairs) or \
        "no fits to compare"


def place(new: Profile, canonical: Path, replace: bool) -> Placement:
    """Decide where `new` goes, given the path of the profile the engine would load."""
    canonical = Path(canonical)
    side = side_path(canonical)
    if not canonical.exists():
        return Placement(canonical, True, False, f"no profile at {canonical} yet")
    try:
        old = read_profile(canonical)
    except (OSError, ValueError) as e:  # JSONDecodeError is a ValueError
        if replace:
            return Placement(canonical, True, False,
                             f"replacing {canonical}, which cannot be read ({e})")
        return Placement(side, False, False,
                         f"{canonical} exists (unreadable: {e}); --replace overwrites it")
    pairs = r2_pairs(new, old)
    if not replace:
        return Placement(side, False, False,
                         f"{canonical} exists ({_describe(pairs)}); the new profile goes next "
                         "to it, and the engine keeps loading the existing one: --replace "
                         "replaces it")
    worse = [p for p in pairs if p[1] < p[2]]
    if worse:
        return Placement(side, False, True,
                         f"not replacing {canonical}: the new fit is worse ({_describe(worse)})")
    return Placement(canonical, True, False, f"replacing {canonical} ({_describe(pairs)})")
