"""CPU fast path for linear layers: oneDNN weights prepacked once at load time.

On this class of CPU, oneDNN's packed fp32 linear is 1.4-2.7x faster than MKL's F.linear for
8-32 rows (measured: python -m sloserve.bench.engine), 2-4x faster for 2-4 rows and 1.0-1.3x
for one row, so it is used for every row count. Same fp32 math; only the accumulation order
differs (rounding-level). Where one to three rows measured slower than four on the machine,
such products run padded to four rows (PAD_TO below).
"""

from __future__ import annotations

import fcntl
import functools
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from sloserve.estimator.profile_lookup import device_key

log = logging.getLogger(__name__)

PACK_ROWS = 32  # packing hint: the batch size the layout is tuned for (any size works)

# Products of fewer than PAD_TO rows may run padded with zero rows to PAD_TO: on the 2-core
# AMD EPYC with AVX-512 (torch 2.13, 2 threads) oneDNN's packed float32 kernel took longer for
# one or two rows than for three to six (SmolLM2-135M's 30 layers' linears and head: 26.2 /
# 28.4 / 23.8 / 22.8 ms at 1 / 2 / 3 / 4 rows; padded to 4: 24.0 / 23.9), and a one-draft
# verify at batch 1 cost SGLang 6.4 ms more than a decode (BENCHMARKS.md, 2026-12-05). Which
# row counts pay is the machine's: measured once (`padded_row_counts`) and kept in a file
# every process of the machine reads, so two servers never compute one row two ways (the
# padded product sums in the M >= 2 kernel's order, one row alone may not).
PAD_TO = 4
PAD_ENV = "SLOSERVE_CPU_PAD_ROWS"
PAD_SETTINGS = ("auto", "on", "off")
PAD_MARGIN = 0.92  # a row count is padded only when padding measured this much faster
DECISION_TRIES = 4  # measurements of the decision at most (two in a row must agree)


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] float32 -> an opaque oneDNN tensor [N, K] laid out for packed_linear."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS)


def _product(x: torch.Tensor, packed: torch.Tensor,
             bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def packed_linear(x: torch.Tensor, packed: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] times a pack_weight() weight, plus bias: [M, N] (F.linear's product). A
    float32 product of a row count this machine pads (`padded_row_counts`) runs on PAD_TO
    rows, the first M of them real (the rest zeros, their outputs dropped)."""
    m = x.shape[0]
    if m < PAD_TO and x.dtype == torch.float32 and m in padded_row_counts():
        xp = x.new_zeros((PAD_TO, x.shape[1]))
        xp[:m] = x
        return _product(xp, packed, bias)[:m]
    return _product(x, packed, bias)


def pad_setting() -> str:
    """SLOSERVE_CPU_PAD_ROWS: auto (default: the machine's measured decision), on (pad every
    row count below PAD_TO), off. ValueError naming the variable for anything else."""
    value = os.environ.get(PAD_ENV, "auto").strip().lower() or "auto"
    if value not in PAD_SETTINGS:
        raise ValueError(f"{PAD_ENV}={value!r}: expected one of {', '.join(PAD_SETTINGS)}")
    return value


@functools.cache
def padded_row_counts() -> frozenset[int]:
    """The row counts below PAD_TO whose float32 packed products run padded in this process:
    SLOSERVE_CPU_PAD_ROWS's, or (auto) the machine's decision file's."""
    setting = pad_setting()
    if setting != "auto":
        return frozenset(range(1, PAD_TO)) if setting == "on" else frozenset()
    try:
        return machine_padding(_decision_path())
    except OSError as e:  # no cache to keep a decision in (a read-only or missing home):
        # nothing is padded, in every process alike (the unpadded product is never wrong)
        log.warning("float32 packed products not padded: no decision file (%s)", e)
        return frozenset()


def _decision_path() -> Path:
    """The machine's file: under the user's cache, not $SLOSERVE_CACHE (a test's or a run's
    model cache of its own must not give its processes a decision of their own)."""
    cache = Path.home() / ".cache" / "sloserve"
    key = device_key("cpu").replace(" ", "-").replace("/", "-").lower()
    return cache / "cpu" / f"pad-rows__{key}__torch-{torch.__version__}.json"


def machine_padding(path: Path,
                    measure: Callable[[], dict[int, float]] | None = None) -> frozenset[int]:
    """The row counts m < PAD_TO this machine pads, from the decision file at `path`, or
    measured (`measure`: {rows: seconds} for 1..PAD_TO, default `measure_rows`) and written
    there under a lock, so processes starting together share one decision: m is padded when
    PAD_TO rows took under PAD_MARGIN times m rows' time."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            return frozenset(int(m) for m in json.loads(path.read_text())["pad"])
        except (OSError, ValueError, KeyError, TypeError):
            pass  # none yet (or unreadable): measure
        # a busy machine answers anything (2026-12-05: under CI's load one pass said 1 row
        # 4.7 ms, 4 rows 8.1, the next 8.7 / 8.1): measured until two passes agree, at most
        # DECISION_TRIES, else nothing is padded (the unpadded product is never wrong)
        pad, last = None, None
        for _ in range(DECISION_TRIES):
            times = (measure or measure_rows)()
            now = sorted(m for m in range(1, PAD_TO) if times[PAD_TO] < PAD_MARGIN * times[m])
            if now == last:
                pad = now
                break
            last = now
        if pad is None:
            pad = []
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"pad": pad, "seconds": {str(m): t for m, t in
                                                           sorted(times.items())},
                                   "pad_to": PAD_TO, "margin": PAD_MARGIN}))
        os.replace(tmp, path)
        log.info("packed float32 products of %s rows padded to %d on this machine (%s)",
                 pad or "no", PAD_TO, path)
        return frozenset(pad)


def measure_rows(repeats: int = 7, layers: int = 8) -> dict[int, float]:
    """{rows: seconds} of `layers` transformer layers' float32 packed products (SmolLM2-135M's
    shapes: attention in and out, MLP in and out; 8 layers' weights, 113 MB, stream from
    memory as a model's do) at 1..PAD_TO rows: the least of `repeats` interleaved passes."""
    gen = torch.Generator().manual_seed(0)
    shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * layers
    weights = [pack_weight(torch.randn(n, k, generator=gen) * 0.02) for n, k in shapes]
    xs = {k: torch.randn(PAD_TO, k, generator=gen) for k in {k for _, k in shapes}}
    best = {m: float("inf") for m in range(1, PAD_TO + 1)}
    for rep in range(repeats + 1):  # the first pass warms up
        for m in best:
            t0 = time.perf_counter()
            for (_, k), w in zip(shapes, weights):
                _product(xs[k][:m], w)
            if rep:
                best[m] = min(best[m], time.perf_counter() - t0)
    return best


@functools.cache
def packed_linear_available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether this torch on this CPU packs and multiplies `dtype` weights with oneDNN's packed
    linear, found by trying it once. float32 packs wherever oneDNN is built in; bf16 also needs
    the CPU's AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT, so an AVX2-only CPU answers False for it."""
    try:
        w = torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=dtype), 1)
        torch.ops.mkldnn._linear_pointwise(torch.zeros(2, 8, dtype=dtype), w, None, "none", [],
                                           "")
        return torch.backends.mkldnn.is_available()
    except (RuntimeError, AttributeError):
        return False


