"""Workload shaping: window, cap, time stretch, token scaling and clamps, all recorded."""

from __future__ import annotations

import pytest

from sloserve.replay.shaping import Scaling, apply_scaling, time_scale_for_rate
from sloserve.replay.trace import TraceRequest
from sloserve.replay.workload import load_levels

TRACE = [TraceRequest(float(t), 100 * (t + 1), 10 * t) for t in range(10)]  # 1 req/s


def test_identity_except_min_lengths():
    out = apply_scaling(TRACE, Scaling())
    assert [r.arrival_s for r in out] == [r.arrival_s for r in TRACE]
    assert out[0].output_tokens == 1  # output_min=1 turns a 0-token row into 1 token
    assert [r.output_tokens for r in out[1:]] == [r.output_tokens for r in TRACE[1:]]


def test_window_shift_and_cap():
    out = apply_scaling(TRACE, Scaling(start_s=2.5, duration_s=5.0))
    assert [r.arrival_s for r in out] == [0.5, 1.5, 2.5, 3.5, 4.5]  # arrivals 3..7
    assert out[0].input_tokens == 400
    capped = apply_scaling(TRACE, Scaling(start_s=2.5, duration_s=5.0, max_requests=2))
    assert [r.input_tokens for r in capped] == [400, 500]


def test_time_and_token_scaling_with_clamps():
    s = Scaling(time_scale=2.0, input_scale=0.005, output_scale=0.25, input_min=2,
                input_max=4, output_min=3, output_max=15)
    out = apply_scaling(TRACE, s)
    assert [r.arrival_s for r in out] == [2.0 * t for t in range(10)]
    # inputs 100..1000 x 0.005 = 0.5..5 -> round half up 1,1,2,2,3,3,4,4,5,5 -> clamp [2, 4]
    assert [r.input_tokens for r in out] == [2, 2, 2, 2, 3, 3, 4, 4, 4, 4]
    # outputs 0..90 x 0.25 = 0, 2.5, 5, ..., 22.5 -> 0,3,5,8,10,13,15,18,20,23 -> [3, 15]
    assert [r.output_tokens for r in out] == [3, 3, 5, 8, 10, 13, 15, 15, 15, 15]


def test_time_scale_for_rate():
    s = Scaling(start_s=0.0, duration_s=5.0)
    scale = time_scale_for_rate(TRACE, s, 0.25)  # window: 5 requests, 1 req/s
    assert scale == pytest.approx(4.0)
    assert apply_scaling(TRACE, Scaling(duration_s=5.0, time_scale=scale))[-1].arrival_s == 16
    with pytest.raises(ValueError):
        time_scale_for_rate(TRACE[:1], Scaling(), 1.0)


def test_load_levels_are_explicit():
    levels = load_levels(TRACE, Scaling(seed=3), target_rates=[0.5, 2.0])
    assert [label for label, _ in levels] == ["rate=0.5/s", "rate=2/s"]
    assert [s.time_scale for _, s in levels] == pytest.approx([2.0, 0.5])
    assert all(s.seed == 3 for _, s in levels)
    assert [s.time_scale for _, s in load_levels(TRACE, Scaling(), time_scales=[1, 3])] == [1, 3]
    with pytest.raises(ValueError):
        load_levels(TRACE, Scaling(), time_scales=[1], target_rates=[1])


def test_scaling_record_and_validation():
    s = Scaling(start_s=60, duration_s=300, time_scale=4, input_scale=0.1, input_max=512,
                max_requests=100, seed=7)
    text = s.describe()
    for part in ("60s+300s", "first 100", "time x4", "input x0.1 [1, 512]",
                 "output x1 [1, inf]", "seed 7"):
        assert part in text
    assert s.to_dict()["input_max"] == 512 and Scaling(**s.to_dict()) == s
    for bad in ({"time_scale": 0}, {"duration_s": 0}, {"input_min": 0},
                {"output_min": 5, "output_max": 4}, {"max_requests": 0}, {"start_s": -1}):
        with pytest.raises(ValueError):
            Scaling(**bad)
