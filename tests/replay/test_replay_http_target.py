"""The SGLang /generate HTTP target against a fake SSE server on 127.0.0.1."""

from __future__ import annotations

import asyncio

import pytest

from sloserve.cli.targets import make_target
from sloserve.replay.http_target import SGLangHTTPTarget, SSEStream, consume_sse_line
from sloserve.replay.metrics import SloConfig, summarize_run
from sloserve.replay.records import PolicyRun, ReplayRequest


def run(target: SGLangHTTPTarget, requests: list[ReplayRequest], progress=None):
    return asyncio.run(target.run(requests, progress))


def test_streams_tokens_and_honours_arrivals(fake_sglang):
    requests = [
        ReplayRequest("r0", 0.0, 5, input_ids=(1, 2, 3), tpot_slo_s=0.05),
        ReplayRequest("r1", 0.15, 1, text="hello there world", category="qa"),
        ReplayRequest("r2", 0.3, 4, text="a b"),
    ]
    done = []
    records = run(SGLangHTTPTarget(fake_sglang.url, temperature=0.0), requests, done.append)
    assert [r.request_id for r in records] == ["r0", "r1", "r2"]
    assert sorted(r.request_id for r in done) == ["r0", "r1", "r2"]
    r0, r1, r2 = records
    assert all(r.success for r in records), [r.error for r in records]
    # 2 tokens per chunk; the repeated final chunk (no new token) is not recorded
    assert r0.chunk_tokens == (2, 4, 5) and r0.output_tokens == 5
    assert r1.chunk_tokens == (1,) and r2.chunk_tokens == (2, 4)
    assert (r0.prompt_tokens, r1.prompt_tokens) == (3, 3)  # from meta_info.prompt_tokens
    assert r1.category == "qa" and r0.tpot_slo_s == 0.05
    for rec, req in zip(records, requests):
        lag = rec.send_s - req.arrival_s
        assert -1e-3 <= lag < 0.1  # sent at its arrival time, not before
        ttft = rec.chunk_s[0] - rec.send_s
        assert 0.05 <= ttft < 0.5  # the fake server waits 50 ms before the first chunk
    # each chunk stamped when it arrived: never before the server sent it (ttft, then itl
    # between chunks). Gaps between receipts are not bounded below: a client that was
    # descheduled reads two chunks at once (CI: 0 ms once, on a loaded 2-core machine)
    assert list(r0.chunk_s) == sorted(r0.chunk_s)
    assert r0.chunk_s[-1] - r0.send_s >= 0.05 + 2 * 0.01 - 1e-3
    # what the server received
    bodies = {b["rid"]: b for _, b in fake_sglang.received}
    assert bodies["r0"]["input_ids"] == [1, 2, 3] and "text" not in bodies["r0"]
    assert bodies["r1"]["text"] == "hello there world"
    assert bodies["r0"]["sampling_params"] == {
        "max_new_tokens": 5, "temperature": 0.0, "ignore_eos": True}
    assert bodies["r0"]["stream"] is True
    s = summarize_run(PolicyRun("ar", tuple(records)), SloConfig())
    assert s.completed == 3 and s.tpot_ms.count == 2


def test_request_slos_travel_in_custom_params_when_asked(fake_sglang):
    requests = [ReplayRequest("a", 0.0, 2, text="x", tpot_slo_s=0.05, ttft_slo_s=2.0),
                ReplayRequest("b", 0.0, 2, text="y")]
    records = run(SGLangHTTPTarget(fake_sglang.url, send_slos=True), requests)
    assert all(r.success for r in records)
    bodies = {b["rid"]: b["sampling_params"] for _, b in fake_sglang.received}
    assert bodies["a"]["custom_params"] == {"tpot_slo": 0.05, "ttft_slo": 2.0}
    assert "custom_params" not in bodies["b"]  # no SLO of its own: nothing sent


def test_open_loop_sends_do_not_wait_for_responses(fake_sglang):
    fake_sglang.ttft_s = 0.3
    requests = [ReplayRequest(f"r{i}", 0.02 * i, 2, text="x") for i in range(5)]
    records = run(SGLangHTTPTarget(fake_sglang.url), requests)
    assert all(r.success for r in records)
    assert max(r.send_s - r.scheduled_s for r in records) < 0.1
    assert records[-1].send_s < records[0].chunk_s[0]  # sent before the first one answered


def test_failures_are_recorded_not_raised(fake_sglang):
    requests = [ReplayRequest("a", 0.0, 3, text="fail500"),
                ReplayRequest("b", 0.0, 3, text="errorchunk"),
                ReplayRequest("c", 0.0, 3, text="fine")]
    a, b, c = run(SGLangHTTPTarget(fake_sglang.url), requests)
    assert not a.success and a.error.startswith("HTTP 500")
    assert not b.success and "out of memory" in b.error
    assert c.success and c.output_tokens == 3
    (dead,) = run(SGLangHTTPTarget("http://127.0.0.1:9", timeout_s=2.0),
                  [ReplayRequest("d", 0.0, 3, text="x")])
    assert not dead.success and "Connect" in dead.error


def test_sse_line_parsing():
    s = SSEStream()
    assert consume_sse_line("", 0.1, s) is None and consume_sse_line(": ping", 0.1, s) is None
    assert consume_sse_line('data: {"text": "a", "meta_info": {"completion_tokens": 1, '
                         '"prompt_tokens": 7}}', 0.2, s) is None
    assert (s.chunk_s, s.chunk_tokens, s.prompt_tokens) == ([0.2], [1], 7)
    assert "completion_tokens" in consume_sse_line('data: {"text": "a"}', 0.3, s)
    assert "invalid JSON" in consume_sse_line("data: {oops", 0.3, s)
    assert consume_sse_line("data: [DONE]", 0.4, s) is None and s.done


def test_make_target():
    assert isinstance(make_target("http", "ar", url="http://x:1"), SGLangHTTPTarget)
    from sloserve.replay.inprocess_target import InProcessTarget

    t = make_target("inprocess", "specserve")
    assert isinstance(t, InProcessTarget) and t.cfg.spec_policy == "specserve"
    with pytest.raises(ValueError, match="needs a URL"):
        make_target("http", "ar")
    with pytest.raises(ValueError, match="unknown target kind"):
        make_target("grpc", "ar")
