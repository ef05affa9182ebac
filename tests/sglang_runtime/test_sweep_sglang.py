"""The multi-SLO load sweep against SGLang's own servers (`python -m sloserve.replay.sweep
--target sglang`, issue #32): one server per system started by `python -m sloserve.launch
--engine sglang`, identical requests replayed on each, every request's SLO class sent in
SGLang's custom_params. A small run on the tiny pair: plain SGLang and SPECSERVE with prompt
lookup, one load, one seed."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.sglang_runtime.launched import REPO

pytestmark = pytest.mark.timeout(1800)

TRACE = REPO.parent / "shared" / "data" / "traces" / "azure_llm_2023_conv.csv"


def test_sweep_replays_the_same_requests_on_every_sglang_server(sglang_python,
                                                              tiny_sglang_pair, tmp_path):
    """One server at a time (`--servers one`: every cell of a system before the next, the
    server before it stopped), the mode the real pair's sweep runs in on 24 GB. (`--servers
    all`, the default, starts the same servers up front in a loop: its live run was dropped
    from CI for its two minutes of server starts.)"""
    if not TRACE.is_file():
        pytest.skip(f"needs the Azure trace at {TRACE}")
    target, draft = tiny_sglang_pair
    out = tmp_path / "sweep"
    systems = "plain,sloserve-ngram:specserve-slo:per-request"
    # the servers take --port and --port + 1: below the kernel's ephemeral range (32768 up),
    # where a client connection of this session can hold a port (CI of d035d09: "port 33878
    # is in use")
    cmd = [sys.executable, "-m", "sloserve.replay.sweep", "--target", "sglang",
           "--model", target, "--draft-model-path", draft, "--policies", systems,
           "--default-policy", "sloserve-ngram:specserve-slo:per-request",
           "--trace", str(TRACE), "--loads", "1", "--rate-unit", "ar", "--seeds", "0",
           "--requests", "8", "--output-scale", "0.1", "--output-max", "12",
           "--tpot-slo-ms", "200", "--ttft-slo-ms", "5000", "--port", "29877",
           "--out", str(out), "--no-plots", "--servers", "one", "--timings",
           "--step-clock"]
    env = {**os.environ, "SLOSERVE_SGLANG_PYTHON": sglang_python}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "sweep.json").read_text())
    (cell,) = report["loads"]
    runs = cell["runs"]
    assert sorted(r["policy"] for r in runs) == sorted(systems.split(","))
    for r in runs:
        st = r["stats"]
        assert st["failed"] == 0 and st["throughput_rps"] > 0, st  # all served, everywhere
    assert report["meta"]["default_policy"] == "sloserve-ngram:specserve-slo:per-request"
    logs = out / "server_logs"
    assert sorted(p.name for p in logs.glob("*.log")) == sorted(
        f"{s.replace(':', '-')}.log" for s in systems.split(","))
    spec = (logs / "sloserve-ngram-specserve-slo-per-request.log").read_text(errors="replace")
    plain = (logs / "plain.log").read_text(errors="replace")
    assert "--speculative-algorithm SPECSERVE" in spec
    assert "--speculative-algorithm" not in plain
    # --timings: SPECSERVE's server wrote a line per decode step, the stall between steps
    # its SLO rule learnt among them (request_clock.StepStalls); SGLang's plain server none
    assert sorted(p.name for p in logs.glob("*.timings.jsonl")) == [
        "sloserve-ngram-specserve-slo-per-request.timings.jsonl"]
    rows = [json.loads(line) for line in
            (logs / "sloserve-ngram-specserve-slo-per-request.timings.jsonl").read_text()
            .splitlines()]
    assert rows and all(r["stall"] >= 0.0 for r in rows)
    assert any(r["stall"] > 0.0 for r in rows)  # 8 requests' prefills between decode steps
    # greedy steps that drafted nothing ran as plain decode steps (worker._decode_step),
    # and only those
    assert all(r["decode"] == (r["k"] == 0) for r in rows)
    assert any(r["decode"] for r in rows), [r["k"] for r in rows]
    records = [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines()]
    assert len(records) == 1 + len(runs)  # the capacity probe and every run, checkpointed
    # --step-clock: every server's clock (plain's too); each run's record says where the
    # time between its decode steps went, its 8 prefills among it, and what they read:
    # whole prompts, every run starting from an empty prefix cache (without the flush
    # plain's run read ~1 token a request: the warm-up and the capacity probe, run on
    # plain's server alone, had cached its prompts)
    assert sorted(p.name for p in logs.glob("*.clock.txt")) == sorted(
        f"{s.replace(':', '-')}.clock.txt" for s in systems.split(","))
    for rec in records[1:]:
        gaps = rec["step_clock"]
        assert gaps["decode_steps"] > 1 and gaps["decode_s"] > 0, rec["key"]
        assert 0 < gaps["prefill_s"] <= gaps["gap_s"], rec["key"]
        assert gaps["prefill_tokens"] > 8 * 4, rec
        assert gaps["max_gap_s"] <= gaps["gap_s"]
