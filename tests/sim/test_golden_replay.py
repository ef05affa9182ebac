"""The fixed-seed simulator replay gives the report kept in golden/replay.json, float for float
(see golden_replay.py: written before the speculation path was restructured)."""

from __future__ import annotations

import json

import pytest
from golden_replay import GOLDEN, replay_report


def test_fixed_seed_replay_matches_the_golden_report():
    golden = json.loads(GOLDEN.read_text())
    report = replay_report()
    assert sorted(report) == sorted(golden)
    for key in golden:
        got, want = report[key], golden[key]
        assert got["stats"] == want["stats"], f"{key}: engine counters differ"
        assert got["end"] == want["end"], f"{key}: the replay ends at another time"
        for g, w in zip(got["requests"], want["requests"]):
            assert g == w, f"{key}: request {w[0]} streamed differently"
        assert got["history"] == want["history"], f"{key}: step history differs"


def test_the_golden_report_exercises_what_it_guards():
    golden = json.loads(GOLDEN.read_text())
    spec = golden["specserve/model"]
    assert spec["stats"]["preemptions"] > 0  # the small pool preempted
    assert spec["stats"]["spec_steps"] > 0 and spec["stats"]["slo_step_misses"] >= 0
    assert golden["ar/model"]["stats"]["spec_steps"] == 0
    ks = {k: v["stats"]["chosen_k"] for k, v in golden.items()}
    assert ks["specserve/model"] != ks["fixed:3/model"]
    assert sum(ks["specserve/ngram"][1:]) > 0


if __name__ == "__main__":
    pytest.main([__file__])
