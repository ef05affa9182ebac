"""Metric definitions against hand-computed cases (docs/design.md sec. 11, vLLM semantics)."""

from __future__ import annotations

import pytest

from sloserve.replay.metrics import (
    Distribution,
    SloConfig,
    request_metrics,
    spec_summary,
    summarize_run,
    with_speedups,
)
from sloserve.replay.records import PolicyRun, RequestRecord, SpecStats

# A: 4 tokens in 3 chunks (1, +2, +1): TTFT 0.19, E2E 0.34, TPOT 0.15 / 3 = 0.05, ITL 0.06, 0.09
A = RequestRecord("a", scheduled_s=1.0, send_s=1.0, end_s=1.36, chunk_s=(1.19, 1.25, 1.34),
                  chunk_tokens=(1, 3, 4), prompt_tokens=10, output_tokens=4)
# B: a single token: TTFT = E2E = 0.1, TPOT undefined (met vacuously), no ITL
B = RequestRecord("b", scheduled_s=0.0, send_s=0.0, end_s=0.1, chunk_s=(0.1,),
                  chunk_tokens=(1,), prompt_tokens=5, output_tokens=1)
# C: failed
C = RequestRecord("c", scheduled_s=1.9, send_s=1.95, end_s=2.0, success=False, error="HTTP 500")
SLO = SloConfig(ttft_s=0.2, tpot_s=0.04, scales=(0.8, 1.0, 1.3))


def test_request_metrics():
    m = request_metrics(A, SLO)
    assert m.ttft_s == pytest.approx(0.19)
    assert m.e2e_s == pytest.approx(0.34)
    assert m.tpot_s == pytest.approx(0.05)
    assert m.itls_s == pytest.approx((0.06, 0.09))
    assert (m.ttft_slo_s, m.tpot_slo_s) == (0.2, 0.04)
    b = request_metrics(B, SLO)
    assert b.tpot_s is None and b.itls_s == () and b.meets(0.01) == (False, True)
    c = request_metrics(C, SLO)
    assert c.ttft_s is None and c.meets(100.0) == (False, False)


def test_per_request_slo_overrides_default():
    rec = RequestRecord("d", 0.0, 0.0, 0.5, (0.3, 0.5), (1, 5), 1, 5, tpot_slo_s=0.06,
                        ttft_slo_s=0.35)
    m = request_metrics(rec, SLO)  # TTFT 0.3, TPOT 0.2 / 4 = 0.05
    assert m.meets(1.0) == (True, True)
    assert m.meets(0.8) == (False, False)


def test_summary_hand_computed():
    s = summarize_run(PolicyRun("ar", (A, B, C)), SLO)
    assert (s.num_requests, s.completed, s.failed) == (3, 2, 1)
    assert s.duration_s == 2.0  # run start (t = 0) to the last response end
    assert s.request_throughput_rps == pytest.approx(1.0)
    assert s.output_throughput_tps == pytest.approx(2.5)
    assert s.total_input_tokens == 15 and s.total_output_tokens == 5
    assert s.mean_tokens_per_chunk == pytest.approx(5 / 4)
    assert s.max_send_lag_ms == pytest.approx(50.0)
    # TTFTs 190 and 100 ms; np.percentile interpolates linearly: p90 = 100 + 0.9 * 90
    assert s.ttft_ms == Distribution(2, pytest.approx(145), pytest.approx(145),
                                     pytest.approx(181), pytest.approx(189.1))
    assert s.e2e_ms.mean == pytest.approx(220) and s.e2e_ms.count == 2
    assert s.tpot_ms.count == 1 and s.tpot_ms.mean == pytest.approx(50)  # B excluded
    assert s.itl_ms.count == 2 and s.itl_ms.mean == pytest.approx(75)
    by_scale = {p.scale: p for p in s.slo_curve}
    # scale 0.8: TTFT SLO 160 ms -> only B; TPOT SLO 32 ms -> only B (vacuous)
    assert (by_scale[0.8].ttft, by_scale[0.8].tpot, by_scale[0.8].both) == pytest.approx(
        (1 / 3, 1 / 3, 1 / 3))
    # scale 1.0: A meets TTFT (190 <= 200 ms) but not TPOT (50 > 40 ms)
    assert (by_scale[1.0].ttft, by_scale[1.0].tpot, by_scale[1.0].both) == pytest.approx(
        (2 / 3, 1 / 3, 1 / 3))
    # scale 1.3: TPOT SLO 52 ms -> A meets both
    assert by_scale[1.3].both == pytest.approx(2 / 3)
    assert by_scale[1.3].goodput_rps == pytest.approx(1.0)  # 2 good requests / 2 s
    assert s.slo_attainment == pytest.approx(1 / 3)
    assert s.goodput_rps == pytest.approx(0.5)
    assert s.spec is None and s.speedup is None


def test_empty_and_all_failed_runs():
    s = summarize_run(PolicyRun("x", (C,)), SLO)
    assert s.ttft_ms == Distribution(0, None, None, None, None)
    assert s.slo_attainment == 0.0 and s.mean_tokens_per_chunk is None
    empty = summarize_run(PolicyRun("x", ()), SLO)
    assert empty.num_requests == 0 and empty.goodput_rps == 0.0


def test_spec_summary():
    stats = SpecStats(steps=10, verify_steps=40, proposed=120,
                        verified=100, accepted=60, controller_time_s=0.005)
    s = spec_summary(stats)
    assert s.acceptance_rate == pytest.approx(0.5)
    assert s.mean_accepted_len == pytest.approx(2.5)
    assert s.mean_proposed_k == pytest.approx(3.0)
    assert s.mean_verified_k == pytest.approx(2.5)
    assert s.controller_ms_per_step == pytest.approx(0.5)
    ar = spec_summary(SpecStats(steps=10))
    assert ar.acceptance_rate is None and ar.mean_accepted_len is None
    run = summarize_run(PolicyRun("specserve", (A,), stats), SLO)
    assert run.spec == s


def test_speedup_vs_ar():
    slow = RequestRecord("s", 0.0, 0.0, 0.4, (0.1, 0.4), (1, 2), 1, 2)
    fast = RequestRecord("f", 0.0, 0.0, 0.2, (0.1, 0.2), (1, 2), 1, 2)
    runs = [summarize_run(PolicyRun(p, (r,)), SLO) for p, r in (("ar", slow), ("spec", fast))]
    speedups = [s.speedup for s in with_speedups(runs)]
    assert speedups == pytest.approx([1.0, 2.0])
    assert [s.speedup for s in with_speedups(runs[1:])] == [None]


def test_record_invariants():
    with pytest.raises(ValueError):
        RequestRecord("x", 0, 0, 1, (0.1, 0.2), (1,), 1, 1)  # length mismatch
    with pytest.raises(ValueError):
        RequestRecord("x", 0, 0, 1, (0.2, 0.1), (1, 2), 1, 2)  # time goes back
    with pytest.raises(ValueError):
        RequestRecord("x", 0, 0, 1, (0.1, 0.2), (2, 2), 1, 2)  # no new token
    with pytest.raises(ValueError):
        RequestRecord("x", 0, 0, 1, (0.1,), (3,), 1, 4)  # output != last count
    with pytest.raises(ValueError):
        RequestRecord("x", 0, 0, 1)  # success without tokens
    assert RequestRecord.from_dict(A.to_dict()) == A
