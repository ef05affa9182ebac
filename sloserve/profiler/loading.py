"""Find and load the cost profile matching the engine's model pair, device and dtype."""

from __future__ import annotations

import logging

from sloserve.estimator.cost_model import CostModel
from sloserve.profiler.measure import default_dirs, device_key, fingerprint
from sloserve.profiler.profile_file import Profile, find_profile, model_key, read_profile

log = logging.getLogger(__name__)


def profile_keys(cfg, target_path: str, draft_path: str | None) -> tuple[str, str, str, str]:
    tk = model_key(target_path, fingerprint(target_path))
    dk = model_key(draft_path, fingerprint(draft_path)) if draft_path else "ngram"
    return tk, dk, device_key(cfg.device), cfg.dtype


def find_matching(cfg, target_path: str, draft_path: str | None):
    keys = profile_keys(cfg, target_path, draft_path)
    for d in default_dirs():
        path = find_profile(d, *keys)
        if path is not None:
            return path
    return None


def load_profile(cfg, target_path: str, draft_path: str | None) -> Profile | None:
    """The profile named by cfg.profile_path, else the one matching this model pair, device
    and dtype in configs/profiles or the user cache; None when there is none."""
    path = cfg.profile_path or find_matching(cfg, target_path, draft_path)
    if path is None:
        return None
    log.info("cost profile: %s", path)
    return read_profile(path)


def load_cost_model(cfg, target_path: str, draft_path: str | None) -> CostModel | None:
    """The cost model of `load_profile`, or None."""
    profile = load_profile(cfg, target_path, draft_path)
    return profile.cost_model() if profile is not None else None
