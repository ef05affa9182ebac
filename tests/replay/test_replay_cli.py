"""The CLI (python -m sloserve.replay) and the committed synthetic traces."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sloserve.cli.replay import build_parser, main, policy_urls
from sloserve.replay.formats import load_trace
from sloserve.replay.make_traces import TRACE_SPECS, check, generate

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_committed_traces_match_the_generator():
    assert check(REPO_ROOT / "traces", seed=0) == []
    for spec in TRACE_SPECS:
        reqs = load_trace(REPO_ROOT / "traces" / f"{spec.name}.jsonl")
        assert len(reqs) == spec.num_requests
    assert generate(TRACE_SPECS[0], 0, 0) == generate(TRACE_SPECS[0], 0, 0)


def test_dry_run_on_a_committed_trace(capsys):
    trace = REPO_ROOT / "traces" / "gamma_cv2_r2_n200.jsonl"
    assert main(["--trace", str(trace), "--target-rate", "1,4", "--max-requests", "50",
                 "--input-scale", "0.5", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "[gamma_cv2_r2_n200 / rate=1/s]" in out and "[gamma_cv2_r2_n200 / rate=4/s]" in out
    assert "first 50 requests" in out and "input x0.5" in out


def test_inprocess_replay_end_to_end(tiny_pair, tmp_path):
    """The whole tool on the real engine (tiny pair): two policies, same requests, report."""
    out = tmp_path / "rep"
    argv = ["--synthetic", "poisson", "--arrival-rate", "20", "--num-requests", "10",
            "--input-len", "uniform:8:40", "--output-len", "fixed:12", "--prompts", "synthetic-ids",
            "--vocab-size", "2048", "--id-low", "10", "--target", "inprocess",
            "--model-path", tiny_pair[0], "--draft-model-path", tiny_pair[1], "--dtype", "float32",
            "--policies", "ar,fixed:3", "--no-progress", "--no-plots", "--out", str(out)]
    assert main(argv) == 0
    report = json.loads((out / "report.json").read_text())
    text = json.dumps(report)
    assert '"fixed:3"' in text and '"ar"' in text
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    assert len(records) == 20 and all(r["success"] and r["output_tokens"] == 12 for r in records)


def test_policy_urls():
    assert policy_urls(["http://h:1"], ["ar", "k3"]) == {"ar": "http://h:1", "k3": "http://h:1"}
    assert policy_urls(["ar=http://h:1", "http://h:2"], ["ar", "k3"]) == {
        "ar": "http://h:1", "k3": "http://h:2"}
    with pytest.raises(SystemExit):
        policy_urls(["zz=http://h:1"], ["ar"])


def test_parser_covers_all_option_groups():
    help_text = build_parser().format_help()
    for opt in ("--trace", "--trace-format", "--synthetic", "--cv", "--start-s", "--duration-s",
                "--time-scale", "--target-rate", "--input-scale", "--output-max",
                "--max-requests", "--seed", "--prompts", "--spec-bench", "--vocab-size",
                "--ttft-slo-ms", "--tpot-slo-ms", "--slo-scales", "--policies", "--target",
                "--url", "--out", "--no-plots", "--dry-run"):
        assert opt in help_text


def test_end_to_end_against_the_fake_server(fake_sglang, tmp_path, capsys):
    fake_sglang.ttft_s, fake_sglang.itl_s = 0.01, 0.002
    out = tmp_path / "report"
    argv = ["--synthetic", "poisson", "--arrival-rate", "50", "--num-requests", "6",
            "--input-len", "fixed:8", "--output-len", "fixed:4", "--vocab-size", "100",
            "--policies", "ar,fixed3", "--url", fake_sglang.url, "--out", str(out),
            "--no-progress", "--no-plots", "--write-trace", str(tmp_path / "shaped")]
    assert main(argv) == 0
    report = json.loads((out / "report.json").read_text())
    (cell,) = report["cells"]
    assert [r["policy"] for r in cell["runs"]] == ["ar", "fixed3"]
    assert all(r["completed"] == 6 and r["failed"] == 0 for r in cell["runs"])
    assert cell["scaling"]["seed"] == 0 and report["meta"]["argv"] == argv
    assert len(fake_sglang.received) == 12
    assert all(len(b["input_ids"]) == 8 for _, b in fake_sglang.received)
    assert "| ar | 6/6 |" in capsys.readouterr().out
    assert len(list((tmp_path / "shaped").glob("*.jsonl"))) == 1
