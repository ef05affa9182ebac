"""Trace file formats -> lists of `TraceRequest` sorted by arrival (see traces/README.md).

Supported formats (name: what the file looks like):

- "azure": Azure LLM inference trace 2023/2024 CSV, header `TIMESTAMP,ContextTokens,
  GeneratedTokens`; TIMESTAMP is a UTC datetime such as `2023-11-16 18:15:46.6805900` (7
  fractional digits; an optional `+00:00` suffix as in the 2024 trace). Arrivals are
  relative to the earliest timestamp in the file.
- "mooncake": Mooncake JSONL, `{"timestamp": ms, "input_length", "output_length",
  "hash_ids": [...]}`; timestamps are milliseconds from the trace start.
- "burstgpt": BurstGPT CSV, header `Timestamp,Model,Request tokens,Response tokens,
  Total tokens,Log Type`; Timestamp is seconds from the trace start; category = Model
  (e.g. "ChatGPT", "GPT-4"). Failed requests have `Response tokens` = 0 and are kept (the
  shaping clamp `output_min` decides what they become).
- "native": sloserve JSONL, `{"arrival_s", "input_tokens", "output_tokens"}` plus optional
  `category`, `prefix_hash_ids`, `ttft_slo_ms`, `tpot_slo_ms`; unknown keys are an error.

Columns are found by header name (order does not matter); extra columns or keys of the
external formats are ignored. Any malformed row raises `TraceFormatError` with file and line.
"""

from __future__ import annotations

import csv
import json
import re
from collections.abc import Callable, Iterator, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from sloserve.replay.trace import TraceFormatError, TraceRequest, sort_by_arrival

FORMATS = ("azure", "mooncake", "burstgpt", "native")

AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
BURSTGPT_COLUMNS = ("Timestamp", "Model", "Request tokens", "Response tokens")
NATIVE_KEYS = frozenset(
    {"arrival_s", "input_tokens", "output_tokens", "category", "prefix_hash_ids",
     "ttft_slo_ms", "tpot_slo_ms"}
)

_AZURE_TIME = re.compile(
    r"^(\d{4}-\d{2}-\d{2})[ T](\d{2}:\d{2}:\d{2})(?:\.(\d+))?(Z|[+-]\d{2}:?\d{2})?$"
)


