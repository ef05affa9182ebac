"""Generate the small synthetic traces shipped in traces/ (deterministic from a seed).

    python -m sloserve.replay.make_traces [--out-dir traces] [--seed 0] [--check]

--check regenerates in memory and exits 1 if a committed file differs (for CI).
Lengths are CPU-sized: prompts ~128 tokens, outputs ~64 tokens (lognormal).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sloserve.replay.formats import write_native
from sloserve.replay.specbench import SPEC_BENCH_TASKS
from sloserve.replay.synthetic import (
    LogNormalLength,
    gamma_arrivals,
    synthetic_trace,
)
from sloserve.replay.trace import TraceRequest


@dataclass(frozen=True)
class TraceSpec:
    """One generated trace: Gamma arrivals (cv = 1 is Poisson) and lognormal lengths."""

    name: str
    rate: float
    cv: float
    num_requests: int
    input_len: LogNormalLength
    output_len: LogNormalLength
    categories: tuple[str, ...] | None = None


INPUT_LEN = LogNormalLength(median=128, sigma=0.6, low=16, high=1024)
OUTPUT_LEN = LogNormalLength(median=64, sigma=0.6, low=8, high=512)

TRACE_SPECS = (
    TraceSpec("poisson_r2_n200", 2.0, 1.0, 200, INPUT_LEN, OUTPUT_LEN),
    TraceSpec("gamma_cv2_r2_n200", 2.0, 2.0, 200, INPUT_LEN, OUTPUT_LEN),
    TraceSpec("specbench_mix_poisson_r1_n120", 1.0, 1.0, 120, INPUT_LEN, OUTPUT_LEN,
              categories=SPEC_BENCH_TASKS),
)


def generate(spec: TraceSpec, seed: int, index: int) -> list[TraceRequest]:
    """The requests of one trace; the rng depends only on (seed, index of the spec)."""
    rng = np.random.default_rng([seed, index])
    arrivals = gamma_arrivals(spec.rate, spec.cv, spec.num_requests, rng)
    return synthetic_trace(arrivals, spec.input_len, spec.output_len, rng, spec.categories)


def write_all(out_dir: Path, seed: int) -> list[Path]:
    """Write every trace of TRACE_SPECS as <name>.jsonl in out_dir."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, spec in enumerate(TRACE_SPECS):
        path = out_dir / f"{spec.name}.jsonl"
        write_native(path, generate(spec, seed, i))
        paths.append(path)
    return paths


def check(out_dir: Path, seed: int) -> list[str]:
    """Names of committed traces that differ from a fresh generation."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = write_all(Path(tmp), seed)
        return [p.name for p in fresh
                if not (out_dir / p.name).is_file()
                or (out_dir / p.name).read_bytes() != p.read_bytes()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    parser.add_argument("--out-dir", type=Path, default=Path("traces"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--check", action="store_true",
                        help="verify the committed traces instead of writing them")
    args = parser.parse_args(argv)
    if args.check:
        stale = check(args.out_dir, args.seed)
        for name in stale:
            print(f"stale or missing: {args.out_dir / name}", file=sys.stderr)
        return 1 if stale else 0
    for path in write_all(args.out_dir, args.seed):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
