"""Durations with units, the one way SLOs are written on command lines.

A bare number is refused: on the command line it used to mean milliseconds while the HTTP API
takes SLOs in seconds (`tpot_slo: 0.05`), so `--tpot-slo 0.03` silently meant 30 microseconds.
The API's meaning (seconds) is unchanged; the command line now says its unit.
"""

from __future__ import annotations

import argparse
import math
import re

_DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(ms|s)\s*$")
FORMS = "a positive number with its unit: ms or s, e.g. 30ms or 0.03s"


def duration(text: str) -> float:
    """Seconds from '30ms' or '0.03s' (argparse type; a bare number is an error)."""
    m = _DURATION.match(text)
    value = float(m.group(1)) if m else math.nan
    if not m or not math.isfinite(value) or value <= 0:
        bare = re.fullmatch(r"\s*[0-9.]+\s*", text) is not None
        why = " (a bare number has no unit)" if bare else ""
        raise argparse.ArgumentTypeError(f"invalid duration {text!r}{why}: use {FORMS}")
    return value if m.group(2) == "s" else value / 1000.0
