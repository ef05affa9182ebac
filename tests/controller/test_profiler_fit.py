"""Profiler fit and profile files."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from sloserve.estimator import profile_lookup
from sloserve.estimator.cost_model import ForwardCost
from sloserve.estimator.profile_file import (
    ModelProfile,
    Profile,
    find_profile,
    model_key,
    profile_path,
    read_profile,
    write_profile,
)
from sloserve.profiler.fit import fit_forward_cost, fit_stats

TRUE = ForwardCost(a=2.0e-6, b=1.5e-3, c=28e-3)


def grid_samples(cost: ForwardCost, rng: np.random.Generator, noise: float):
    """The profiler grid: batch x context x query length, timings with multiplicative noise."""
    out = []
    for batch in (1, 2, 4, 8, 16, 32, 64):
        for ctx in (64, 256, 1024, 4096):
            for q in (1, 2, 4, 9):
                n_ctx, n_q = batch * ctx, batch * q
                t = cost.time(n_ctx, n_q) * (1.0 + noise * rng.standard_normal())
                out.append((n_ctx, n_q, t))
    return out


@pytest.mark.parametrize("seed", range(5))
def test_fit_recovers_known_coefficients_within_2_percent(seed):
    rng = np.random.default_rng(seed)
    fit = fit_forward_cost(grid_samples(TRUE, rng, noise=0.02))
    assert fit.cost.a == pytest.approx(TRUE.a, rel=0.02)
    assert fit.cost.b == pytest.approx(TRUE.b, rel=0.02)
    assert fit.cost.c == pytest.approx(TRUE.c, rel=0.02)
    assert fit.stats.r2 > 0.99 and fit.stats.mape < 0.03


def test_fit_is_exact_without_noise_and_flags_bad_models():
    fit = fit_forward_cost(grid_samples(TRUE, np.random.default_rng(0), noise=0.0))
    assert fit.cost.b == pytest.approx(TRUE.b, rel=1e-9)
    assert fit.stats.mape < 1e-9
    wrong = fit_stats(
        ForwardCost(TRUE.a, TRUE.b * 2, TRUE.c), grid_samples(TRUE, np.random.default_rng(0), 0.0)
    )
    assert wrong.mape > 0.1 and wrong.r2 < 0.99


KNEE = ForwardCost(a=2.0e-6, b=1.5e-3, c=28e-3, q0=16)


@pytest.mark.parametrize("seed", range(5))
def test_fit_recovers_a_roofline_knee_within_2_percent(seed):
    """Timings flat up to 16 query tokens per forward, linear after (CPU-like): the fit finds
    the knee and the coefficients; the linear fit of the same data is visibly worse."""
    samples = grid_samples(KNEE, np.random.default_rng(seed), noise=0.02)
    fit = fit_forward_cost(samples)
    assert fit.cost.q0 == pytest.approx(KNEE.q0, abs=1.0)
    for name in ("a", "b", "c"):
        assert getattr(fit.cost, name) == pytest.approx(getattr(KNEE, name), rel=0.02)
    linear = fit_forward_cost(samples, knee=False)
    assert linear.cost.q0 == 0.0 and linear.stats.mape > 2 * fit.stats.mape


@pytest.mark.parametrize("seed", range(3))
def test_step_fit_separates_a_drafters_setup_from_its_forwards(seed):
    """Drafting steps of k forwards that pay a setup once (SGLang's CPU draft: ~3 ms on
    ~6 ms forwards): fit_step_cost finds the setup and the forwards' coefficients, knee
    included; the per-forward fit of the same steps spreads the setup over the forwards."""
    from sloserve.profiler.fit import fit_step_cost

    draft = ForwardCost(a=7e-7, b=1.5e-4, c=5.6e-3, q0=6, first=2.9e-3)
    rng = np.random.default_rng(seed)
    steps = []
    for _ in range(300):
        batch, k = int(rng.choice([1, 2, 4, 8, 16])), int(rng.integers(1, 9))
        n_ctx, n_q = batch * float(rng.integers(50, 800)), batch + float(rng.integers(0, 3))
        t = (draft.first + k * draft.time(n_ctx, n_q)) * (1.0 + 0.02 * rng.standard_normal())
        steps.append((k, n_ctx, n_q, t))
    fit = fit_step_cost(steps)
    assert fit.cost.q0 == pytest.approx(draft.q0, abs=1.0)
    for name in ("a", "b", "c", "first"):
        assert getattr(fit.cost, name) == pytest.approx(getattr(draft, name), rel=0.1), name
    spread = fit_forward_cost((c, q, t / k) for k, c, q, t in steps)
    assert spread.cost.first == 0.0 and spread.stats.mape > 2 * fit.stats.mape


def test_linear_timings_keep_no_knee():
    for seed in range(5):
        fit = fit_forward_cost(grid_samples(TRUE, np.random.default_rng(seed), noise=0.02))
        assert fit.cost.q0 == 0.0


def test_fit_keeps_coefficients_non_negative():
    # no context dependence at all, plus noise: an unconstrained fit may go negative
    cost = ForwardCost(0.0, 1e-3, 5e-3)
    fit = fit_forward_cost(grid_samples(cost, np.random.default_rng(1), noise=0.05))
    assert fit.cost.a >= 0.0 and fit.cost.b > 0 and fit.cost.c > 0


def test_fit_rejects_bad_samples():
    with pytest.raises(ValueError):
        fit_forward_cost([(1, 1, 0.1), (2, 2, 0.2)])
    with pytest.raises(ValueError):
        fit_forward_cost([(1, 1, 0.1), (2, 2, -0.2), (3, 1, 0.1)])


def make_profile(name="models/tiny-target/", fp="abcdef0123456789") -> Profile:
    return Profile(
        target=ModelProfile(name, fp, TRUE),
        draft=ModelProfile("tiny-draft", "ffff", ForwardCost(1e-7, 1e-4, 4e-3)),
        device="cpu",
        dtype="float32",
        overhead=1e-3,
        grid={"batch_sizes": [1, 2], "context_lens": [64], "query_lens": [1, 9]},
        mode="quick",
    )


def test_profile_round_trip_and_lookup(tmp_path):
    prof = make_profile()
    path = write_profile(prof, profile_path(tmp_path, prof))
    assert path.parent == tmp_path / "profiles"
    assert path.name == "tiny-target-abcdef012345__tiny-draft-ffff__cpu__float32.json"
    back = read_profile(path)
    assert back == prof
    assert back.cost_model().target == TRUE and back.cost_model().overhead == 1e-3
    data = json.loads(path.read_text())
    assert data["schema"] == "sloserve.profile" and data["target"]["cost"]["b"] == TRUE.b
    key = model_key("models/tiny-target/", "abcdef0123456789")
    assert find_profile(tmp_path, key, "tiny-draft-ffff", "cpu", "float32") == path
    assert find_profile(tmp_path, key, "tiny-draft-ffff", "cpu", "bfloat16") is None
    assert find_profile(tmp_path, "other", "tiny-draft-ffff", "cpu", "float32") is None


def _cpu(monkeypatch, flags: str) -> None:
    """This test's CPU: an AMD EPYC with these /proc/cpuinfo flags."""
    info = {"model name": "AMD EPYC", "flags": flags}
    monkeypatch.setattr(profile_lookup, "cpuinfo_field", lambda name: info.get(name, ""))


