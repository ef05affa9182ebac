"""The C++ CPU attention kernel (csrc/paged_attention_cpu.cpp): built on first use, then loaded.

It is compiled once per machine for the host's instruction set (-march=native, OpenMP through
PyTorch's own runtime) with torch.utils.cpp_extension, which needs a C++ compiler and ninja
(a dependency of the package). The build lands in torch's extension cache (TORCH_EXTENSIONS_DIR,
default ~/.cache/torch_extensions) under a name hashed from the source, torch's version and the
CPU's feature flags: a changed source or another CPU builds anew instead of loading a stale
binary or one with instructions this CPU lacks. The first build takes about a minute on a
2-core machine.

When the build or load fails, or SLOSERVE_CPU_KERNELS=0, paged_attention_op() returns None and
the CPU backend keeps to the portable PyTorch path (same results, slower).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "paged_attention_cpu.cpp"
ENV_SWITCH = "SLOSERVE_CPU_KERNELS"  # "0" turns the C++ kernels off


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return platform.processor()


def build_name() -> str:
    h = hashlib.sha256(SOURCE.read_bytes())
    h.update(torch.__version__.encode())
    h.update(_cpu_flags().encode())
    return f"sloserve_cpu_{h.hexdigest()[:12]}"


@functools.cache
def paged_attention_op():
    """torch.ops.sloserve_cpu.paged_attention_small, or None where it cannot be built."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import load

        load(name=build_name(), sources=[str(SOURCE)], is_python_module=False,
             extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"])
        return torch.ops.sloserve_cpu.paged_attention_small
    except Exception as e:  # no compiler, no ninja, unsupported platform: keep the torch path
        log.warning("C++ CPU attention kernel unavailable, using the PyTorch path: %s", e)
        return None
