"""Find and load the cost profile matching the engine's model pair, device and dtype."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import torch

from sloserve.estimator.cost_model import CostModel
from sloserve.estimator.profile_file import Profile, find_profile, model_key, read_profile

log = logging.getLogger(__name__)


def device_key(device: str) -> str:
    """'cpu-<cpu model>-<threads>t' or 'cuda-<gpu name>': profiles only transfer within one."""
    if device.startswith("cuda"):
        return f"cuda-{torch.cuda.get_device_name(0)}"
    model = "cpu"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"cpu-{model}-{torch.get_num_threads()}t"


def fingerprint(model_dir: str) -> str:
    """Hash of config.json and the safetensors headers (shapes, names): the architecture the
    cost depends on, not the weight values, so a rebuilt identical pair keeps its profile."""
    h = hashlib.sha256()
    d = Path(model_dir)
    h.update((d / "config.json").read_bytes())
    for f in sorted(d.glob("*.safetensors")):
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
        header.pop("__metadata__", None)
        h.update(json.dumps(header, sort_keys=True).encode())
    return h.hexdigest()[:16]


def default_dirs() -> list[Path]:
    """Where profiles are looked up: the repository's configs/, then the user cache."""
    repo = Path(__file__).resolve().parents[2] / "configs"
    cache = Path(os.environ.get("SLOSERVE_CACHE", Path.home() / ".cache" / "sloserve"))
    return [repo, cache]



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