@pytest.mark.parametrize("flags, tier", [
    ("fpu avx2 avx512f avx512_bf16 amx_tile amx_bf16", "amx"),
    ("fpu avx2 avx512f avx512bw", "avx512"),
    ("fpu sse4_2 avx2 fma", "avx2"),
    ("fpu sse4_2", ""),
])
def test_cpu_profile_keys_name_the_instruction_set(monkeypatch, flags, tier):
    """One CPU model name covers machines ~2x apart in float32 forwards (the AMD EPYC with
    and without AVX-512): the key names the widest matrix instructions, and lookups fall
    back to the key profiles had before (no tier)."""
    _cpu(monkeypatch, flags)
    threads = torch.get_num_threads()
    legacy = f"cpu-AMD EPYC-{threads}t"
    assert profile_lookup.cpu_isa_tier() == tier
    assert profile_lookup.device_key("cpu", isa=False) == legacy
    if tier:
        assert profile_lookup.device_key("cpu") == f"cpu-AMD EPYC-{tier}-{threads}t"
        assert profile_lookup.device_keys("cpu") == [profile_lookup.device_key("cpu"), legacy]
    else:
        assert profile_lookup.device_keys("cpu") == [legacy]
    # SGLang's profiles (settings.find_sglang_profile) are looked up the same way
    from sloserve.sglang_ext import settings

    sglang = profile_lookup.device_keys(
        "cpu", lambda dev, isa: settings.sglang_device_key(dev, True, isa))
    assert sglang[-1].startswith(f"sglang-{legacy}")
    assert sglang == ([settings.sglang_device_key("cpu", True),
                       settings.sglang_device_key("cpu", True, isa=False)] if tier else
                      [settings.sglang_device_key("cpu", True, isa=False)])


