"""Float32 weights of SGLang's linear layers and LM head stored column-major on a CPU.

SGLang keeps a linear layer's weight W [N, K] row-major and multiplies `F.linear(x, W)`
(x [M, K]); its logits processor multiplies `hidden @ lm_head.weight.T`. In float32 on a
CPU both are one sgemm whose B operand is W transposed, and torch's CPU GEMM is much slower
on that transposed B for a few rows than on the same product with W's storage transposed
(`python -m sloserve.bench.cpu_weights` on the 2-core Intel Xeon with AVX-512, torch
2.14.1, 2 threads, 2026-12-01): a SmolLM2 forward's linears and head took 58 / 76 / 88 ms
at 4 / 8 / 12 rows row-major, 45 / 59 / 63 ms column-major; 1-3 rows within 7% either way.
A speculative verify is exactly such a product of a few rows per request.

`relayout_linear_weights` gives each such weight the strides of its transpose's contiguous
copy: the same Parameter object, shape and values, so every reader (weight loaders, tied
embeddings, the logits processor) sees the same tensor; only the GEMM's memory order
changes. Sums come out in another order, so the logits may differ in the last bits from
the row-major run's; every server of a comparison runs the same layout (the plugin applies
it in each SGLang process on the CPU engine). SLOSERVE_CPU_WEIGHTS=row keeps SGLang's layout.
"""

from __future__ import annotations

import os
from typing import Any

import torch

LAYOUT_ENV = "SLOSERVE_CPU_WEIGHTS"
LAYOUTS = ("column", "row")


def layout_from_env() -> str:
    """The layout SLOSERVE_CPU_WEIGHTS asks for (default column); ValueError naming the
    variable for anything else."""
    value = os.environ.get(LAYOUT_ENV, "column").strip().lower() or "column"
    if value not in LAYOUTS:
        raise ValueError(f"{LAYOUT_ENV}={value!r}: expected one of {', '.join(LAYOUTS)}")
    return value


def column_major(t: torch.Tensor) -> torch.Tensor:
    """t [N, K] with the same values stored column-major (strides (1, N))."""
    return t.t().contiguous().t()


def is_column_major(t: torch.Tensor) -> bool:
    return t.ndim == 2 and t.stride(0) == 1 and t.stride(1) == t.shape[0] and t.shape[1] > 1


def _linear_weights(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The weights SGLang multiplies as x @ W.T: every module whose quant method is SGLang's
    unquantized linear one (it calls F.linear with `layer.weight`), and the LM head (the
    logits processor's matmul; with tied embeddings it is the input embedding's weight,
    whose row lookups read any strides). Each Parameter once."""
    found: dict[int, torch.nn.Parameter] = {}
    modules = [m for m in model.modules()
               if type(getattr(m, "quant_method", None)).__name__ == "UnquantizedLinearMethod"]
    head = getattr(model, "lm_head", None)
    if isinstance(head, torch.nn.Module):
        modules.append(head)
    for module in modules:
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.nn.Parameter):
            found.setdefault(id(weight), weight)
    return list(found.values())


def relayout_linear_weights(model: Any) -> int:
    """Store the model's float32 CPU linear weights column-major (in place, see the module's
    docstring); the number of weights changed. Weights of other dtypes or devices, and ones
    already not contiguous (packed or shared views), are left alone."""
    if not isinstance(model, torch.nn.Module):
        return 0
    changed = 0
    for weight in _linear_weights(model):
        if (weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.ndim != 2
                or not weight.is_contiguous() or weight.shape[1] < 2):
            continue
        weight.data = column_major(weight.data)
        changed += 1
    return changed
