"""Trace formats: parsing, detection, and clear errors with line numbers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sloserve.replay.formats import detect_format, load_trace, write_native
from sloserve.replay.trace import TraceFormatError, TraceRequest


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


AZURE = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:46.6805900,374,44
2023-11-16 18:15:50.9951690,396,109
2023-11-16 18:15:46.6805901,10,1
"""


def test_azure_parses_7_digit_fractions_and_sorts(tmp_path):
    reqs = load_trace(write(tmp_path, "a.csv", AZURE))
    assert [r.input_tokens for r in reqs] == [374, 10, 396]
    assert reqs[0].arrival_s == 0.0
    assert reqs[1].arrival_s == pytest.approx(1e-7, abs=1e-9)  # 100 ns resolution kept
    assert reqs[2].arrival_s == pytest.approx(50.9951690 - 46.6805900, abs=1e-9)
    assert reqs[2].output_tokens == 109 and reqs[2].category is None


def test_azure_2024_timezone_suffix_and_midnight(tmp_path):
    text = ("TIMESTAMP,ContextTokens,GeneratedTokens\n"
            "2024-05-10 23:59:59.500000+00:00,5,6\n"
            "2024-05-11 00:00:00.250000+00:00,7,8\n"
            "2024-05-11 02:00:01.000000+02:00,9,10\n")
    reqs = load_trace(write(tmp_path, "a.csv", text))
    assert [r.arrival_s for r in reqs] == pytest.approx([0.0, 0.75, 1.5])


@pytest.mark.parametrize("row, problem", [
    ("2023-11-16 18:15:46.68,abc,3", "ContextTokens must be a non-negative integer"),
    ("2023-11-16 18:15:46.68,-4,3", "ContextTokens must be a non-negative integer"),
    ("yesterday,4,3", "TIMESTAMP is not a datetime"),
    ("2023-13-16 18:15:46.68,4,3", "TIMESTAMP"),
    ("2023-11-16 18:15:46.68,4", "expected 3 fields, got 2"),
])
def test_azure_malformed_rows_name_file_and_line(tmp_path, row, problem):
    path = write(tmp_path, "bad.csv", AZURE + row + "\n")
    with pytest.raises(TraceFormatError) as e:
        load_trace(path)
    assert e.value.line == 5
    assert str(e.value).startswith(f"{path}:5: ")
    assert problem in str(e.value)


def test_csv_missing_column(tmp_path):
    path = write(tmp_path, "x.csv", "TIMESTAMP,ContextTokens\n2023-11-16 18:15:46.68,4\n")
    with pytest.raises(TraceFormatError, match="unrecognised CSV header"):
        load_trace(path)
    with pytest.raises(TraceFormatError, match=r"x\.csv:1: header lacks column\(s\)"):
        load_trace(path, "azure")


BURST = """Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type
5,ChatGPT,472,18,490,Conversation log
45,ChatGPT,1087,0,1087,Conversation log
18.5,GPT-4,417,304,721,API log
"""


def test_burstgpt(tmp_path):
    reqs = load_trace(write(tmp_path, "b.csv", BURST))
    assert [(r.arrival_s, r.input_tokens, r.output_tokens, r.category) for r in reqs] == [
        (5.0, 472, 18, "ChatGPT"), (18.5, 417, 304, "GPT-4"), (45.0, 1087, 0, "ChatGPT")]


def test_burstgpt_reordered_columns_and_bad_row(tmp_path):
    text = ("Log Type,Timestamp,Request tokens,Response tokens,Total tokens,Model\n"
            "API log,3,10,20,30,GPT-4\n"
            "API log,x,10,20,30,GPT-4\n")
    path = write(tmp_path, "b.csv", text)
    assert detect_format(path) == "burstgpt"
    with pytest.raises(TraceFormatError, match=r"b\.csv:3: Timestamp must be a finite"):
        load_trace(path)


def mooncake_line(ts: float, i: int, o: int, hashes: list[int]) -> str:
    return json.dumps({"timestamp": ts, "input_length": i, "output_length": o,
                       "hash_ids": hashes}) + "\n"