def test_sglang_profile_keys_name_the_cpu_attention_path(monkeypatch):
    """An SGLang profile measured with the C++ paged attention is keyed "-kpa" and found
    first; without one the profiles measured on the torch path before are found (their
    keys, as before), and with the kernel off nothing asks for a "-kpa" profile."""
    from sloserve.runtime import cpu_kernels
    from sloserve.sglang_ext import settings

    _cpu(monkeypatch, "fpu avx2 avx512f")
    monkeypatch.setattr(cpu_kernels, "kernels_ready", lambda: True)
    on = settings.sglang_device_keys("cpu")
    torch_path = [settings.sglang_device_key("cpu", kernel=False),
                  settings.sglang_device_key("cpu", isa=False, kernel=False)]
    assert on[:2] == [k + "-kpa" for k in torch_path] and on[2:] == torch_path
    assert settings.sglang_device_key("cpu") == on[0]
    monkeypatch.setattr(cpu_kernels, "kernels_ready", lambda: False)
    assert settings.sglang_device_keys("cpu") == torch_path
    monkeypatch.undo()  # the real check: the switch alone turns the suffix off
    monkeypatch.setenv(cpu_kernels.ENV_SWITCH, "0")
    assert not cpu_kernels.kernels_ready()
    assert not settings.sglang_device_key("cpu").endswith("-kpa")


def test_profile_lookup_takes_this_instruction_sets_profile_never_anothers(tmp_path, monkeypatch):
    monkeypatch.setenv("SLOSERVE_CACHE", str(tmp_path))
    base = make_profile()
    tk, dk = base.target.key, base.draft.key

    def write(device: str, c: float) -> Path:
        prof = dataclasses.replace(base, device=device,
                                   target=ModelProfile(base.target.name, base.target.fingerprint,
                                                       ForwardCost(TRUE.a, TRUE.b, c)))
        return write_profile(prof, profile_path(tmp_path, prof))

    def found() -> Path | None:
        return profile_lookup.find_first(tk, dk, profile_lookup.device_keys("cpu"), "float32")

    _cpu(monkeypatch, "avx2 avx512f")  # an AVX-512 EPYC
    assert found() is None
    legacy = write(profile_lookup.device_key("cpu", isa=False), 0.05)
    assert found() == legacy  # measured before keys had a tier: still used
    avx512 = write(profile_lookup.device_key("cpu"), 0.03)
    assert found() == avx512 and read_profile(avx512).target.cost.c == 0.03
    _cpu(monkeypatch, "avx2")  # the AVX2-only EPYC: the AVX-512 profile is not its own
    assert found() == legacy
    avx2 = write(profile_lookup.device_key("cpu"), 0.07)
    assert found() == avx2 and avx2 != avx512


def test_read_rejects_other_files(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text(json.dumps({"schema": "something-else"}))
    with pytest.raises(ValueError):
        read_profile(bad)


def test_profile_keeps_knee_and_calibration(tmp_path):
    import dataclasses

    counts = ((1.0, 9.0) + (5.0,) * 14, (0.0, 7.0) + (20.0,) * 14)
    prof = dataclasses.replace(
        make_profile(), target=ModelProfile("t", "ab", KNEE), calibration=counts)
    back = read_profile(write_profile(prof, profile_path(tmp_path, prof)))
    assert back.target.cost.q0 == KNEE.q0 and back.calibration == counts


def test_calibration_seed_starts_the_map_and_outcomes_take_over():
    from sloserve.estimator.acceptance import ConfidenceCalibrator
    from sloserve.estimator.cost_model import CostModel
    from sloserve.policies.registry import make_policy

    g = np.full(16, 0.8)  # this pair accepts 80% at every confidence
    counts = np.stack([(1 - g) * 100, g * 100])
    policy = make_policy("specserve", CostModel(TRUE, ForwardCost(1e-7, 1e-4, 4e-3)), k_max=4,
                         calibration=counts)
    # low-confidence bins start near 0.8, not at the identity's 0.16-0.47 (the prior remains)
    assert np.all(policy.calibrator.table[2:8] > 0.65)
    assert make_policy("fixed:2", CostModel(TRUE, TRUE), k_max=4, calibration=counts).name == "fixed:2"
    cal = ConfidenceCalibrator()
    cal.seed(counts)
    conf = np.full((200, 1), 0.5)
    for _ in range(20):  # then 4000 outcomes at confidence 0.5 with acceptance 0.3
        accepted = (np.random.default_rng(_).random(200) < 0.3).astype(int)
        cal.update(conf, np.ones(200, dtype=int), accepted)
    assert float(cal(np.array([0.5]))[0]) == pytest.approx(0.3, abs=0.05)
    with pytest.raises(ValueError):
        cal.seed(np.zeros((2, 3)))
