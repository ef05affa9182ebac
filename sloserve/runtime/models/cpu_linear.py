"""CPU fast path for linear layers: oneDNN weights prepacked once at load time.

On this class of CPU, oneDNN's packed fp32 linear is 1.4-2.7x faster than MKL's F.linear for
8-32 rows (measured: python -m sloserve.bench.engine), 2-4x faster for 2-4 rows and 1.0-1.3x
for one row, so it is used for every row count. Same fp32 math; only the accumulation order
differs (rounding-level).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

PACK_ROWS = 32  # packing hint: the batch size the layout is tuned for (any size works)


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] float32 -> an opaque oneDNN tensor [N, K] laid out for packed_linear."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS)


def packed_linear(x: torch.Tensor, packed: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] times a pack_weight() weight, plus bias: [M, N] (F.linear's product)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


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
