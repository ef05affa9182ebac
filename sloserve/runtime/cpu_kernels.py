"""The C++ CPU kernels (csrc/): built on first use, then loaded as torch.ops.sloserve_cpu.

- paged_attention_cpu.cpp: attention of short segments (decode, verify, draft steps) read
  straight from the paged KV cache (used by the "cpu" attention backend).
- fused_ops_cpu.cpp: RMSNorm (optionally with the residual add), SiLU-and-multiply, and RoPE
  with the K/V cache write, each one pass instead of a chain of small ops (used by the model
  when it runs in float32 on the CPU).

They are compiled once per machine for the host's instruction set (-march=native, OpenMP
through PyTorch's own runtime) with torch.utils.cpp_extension, which needs a C++ compiler and
ninja (a dependency of the package). The build lands in torch's extension cache
(TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions) under a name hashed from the sources,
torch's version and the CPU's feature flags: a changed source or another CPU builds anew
instead of loading a stale binary or one with instructions this CPU lacks. The first build
takes 15-30 s on a 2-core machine.

When the build or load fails, or SLOSERVE_CPU_KERNELS=0, cpu_ops() returns None and callers keep
their portable PyTorch code (same results up to float rounding, slower).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = [CSRC / "paged_attention_cpu.cpp", CSRC / "fused_ops_cpu.cpp"]
HEADERS = [CSRC / "vec.h"]
ENV_SWITCH = "SLOSERVE_CPU_KERNELS"  # "0" turns the C++ kernels off


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return platform.processor()


@functools.cache  # the sources, torch and the CPU do not change within a process
def build_name() -> str:
    h = hashlib.sha256()
    for p in SOURCES + HEADERS:
        h.update(p.read_bytes())
    h.update(torch.__version__.encode())
    h.update(_cpu_flags().encode())
    return f"sloserve_cpu_{h.hexdigest()[:12]}"


def _clear_stale_lock(name: str, max_age_s: float = 600.0) -> None:
    """torch's build lock stays behind when a build is killed (Ctrl-C on a first start), and
    every later load would wait on it forever; a build takes well under max_age_s."""
    try:
        from torch.utils.cpp_extension import _get_build_directory  # private; may move

        lock = Path(_get_build_directory(name, verbose=False)) / "lock"
        if lock.exists() and time.time() - lock.stat().st_mtime > max_age_s:
            lock.unlink()
            log.warning("removed a stale C++ build lock left by an interrupted build: %s", lock)
    except (ImportError, OSError, TypeError):
        pass


def _is_built(name: str) -> bool:
    """The kernels' library is in torch's extension cache (loading will not compile)."""
    try:
        from torch.utils.cpp_extension import _get_build_directory  # private; may move

        return (Path(_get_build_directory(name, verbose=False)) / f"{name}.so").is_file()
    except (ImportError, OSError, TypeError):
        return False


@functools.cache
def cpu_ops():
    """The torch.ops.sloserve_cpu namespace with every kernel loaded, or None."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import load

        name = build_name()
        _clear_stale_lock(name)
        built = _is_built(name)
        if not built:
            log.info("compiling the C++ CPU kernels for this CPU (first start only; about "
                     "15-30 s)")
        t0 = time.perf_counter()
        load(name=name, sources=[str(p) for p in SOURCES], is_python_module=False,
             extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"],
             extra_include_paths=[str(CSRC)])
        ops = torch.ops.sloserve_cpu
        for op in ("paged_attention_small", "rms_norm", "add_rms_norm", "silu_mul", "rope_store"):
            getattr(ops, op)  # raises if one did not register
        if not built:
            log.info("compiled the C++ CPU kernels in %.1f s", time.perf_counter() - t0)
        return ops
    except Exception as e:  # no compiler, no ninja, unsupported platform: keep the torch path
        log.warning("C++ CPU kernels unavailable, using the PyTorch path: %s", e)
        return None


def kernels_ready() -> bool:
    """The kernels are switched on and already built for this torch and CPU: a process that
    asks for them loads them without compiling (a cost profile's key says whether the CPU
    attention it priced ran them: sglang_ext/settings.py)."""
    return os.environ.get(ENV_SWITCH, "1") != "0" and _is_built(build_name())


def paged_attention_op():
    ops = cpu_ops()
    return None if ops is None else ops.paged_attention_small
