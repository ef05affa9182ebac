"""Find and load the cost profile matching the engine's model pair, device and dtype."""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path

import torch

from sloserve.estimator.cost_model import CostModel
from sloserve.estimator.profile_file import Profile, find_profile, model_key, read_profile

log = logging.getLogger(__name__)


@functools.lru_cache(maxsize=8)
def cpuinfo_field(name: str) -> str:
    """The first /proc/cpuinfo line's value for `name` ("model name", "flags", "vendor_id";
    empty where there is none). Read at run time: the machines this project runs on change
    from day to day, between CPU models and between instruction sets of one model."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(name):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def cpu_isa_tier() -> str:
    """The widest matrix instructions this CPU has, as a profile key tells machines apart:
    "amx" (AMX tiles), "avx512" (AVX-512 F), "avx2", or "" (none of them, or no
    /proc/cpuinfo). One model name covers several: the same "AMD EPYC" has come with and
    without AVX-512, and its float32 forwards differ by ~2x between them."""
    flags = set(cpuinfo_field("flags").split())
    for tier, flag in (("amx", "amx_tile"), ("avx512", "avx512f"), ("avx2", "avx2")):
        if flag in flags:
            return tier
    return ""


def device_key(device: str, isa: bool = True) -> str:
    """'cpu-<cpu model>-<isa tier>-<threads>t' or 'cuda-<gpu name>': profiles only transfer
    within one. isa=False: the key without the tier, as profiles were keyed before
    2026-12-04 (`device_keys` still finds those)."""
    if device.startswith("cuda"):
        return f"cuda-{torch.cuda.get_device_name(0)}"
    model = cpuinfo_field("model name") or "cpu"
    tier = cpu_isa_tier() if isa else ""
    return f"cpu-{model}-{tier + '-' if tier else ''}{torch.get_num_threads()}t"


def device_keys(device: str, key: Callable[[str, bool], str] | None = None) -> list[str]:
    """The keys a profile of this device is looked up by, best first: this instruction set's,
    then the untiered key of profiles measured before keys had one (measured on some
    instruction set of this CPU model; the online correction fits its scales). key(device,
    isa): a key built on device_key (default: device_key itself)."""
    make = key or device_key
    keys = [make(device, True)]
    legacy = make(device, False)
    return keys if legacy in keys else keys + [legacy]


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
    tk, dk, _, dtype = profile_keys(cfg, target_path, draft_path)
    return find_first(tk, dk, device_keys(cfg.device), dtype)


def find_first(target_key: str, draft_key: str, devices: list[str], dtype: str) -> Path | None:
    """The first profile found for the pair over device keys (best first) and directories."""
    for device in devices:
        for d in default_dirs():
            path = find_profile(d, target_key, draft_key, device, dtype)
            if path is not None:
                if device != devices[0]:
                    log.info("cost profile keyed without an instruction set (%s), not %s: "
                             "measured on this CPU model before keys had one", device,
                             devices[0])
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
