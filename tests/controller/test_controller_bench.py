"""The controller bench's command line: a profile file as its cost model, cold caches."""

from __future__ import annotations

import json

import pytest

from sloserve.bench import controller
from sloserve.estimator.cost_model import ForwardCost
from sloserve.estimator.profile_file import ModelProfile, Profile, profile_path, write_profile


def test_bench_runs_on_a_profile_file_with_cold_caches(tmp_path, capsys):
    prof = Profile(target=ModelProfile("tiny-target", "abcd", ForwardCost(2e-6, 1.5e-3, 28e-3)),
                   draft=ModelProfile("tiny-draft", "ffff", ForwardCost(1e-7, 1e-4, 4e-3)),
                   device="cpu", dtype="float32", overhead=1e-3,
                   grid={"batch_sizes": [1, 2], "context_lens": [64], "query_lens": [1, 9]},
                   mode="quick")
    path = write_profile(prof, profile_path(tmp_path, prof))
    out = tmp_path / "bench.json"
    controller.main(["--batches", "2", "--cost", f"cpu,{path}", "--steps", "5", "--repeat", "1",
                     "--flush", "1", "--verify-time", "--out", str(out)])
    data = json.loads(out.read_text())
    assert [r["cost"] for r in data["results"]] == ["cpu", str(path)]
    assert all(r["flush_mb"] == 1 and r["verify_time"] and r["steps"] == 5 and r["median_us"] > 0
               for r in data["results"])
    assert data["meta"]["cost_models"][str(path)]["target"]["b"] == prof.target.cost.b
    assert "specserve" in capsys.readouterr().out  # the table


@pytest.mark.parametrize("argv,error", [(["--cost", "nowhere.json"], "--cost 'nowhere.json'"),
                                        (["--flush", "-1"], "--flush must be >= 0")])
def test_bench_names_a_bad_option(tmp_path, capsys, argv, error):
    with pytest.raises(SystemExit):
        controller.main([*argv, "--out", str(tmp_path / "x.json")])
    assert error in capsys.readouterr().err
