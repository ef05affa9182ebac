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

`pack_linear_weights` goes further where torch's sgemm is slow for a few rows whatever the
layout: each such weight gets a copy prepacked for oneDNN's float32 matmul (the built-in
engine's path, sloserve/runtime/models/cpu_linear.py) and the layer a quant method that
multiplies with it (PackedF32Method). On the 2-core AMD EPYC (AVX-512, torch 2.13 with MKL
2024.2, 2 threads, 2026-12-03) MKL's sgemm re-reads the weight for every row up to three
(SmolLM2's gate_up 3072 x 576: 123 / 245 / 361 / 449 us at 1 / 2 / 3 / 4 rows column-major)
where oneDNN's packed kernel reads it once (80 / 84 / 98 / 112 us); the 49,152 x 576 head:
4.2 / 8.4 / 12.5 / 19.3 ms against 2.5 / 2.8 / 2.6 / 2.5 ms. A linear layer's own weight is
freed once packed (PackedF32Method); the LM head's stays (the tied embedding's lookups, the
draft's hot rows read it), so the head alone is held twice.
`SLOSERVE_CPU_WEIGHTS` = auto (default) | packed | column | row; auto packs on CPUs other
than Intel's (MKL's fast few-row kernels are dispatched for Intel processors) and stores
column-major on Intel's, where the column layout was measured faster at 1-3 rows (2026-12-01).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from sloserve.runtime.models.cpu_linear import (
    pack_weight,
    packed_linear,
    packed_linear_available,
    padded_row_counts,
)

LAYOUT_ENV = "SLOSERVE_CPU_WEIGHTS"
LAYOUTS = ("auto", "packed", "column", "row")


def layout_from_env(vendor: str | None = None, packable: bool | None = None) -> str:
    """The layout SLOSERVE_CPU_WEIGHTS asks for: packed, column or row; auto (default)
    resolves to packed where oneDNN's packed linear runs and the CPU is not Intel's, else
    column (the module's docstring). ValueError naming the variable for anything else.
    vendor, packable: the machine's answers (None: ask it)."""
    value = os.environ.get(LAYOUT_ENV, "auto").strip().lower() or "auto"
    if value not in LAYOUTS:
        raise ValueError(f"{LAYOUT_ENV}={value!r}: expected one of {', '.join(LAYOUTS)}")
    if value != "auto":
        return value
    if vendor is None:
        from sloserve.runtime.cpu_tuning import cpu_vendor

        vendor = cpu_vendor()
    if packable is None:
        packable = packed_linear_available()
    return "packed" if packable and vendor != "GenuineIntel" else "column"


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


class PackedF32Method:
    """A float32 linear layer's (or the LM head's) quant method that multiplies with a copy of
    its weight prepacked for oneDNN: apply(layer, x [..., K], bias) -> [..., N], the same
    product as F.linear(x, layer.weight, bias) summed in oneDNN's order. Every other attribute
    (the embedding lookup of a tied head, the weight loaders) is the wrapped method's.

    release: the weight's own storage is freed once packed (a linear layer's: nothing else
    reads it). The Parameter keeps its shape, dtype and device over one NaN element (strides
    0), so a reader that multiplies it gets NaN and a writer (a weight reload) an error
    instead of a stale packed copy; `dense()` gives the values back."""

    def __init__(self, inner: Any, weight: torch.Tensor, release: bool = False) -> None:
        self.inner = inner
        self.packed = pack_weight(weight)
        self.out_features = int(weight.shape[0])
        padded_row_counts()  # the machine's decision (cpu_linear.py) now, not in a forward
        if release:
            weight.data = torch.full((1,), float("nan"), dtype=weight.dtype,
                                     device=weight.device).expand(weight.shape)

    def dense(self) -> torch.Tensor:
        """The packed weight's values, [N, K] contiguous (oneDNN's reorder back)."""
        return self.packed.to_dense()

    def apply(self, layer: Any, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1]).contiguous()  # [M, K]
        out = packed_linear(x2, self.packed, bias)
        return out.reshape(*lead, self.out_features)

    def __getattr__(self, name: str) -> Any:
        if name == "inner":  # not set yet (a copy being built): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)


_PACKABLE_METHODS = ("UnquantizedLinearMethod", "UnquantizedEmbeddingMethod")


def pack_linear_weights(model: Any) -> int:
    """Give every float32 CPU linear layer of SGLang's (unquantized linear method) and the LM
    head (tied or not) a PackedF32Method, in place (see the module's docstring); the number of
    layers changed. A linear layer's weight is freed (PackedF32Method's release), the head's
    kept; layers of other dtypes or devices, ones SGLang packed for its AMX kernels and ones
    already packed are left alone."""
    if not isinstance(model, torch.nn.Module):
        return 0
    modules = {id(m): m for m in model.modules()
               if type(getattr(m, "quant_method", None)).__name__ == "UnquantizedLinearMethod"}
    head = getattr(model, "lm_head", None)
    if isinstance(head, torch.nn.Module):
        modules.setdefault(id(head), head)
    changed = 0
    for module in modules.values():  # a head keeps its weight: embedding lookups, hot rows
        method = getattr(module, "quant_method", None)
        weight = getattr(module, "weight", None)
        if (type(method).__name__ not in _PACKABLE_METHODS
                or not isinstance(weight, torch.nn.Parameter) or weight.ndim != 2
                or weight.dtype != torch.float32 or weight.device.type != "cpu"
                or not weight.is_contiguous() or weight.shape[1] < 2
                or getattr(module, "use_intel_amx_backend", False)):
            continue
        linear = type(method).__name__ == "UnquantizedLinearMethod" and module is not head
        setattr(module, "quant_method",  # noqa: B010  # not a Module
                PackedF32Method(method, weight, release=linear))
        changed += 1
    return changed