class PackedLinear(nn.Module):
    packed: torch.Tensor  # the buffer below

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.weight = linear.weight  # kept for inspection and state_dict()
        self.bias = linear.bias
        self.register_buffer("packed", pack_weight(linear.weight), persistent=False)
        padded_row_counts()  # the machine's decision now, not in the first forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, self.packed, self.bias)


def _replace_linears(model: nn.Module, dtype: torch.dtype, wrap) -> int:
    """Replace every CPU nn.Linear of `dtype` in `model` with wrap(linear); returns how many."""
    n = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if (isinstance(child, nn.Linear) and child.weight.device.type == "cpu"
                    and child.weight.dtype == dtype):
                setattr(parent, name, wrap(child))
                n += 1
    return n


def pack_linears(model: nn.Module) -> int:
    """Replace every fp32 CPU nn.Linear in `model` with a PackedLinear; returns how many."""
    return _replace_linears(model, torch.float32, PackedLinear)


# Row-invariant bf16 linears. A greedy speculative step verifies k + 1 rows per request where
# plain decoding computes one, so a row must get the same bits whatever the number of rows M
# in its matmul, or bf16 rounding flips near-tied argmaxes and speculative output drifts from
# plain output. oneDNN's bf16 matmul gives a row identical bits for every M <= 32 (measured
# on AVX512-BF16/AMX for the shapes of the smollm2 and built-in models: 576x576 .. 49152x576)
# and switches kernels above 32 rows; float32 has no such need (its rounding noise is ~1e-7).
BF16_ROW_BLOCK = 32


class RowBlockedLinear(nn.Module):
    """A bf16 CPU linear computed in blocks of BF16_ROW_BLOCK rows (tests/runtime/
    test_smollm2.py checks the invariance end to end: bf16 speculative == plain greedy)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.weight = linear.weight
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= BF16_ROW_BLOCK:
            return torch.nn.functional.linear(x, self.weight, self.bias)
        return torch.cat([torch.nn.functional.linear(c, self.weight, self.bias)
                          for c in x.split(BF16_ROW_BLOCK)])


def block_bf16_linears(model: nn.Module) -> int:
    """Replace every bf16 CPU nn.Linear in `model` with a RowBlockedLinear; returns how many
    (a tied LM head keeps sharing the embedding's weight)."""
    return _replace_linears(model, torch.bfloat16, RowBlockedLinear)
