"""Report writer: files exist, the JSON round-trips, the markdown has the columns."""

from __future__ import annotations

import json

import pytest

from sloserve.replay.metrics import SloConfig
from sloserve.replay.plots import cell_slug
from sloserve.replay.records import PolicyRun, RequestRecord, SpecStats, StepSample
from sloserve.replay.report import (
    Cell,
    build_report,
    load_report,
    render_markdown,
    write_report,
)
from sloserve.replay.shaping import Scaling

SLO = SloConfig()


def record(i: int, ttft: float, step: float, n: int) -> RequestRecord:
    t0 = 0.1 * i
    times = tuple(t0 + ttft + step * k for k in range(n))
    return RequestRecord(f"r{i}", t0, t0, times[-1] + 0.001, times, tuple(range(1, n + 1)),
                         prompt_tokens=8, output_tokens=n)


def make_cells() -> list[Cell]:
    ar = PolicyRun("ar", tuple(record(i, 0.1, 0.03, 5) for i in range(20)),
                   SpecStats(steps=100))
    series = tuple(StepSample(0.05 * k, 1 + k % 4, 2.0 + (k % 3)) for k in range(40))
    spec = PolicyRun("specserve", tuple(record(i, 0.1, 0.015, 5) for i in range(20)),
                     SpecStats(50, 100, 300, 250, 150, 0.01, series))
    failed = RequestRecord("bad", 0.0, 0.0, 0.2, success=False, error="HTTP 500")
    spec_fail = PolicyRun("fixed3", (failed, *spec.records[1:]))
    scaling = Scaling(duration_s=60, time_scale=2, input_scale=0.1, output_max=256)
    return [
        Cell("azure_conv", "rate=1/s", (ar, spec, spec_fail), scaling,
             {"num_requests": 20, "span_s": 1.9, "rate_rps": 10.0, "mean_input_tokens": 8.0,
              "mean_output_tokens": 5.0}),
        Cell("poisson", "time x1", (ar,), None, None),
    ]


def test_write_report_files_and_round_trip(tmp_path):
    cells = make_cells()
    files = write_report(tmp_path / "out", cells, SLO, meta={"note": "test"})
    assert files.json.is_file() and files.markdown.is_file()
    assert len(files.plots) == 6
    for png in files.plots:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    loaded = load_report(files.json)
    expected = json.loads(json.dumps(build_report(cells, SLO, {"note": "test"})))
    assert loaded == expected
    assert render_markdown(loaded) == files.markdown.read_text()
    lines = files.records.read_text().splitlines()
    assert len(lines) == 20 * 3 + 20
    row = json.loads(lines[0])
    assert (row["trace"], row["policy"], row["request_id"]) == ("azure_conv", "ar", "r0")
    assert RequestRecord.from_dict({k: v for k, v in row.items()
                                    if k not in ("trace", "load", "policy")}) == \
        cells[0].runs[0].records[0]


def test_report_content():
    report = build_report(make_cells(), SLO)
    cell = report["cells"][0]
    assert [r["policy"] for r in cell["runs"]] == ["ar", "specserve", "fixed3"]
    ar, spec, fixed = cell["runs"]
    assert ar["speedup"] == pytest.approx(1.0)
    assert spec["speedup"] == pytest.approx((100 + 120) / (100 + 60))  # mean E2E ratio
    assert spec["spec"]["acceptance_rate"] == pytest.approx(0.5)
    assert spec["spec"]["mean_accepted_len"] == pytest.approx(2.5)
    assert fixed["failed"] == 1 and fixed["requests"][0]["error"] == "HTTP 500"
    assert len(spec["spec_stats"]["timeseries"]) == 40
    assert cell["scaling"]["time_scale"] == 2 and "time x2" in cell["scaling_text"]
    assert report["cells"][1]["scaling_text"] == "none"
    assert report["slo"] == {"ttft_ms": 200.0, "tpot_ms": 30.0,
                             "scales": [0.8, 0.9, 1.0, 1.1, 1.2, 1.3, 1.4],
                             "speedup_baseline": "ar"}
    json.dumps(report, allow_nan=False)  # strict JSON: no NaN anywhere


def test_markdown_columns():
    md = render_markdown(json.loads(json.dumps(build_report(make_cells(), SLO))))
    assert "## azure_conv / rate=1/s" in md and "## poisson / time x1" in md
    header = next(line for line in md.splitlines() if line.startswith("| policy | ok/sent"))
    for col in ("TTFT mean ms", "TTFT p99 ms", "TPOT mean ms", "TPOT p99 ms", "ITL mean ms",
                "E2E mean ms", "E2E p99 ms", "SLO att.", "goodput req/s", "speedup",
                "acc. rate", "acc. len", "mean k"):
        assert f"| {col} |" in header
    assert "| specserve | 20/20 |" in md and "| fixed3 | 19/20 |" in md
    assert "| policy | x0.8 | x0.9 | x1 | x1.1 | x1.2 | x1.3 | x1.4 |" in md
    assert "Scaling: window 0s+60s" in md
    assert "TPOT 30 ms" in md


def test_cell_slug_and_schema_check(tmp_path):
    assert cell_slug({"trace": "azure conv", "load": "rate=0.5/s"}) == "azure_conv__rate_0.5_s"
    bad = tmp_path / "x.json"
    bad.write_text("{}")
    with pytest.raises(ValueError, match="not a"):
        load_report(bad)