def load_trace(path: str | Path, fmt: str = "auto") -> list[TraceRequest]:
    """Load a trace file in format `fmt` ("auto" detects it from extension and header)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"trace file not found: {path}")
    if fmt == "auto":
        fmt = detect_format(path)
    loaders: dict[str, Callable[[Path], list[TraceRequest]]] = {
        "azure": load_azure, "mooncake": load_mooncake,
        "burstgpt": load_burstgpt, "native": load_native,
    }
    if fmt not in loaders:
        raise ValueError(f"unknown trace format {fmt!r}; expected auto or one of {FORMATS}")
    requests = loaders[fmt](path)
    if not requests:
        raise TraceFormatError(path, None, "the trace holds no requests")
    return requests


def detect_format(path: str | Path) -> str:
    """Guess the format from the extension and the header / first record."""
    path = Path(path)
    first = _first_nonblank_line(path)
    if first is None:
        raise TraceFormatError(path, None, "empty file, cannot detect the trace format")
    lineno, text = first
    if path.suffix.lower() in (".jsonl", ".json") or text.lstrip().startswith("{"):
        obj = _parse_json_object(path, lineno, text)
        if "arrival_s" in obj:
            return "native"
        if "timestamp" in obj and "input_length" in obj:
            return "mooncake"
        raise TraceFormatError(path, lineno, f"unrecognised JSONL record keys {sorted(obj)}")
    header = next(csv.reader([text]))
    if all(c in header for c in AZURE_COLUMNS):
        return "azure"
    if all(c in header for c in BURSTGPT_COLUMNS):
        return "burstgpt"
    raise TraceFormatError(path, lineno, f"unrecognised CSV header {header}")


# ---- CSV formats ----------------------------------------------------------------------------


def load_azure(path: str | Path) -> list[TraceRequest]:
    """Azure LLM inference trace CSV (2023 code/conv, 2024 week-long)."""
    raw: list[tuple[int, float, int, int]] = []  # (whole seconds, fraction, input, output)
    for line, row in _csv_rows(path, AZURE_COLUMNS):
        secs, frac = _parse_azure_time(path, line, row["TIMESTAMP"])
        raw.append((secs, frac, _int(path, line, "ContextTokens", row["ContextTokens"]),
                    _int(path, line, "GeneratedTokens", row["GeneratedTokens"])))
    if not raw:
        return []
    # Relative times from integer seconds + fraction: epoch seconds as floats lose precision.
    s0, f0 = min((s, f) for s, f, _, _ in raw)
    reqs = [TraceRequest((s - s0) + (f - f0), i, o) for s, f, i, o in raw]
    return sort_by_arrival(reqs)


def load_burstgpt(path: str | Path) -> list[TraceRequest]:
    """BurstGPT CSV (Timestamp in seconds, Model used as category)."""
    reqs = []
    for line, row in _csv_rows(path, BURSTGPT_COLUMNS):
        t = _float(path, line, "Timestamp", row["Timestamp"])
        model = row["Model"].strip() or None
        reqs.append(TraceRequest(
            t, _int(path, line, "Request tokens", row["Request tokens"]),
            _int(path, line, "Response tokens", row["Response tokens"]), category=model,
        ))
    return sort_by_arrival(reqs)


def _csv_rows(path: str | Path, required: Sequence[str]) -> Iterator[tuple[int, dict[str, str]]]:
    """Yield (line number, {column: value}) for each non-empty data row."""
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None:
            raise TraceFormatError(path, None, "empty file")
        header = [h.strip() for h in header]
        missing = [c for c in required if c not in header]
        if missing:
            raise TraceFormatError(path, 1, f"header lacks column(s) {missing}; got {header}")
        for row in reader:
            if not row or all(not c.strip() for c in row):
                continue
            if len(row) != len(header):
                raise TraceFormatError(
                    path, reader.line_num, f"expected {len(header)} fields, got {len(row)}"
                )
            yield reader.line_num, dict(zip(header, row))


def _parse_azure_time(path: str | Path, line: int, text: str) -> tuple[int, float]:
    m = _AZURE_TIME.match(text.strip())
    if m is None:
        raise TraceFormatError(path, line, f"TIMESTAMP is not a datetime: {text!r}")
    date, clock, frac, tz = m.groups()
    try:
        dt = datetime.fromisoformat(f"{date} {clock}")
    except ValueError as e:
        raise TraceFormatError(path, line, f"TIMESTAMP {text!r}: {e}") from None
    if tz and tz != "Z":
        sign = 1 if tz[0] == "+" else -1
        digits = tz[1:].replace(":", "")
        offset = sign * (int(digits[:2]) * 3600 + int(digits[2:]) * 60)
    else:
        offset = 0
    whole = int(dt.replace(tzinfo=timezone.utc).timestamp()) - offset
    return whole, float(f"0.{frac}") if frac else 0.0


# ---- JSONL formats --------------------------------------------------------------------------


def load_mooncake(path: str | Path) -> list[TraceRequest]:
    """Mooncake JSONL (timestamp in ms, hash_ids = 512-token prefix block ids)."""
    reqs = []
    for line, obj in _jsonl_objects(path):
        for key in ("timestamp", "input_length", "output_length"):
            if key not in obj:
                raise TraceFormatError(path, line, f"missing key {key!r}")
        ts = _float(path, line, "timestamp", obj["timestamp"])
        hashes = _hash_ids(path, line, "hash_ids", obj.get("hash_ids"))
        reqs.append(TraceRequest(
            ts / 1000.0, _int(path, line, "input_length", obj["input_length"]),
            _int(path, line, "output_length", obj["output_length"]), prefix_hash_ids=hashes,
        ))
    return sort_by_arrival(reqs)


def load_native(path: str | Path) -> list[TraceRequest]:
    """sloserve-native JSONL (see the module docstring)."""
    reqs = []
    for line, obj in _jsonl_objects(path):
        unknown = sorted(set(obj) - NATIVE_KEYS)
        if unknown:
            raise TraceFormatError(path, line, f"unknown key(s) {unknown}")
        for key in ("arrival_s", "input_tokens", "output_tokens"):
            if key not in obj:
                raise TraceFormatError(path, line, f"missing key {key!r}")
        category = obj.get("category")
        if category is not None and not isinstance(category, str):
            raise TraceFormatError(path, line, f"category must be a string or null: {category!r}")
        reqs.append(TraceRequest(
            _float(path, line, "arrival_s", obj["arrival_s"]),
            _int(path, line, "input_tokens", obj["input_tokens"]),
            _int(path, line, "output_tokens", obj["output_tokens"]),
            category=category,
            prefix_hash_ids=_hash_ids(path, line, "prefix_hash_ids", obj.get("prefix_hash_ids")),
            ttft_slo_s=_slo(path, line, "ttft_slo_ms", obj.get("ttft_slo_ms")),
            tpot_slo_s=_slo(path, line, "tpot_slo_ms", obj.get("tpot_slo_ms")),
        ))
    return sort_by_arrival(reqs)


def write_native(path: str | Path, requests: Sequence[TraceRequest]) -> None:
    """Write requests as sloserve-native JSONL (arrivals rounded to microseconds)."""
    with open(path, "w", encoding="utf-8") as f:
        for r in requests:
            obj: dict[str, Any] = {
                "arrival_s": round(r.arrival_s, 6),
                "input_tokens": r.input_tokens,
                "output_tokens": r.output_tokens,
            }
            if r.category is not None:
                obj["category"] = r.category
            if r.prefix_hash_ids is not None:
                obj["prefix_hash_ids"] = list(r.prefix_hash_ids)
            if r.ttft_slo_s is not None:
                obj["ttft_slo_ms"] = round(r.ttft_slo_s * 1000.0, 6)
            if r.tpot_slo_s is not None:
                obj["tpot_slo_ms"] = round(r.tpot_slo_s * 1000.0, 6)
            f.write(json.dumps(obj) + "\n")


def _jsonl_objects(path: str | Path) -> Iterator[tuple[int, dict[str, Any]]]:
    with open(path, encoding="utf-8") as f:
        for line, text in enumerate(f, start=1):
            if text.strip():
                yield line, _parse_json_object(path, line, text)


def _parse_json_object(path: str | Path, line: int, text: str) -> dict[str, Any]:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise TraceFormatError(path, line, f"invalid JSON: {e.msg}") from None
    if not isinstance(obj, dict):
        raise TraceFormatError(path, line, f"expected a JSON object, got {type(obj).__name__}")
    return obj


def _first_nonblank_line(path: Path) -> tuple[int, str] | None:
    with open(path, encoding="utf-8") as f:
        for line, text in enumerate(f, start=1):
            if text.strip():
                return line, text.strip()
    return None


# ---- field parsing --------------------------------------------------------------------------


def _int(path: str | Path, line: int, name: str, value: Any) -> int:
    """A non-negative integer from a CSV string or a JSON number (integral floats allowed)."""
    try:
        if isinstance(value, bool):
            raise TypeError
        number = float(value.strip()) if isinstance(value, str) else float(value)
        if not number.is_integer() or number < 0:
            raise ValueError
    except (TypeError, ValueError):
        raise TraceFormatError(
            path, line, f"{name} must be a non-negative integer, got {value!r}"
        ) from None
    return int(number)


def _float(path: str | Path, line: int, name: str, value: Any) -> float:
    """A finite non-negative number."""
    try:
        if isinstance(value, bool):
            raise TypeError
        number = float(value.strip()) if isinstance(value, str) else float(value)
        if not (0.0 <= number < float("inf")):
            raise ValueError
    except (TypeError, ValueError):
        raise TraceFormatError(
            path, line, f"{name} must be a finite non-negative number, got {value!r}"
        ) from None
    return number


def _slo(path: str | Path, line: int, name: str, value: Any) -> float | None:
    if value is None:
        return None
    ms = _float(path, line, name, value)
    if ms == 0:
        raise TraceFormatError(path, line, f"{name} must be > 0, got {value!r}")
    return ms / 1000.0


def _hash_ids(path: str | Path, line: int, name: str, value: Any) -> tuple[int, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise TraceFormatError(path, line, f"{name} must be a list of integers, got {value!r}")
    return tuple(_int(path, line, f"{name}[{i}]", v) for i, v in enumerate(value))