def test_mooncake(tmp_path):
    text = mooncake_line(0, 1000, 5, [0, 1]) + "\n" + mooncake_line(1500, 600, 7, [0, 2])
    reqs = load_trace(write(tmp_path, "m.jsonl", text))
    assert reqs[1] == TraceRequest(1.5, 600, 7, None, (0, 2))
    assert detect_format(tmp_path / "m.jsonl") == "mooncake"


@pytest.mark.parametrize("bad, problem", [
    ("{not json\n", "invalid JSON"),
    ("[1, 2]\n", "expected a JSON object"),
    ('{"timestamp": 3, "input_length": 4}\n', "missing key 'output_length'"),
    ('{"timestamp": -3, "input_length": 4, "output_length": 1}\n', "timestamp must be"),
    ('{"timestamp": 3, "input_length": 4.5, "output_length": 1}\n', "input_length must be"),
    ('{"timestamp": 3, "input_length": 4, "output_length": 1, "hash_ids": 7}\n',
     "hash_ids must be a list"),
])
def test_mooncake_malformed(tmp_path, bad, problem):
    path = write(tmp_path, "m.jsonl", mooncake_line(0, 1, 1, []) + bad)
    with pytest.raises(TraceFormatError) as e:
        load_trace(path, "mooncake")
    assert e.value.line == 2 and problem in str(e.value) and str(path) in str(e.value)


def test_native_round_trip(tmp_path):
    reqs = [TraceRequest(0.0, 10, 3), TraceRequest(0.25, 20, 4, "qa", (1, 2), 0.5, 0.05)]
    path = tmp_path / "n.jsonl"
    write_native(path, reqs)
    assert detect_format(path) == "native"
    assert load_trace(path) == reqs


@pytest.mark.parametrize("bad, problem", [
    ('{"arrival_s": 1, "input_tokens": 2, "output_tokens": 3, "prompt": "hi"}',
     "unknown key(s) ['prompt']"),
    ('{"arrival_s": 1, "input_tokens": 2}', "missing key 'output_tokens'"),
    ('{"arrival_s": 1, "input_tokens": 2, "output_tokens": 3, "category": 5}', "category"),
    ('{"arrival_s": 1, "input_tokens": 2, "output_tokens": 3, "tpot_slo_ms": 0}',
     "tpot_slo_ms must be > 0"),
    ('{"arrival_s": "soon", "input_tokens": 2, "output_tokens": 3}', "arrival_s must be"),
    ('{"arrival_s": 1, "input_tokens": true, "output_tokens": 3}', "input_tokens must be"),
])
def test_native_malformed(tmp_path, bad, problem):
    good = '{"arrival_s": 0, "input_tokens": 2, "output_tokens": 3}\n'
    path = write(tmp_path, "n.jsonl", good + good + bad + "\n")
    with pytest.raises(TraceFormatError) as e:
        load_trace(path)
    assert e.value.line == 3 and problem in str(e.value)


def test_detection_errors_and_override(tmp_path):
    with pytest.raises(TraceFormatError, match="empty file"):
        load_trace(write(tmp_path, "e.jsonl", "\n\n"))
    with pytest.raises(TraceFormatError, match="unrecognised JSONL record keys"):
        load_trace(write(tmp_path, "u.jsonl", '{"foo": 1}\n'))
    with pytest.raises(ValueError, match="unknown trace format"):
        load_trace(write(tmp_path, "a.csv", AZURE), "parquet")
    with pytest.raises(TraceFormatError, match="no requests"):
        load_trace(write(tmp_path, "h.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n"))
    # explicit override wins over the extension
    path = write(tmp_path, "trace.txt", mooncake_line(0, 1, 1, []))
    assert load_trace(path, "mooncake")[0].input_tokens == 1
    assert detect_format(path) == "mooncake"
    with pytest.raises(FileNotFoundError):
        load_trace(tmp_path / "missing.csv")