# ----- the draft model's linears in bf16 (SpecServeWorker, model drafter on a CPU)

DRAFT_DTYPE_ENV = "SLOSERVE_CPU_DRAFT_DTYPE"
DRAFT_DTYPES = ("auto", "float32", "bfloat16")


def draft_dtype_from_env(bf16_hardware: bool | None = None) -> str:
    """The dtype of the draft's matmuls on a CPU that SLOSERVE_CPU_DRAFT_DTYPE asks for:
    float32, bfloat16, or auto (default): bfloat16 where the CPU multiplies bf16 in hardware
    (AVX512-BF16 or AMX: a 16-row draft linear 2-4x faster than float32 on the 2-core AMD
    EPYC with AVX512-BF16, 2026-12-03), else float32 (bf16 emulated is slower). ValueError
    naming the variable for anything else. bf16_hardware: the CPU's answer (None: ask it)."""
    value = os.environ.get(DRAFT_DTYPE_ENV, "auto").strip().lower() or "auto"
    if value not in DRAFT_DTYPES:
        raise ValueError(f"{DRAFT_DTYPE_ENV}={value!r}: expected one of {', '.join(DRAFT_DTYPES)}")
    if value != "auto":
        return value
    if bf16_hardware is None:
        from sloserve.runtime.cpu_tuning import cpu_has_bf16_matmul

        bf16_hardware = cpu_has_bf16_matmul()
    return "bfloat16" if bf16_hardware else "float32"


class Bf16Linear:
    """A linear layer's quant method that multiplies in bf16 and answers in the input's dtype:
    x.bf16 @ W.bf16.T (+ bias) cast back, W stored bf16 row-major once. The draft model's
    residual stream, norms, attention and KV stay float32; only its GEMMs round their inputs
    to bf16 (its proposals may change, never the target's verdict on them). Every other
    attribute is the wrapped method's.

    packed: where torch has oneDNN's packed linear, the bf16 weight also gets a copy
    prepacked for it (pack_weight), which the product reads instead of F.linear's bf16 GEMM
    on the row-major weight: the SmolLM2 draft's four layers and 16,384-row hot head took
    3.8 / 3.9 / 4.4 / 5.4 ms a forward at 1 / 4 / 8 / 16 rows with F.linear and 2.9 / 2.4 /
    2.8 / 3.6 ms packed (`python -m sloserve.bench.cpu_weights --bf16 --rows 1,4,8,16
    --repeats 15`, 2-core AMD EPYC with AVX512-BF16, SGLang's torch 2.14.1, 2026-12-03).
    The sums come out in oneDNN's order (bf16 roundings apart from F.linear's)."""

    def __init__(self, inner: Any, weight: torch.Tensor | None = None) -> None:
        self.inner = inner
        self.packed = pack_weight(weight) if weight is not None else None

    def apply(self, layer: Any, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        w: torch.Tensor = layer.weight
        xw = x.to(w.dtype)
        if self.packed is None:
            return torch.nn.functional.linear(xw, w, bias).to(x.dtype)
        lead = x.shape[:-1]
        out = packed_linear(xw.reshape(-1, x.shape[-1]).contiguous(), self.packed, bias)
        return out.reshape(*lead, out.shape[-1]).to(x.dtype)

    def __getattr__(self, name: str) -> Any:
        if name in ("inner", "packed"):  # not set yet (a copy being built): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)


def bf16_method(inner: Any, weight: torch.Tensor) -> Bf16Linear:
    """The Bf16Linear method for a bf16 weight [N, K]: with a packed copy where torch has
    oneDNN's packed bf16 linear (not on an AVX2-only CPU), else F.linear on the row-major
    weight. The one place that decides whether a draft's bf16 product is packed (its
    linears and its hot head)."""
    return Bf16Linear(inner, weight if packed_linear_available(torch.bfloat16) else None)


def bf16_draft_linears(model: Any) -> int:
    """Give the float32 CPU linear layers of a draft model (its attention and MLP matrices,
    not the LM head: tied to the input embedding, whose lookups must stay float32) bf16
    weights and the Bf16Linear method, in place; the number of layers changed. Layers of
    other dtypes or devices, and ones SGLang packed for its AMX kernels, are left alone."""
    if not isinstance(model, torch.nn.Module):
        return 0
    changed = 0
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        weight = getattr(module, "weight", None)
        if isinstance(method, PackedF32Method):  # its values from the packed copy, which goes
            if isinstance(weight, torch.nn.Parameter) and weight.stride() == (0, 0):
                weight.data = method.dense()
            method = method.inner
        if (type(method).__name__ != "UnquantizedLinearMethod"
                or not isinstance(weight, torch.nn.Parameter) or weight.ndim != 2
                or weight.dtype != torch.float32 or weight.device.type != "cpu"
                or getattr(module, "use_intel_amx_backend", False)):
            continue
        weight.data = weight.data.to(torch.bfloat16).contiguous()
        bias = getattr(module, "bias", None)
        if isinstance(bias, torch.nn.Parameter) and bias.dtype == torch.float32:
            bias.data = bias.data.to(torch.bfloat16)
        setattr(module, "quant_method",  # noqa: B010  # not a Module
                bf16_method(method, weight.data))
        changed += 1
    return changed
