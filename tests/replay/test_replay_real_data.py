"""The real public traces in ../shared/data (skipped when absent), checked against its README."""

from __future__ import annotations

import pytest

from sloserve.replay.formats import detect_format, load_trace
from sloserve.replay.specbench import SPEC_BENCH_TASKS, load_spec_bench
from sloserve.replay.trace import describe


@pytest.mark.parametrize("name, fmt, count, median_in, median_out, minutes", [
    ("azure_llm_2023_code.csv", "azure", 8819, 1469, 13, 57),
    ("azure_llm_2023_conv.csv", "azure", 19366, 1020, 129, 58),
    ("mooncake_synthetic.jsonl", "mooncake", 3993, None, None, None),
])
def test_real_traces(data_dir, name, fmt, count, median_in, median_out, minutes):
    path = data_dir / "traces" / name
    assert detect_format(path) == fmt
    reqs = load_trace(path)
    assert len(reqs) == count
    arrivals = [r.arrival_s for r in reqs]
    assert arrivals == sorted(arrivals) and arrivals[0] == 0.0
    stats = describe(reqs)
    if median_in is not None:
        assert stats["median_input_tokens"] == median_in
        assert stats["median_output_tokens"] == median_out
        assert abs(stats["span_s"] / 60.0 - minutes) < 1.5
    if fmt == "mooncake":
        assert all(r.prefix_hash_ids for r in reqs)
        assert reqs[0].prefix_hash_ids[:3] == (0, 1, 2)


def test_real_spec_bench(data_dir):
    questions = load_spec_bench(data_dir / "prompts" / "spec_bench_questions.jsonl")
    assert len(questions) == 480
    tasks = {t: sum(q.task == t for q in questions) for t in SPEC_BENCH_TASKS}
    assert tasks == {t: 80 for t in SPEC_BENCH_TASKS}
    mt = [q for q in questions if q.task == "mt_bench"]
    assert {q.question_id for q in mt} == set(range(81, 161))
    assert all(len(q.turns) == 2 for q in mt)
