"""The profiler never overwrites the profile the engine loads unasked, and --replace refuses
a worse fit (lower R^2), saying both numbers; it prints its estimated duration first. Run for
real (`--quick` on the tiny pair, a few seconds) and on the decision function with real fits."""

from __future__ import annotations

import json

import numpy as np
import pytest

from sloserve.cli.profile import main
from sloserve.estimator.profile_file import ModelProfile, Profile, read_profile, write_profile
from sloserve.profiler.fit import fit_forward_cost
from sloserve.profiler.placement import place, side_path


def _set_r2(path, r2: float) -> None:
    d = json.loads(path.read_text())
    d["target"]["fit"]["r2"] = d["draft"]["fit"]["r2"] = r2
    path.write_text(json.dumps(d))


def test_quick_run_writes_next_to_an_existing_profile_and_replace_refuses_worse(
        tiny_pair, tmp_path, capsys):
    argv = ["--quick", "--model-path", tiny_pair[0], "--draft-model-path", tiny_pair[1],
            "--out-dir", str(tmp_path), "--k-max", "4", "--dtype", "float32"]
    first = main(argv)
    out = capsys.readouterr().out
    assert "timed forwards" in out and out.index("timed forwards") < out.index("sweep 1/")
    assert first.parent == tmp_path / "profiles" and not first.name.endswith(".new.json")

    _set_r2(first, 1.0)  # an existing fit no measurement can beat
    kept = first.read_bytes()
    second = main(argv)
    assert second == side_path(first) and first.read_bytes() == kept
    assert "--replace" in capsys.readouterr().out

    with pytest.raises(SystemExit) as e:
        main([*argv, "--replace"])
    assert e.value.code == 1
    out = capsys.readouterr().out
    new_r2 = read_profile(side_path(first)).target.fit.r2
    assert "not replacing" in out and "1.0000 existing" in out and f"{new_r2:.4f} new" in out
    assert first.read_bytes() == kept

    _set_r2(first, -5.0)  # an existing fit any measurement beats
    assert main([*argv, "--replace"]) == first
    assert "replacing" in capsys.readouterr().out
    assert read_profile(first).target.fit.r2 > -5.0


def _profile(noise: float, seed: int) -> Profile:
    """A profile whose fits come from fit_forward_cost on samples with relative noise."""
    rng = np.random.default_rng(seed)
    pts = [(b * (c + q), b * q) for b in (1, 4, 16) for c in (64, 512) for q in (1, 3, 5)]
    truth = [1e-8 * n + 2e-6 * m + 1e-3 for n, m in pts]
    samples = [(n, m, t * (1 + noise * rng.standard_normal())) for (n, m), t in zip(pts, truth)]
    fit = fit_forward_cost(samples)
    model = ModelProfile("m", "f", fit.cost, fit.stats)
    return Profile(target=model, draft=model, device="cpu-test", dtype="float32")


def test_decision_compares_r2_model_by_model(tmp_path):
    clean, noisy = _profile(0.01, 0), _profile(0.3, 1)
    assert clean.target.fit.r2 > noisy.target.fit.r2
    path = tmp_path / "profiles" / "p.json"
    assert place(noisy, path, replace=False).path == path  # nothing there yet
    write_profile(clean, path)
    keep = place(noisy, path, replace=False)
    assert keep.path == side_path(path) and not keep.replaces and not keep.refused
    worse = place(noisy, path, replace=True)
    assert worse.refused and worse.path == side_path(path)
    assert f"{noisy.target.fit.r2:.4f} new vs {clean.target.fit.r2:.4f} existing" in \
        worse.message
    write_profile(noisy, path)
    better = place(clean, path, replace=True)
    assert better.replaces and better.path == path and not better.refused
    path.write_text("{not json")
    assert place(clean, path, replace=True).replaces
    assert place(clean, path, replace=False).path == side_path(path)
