"""Process-level CPU settings the engine's speed depends on (glibc malloc, libgomp).

Memory: a decode step allocates and frees the same few MB of activations and gathered KV
every layer. With glibc's default thresholds freed memory goes back to the kernel (trim,
or a fresh mmap per large tensor) and every next allocation page-faults it in again:
measured on the built-in target at batch 8, context 512, 60 ms per forward instead of 24 ms.
tune_malloc() keeps freed memory in the allocator (M_MMAP_THRESHOLD fixed at its maximum,
so it no longer adapts down; a large M_TRIM_THRESHOLD and M_TOP_PAD) and puts every thread
in one arena (M_ARENA_MAX=1), so the engine thread reuses the same warm pages. The cost is
that the process keeps its peak heap instead of returning it to the kernel.

Threads: libgomp (the OpenMP runtime of PyTorch's CPU wheels) keeps one worker pool per
thread that ever ran a parallel region, and counts every pool's workers together. Once the
count exceeds the CPUs available, every pool stops spin-waiting between parallel regions and
sleeps on a futex instead, so each small parallel op (a decode-size matmul) pays a wake-up.
On a 2-core machine the main thread's pool (left by loading the models) plus the engine
thread's pool crosses that line: measured, a 4-row linear took 2x as long on the engine
thread as on the main thread. release_openmp_workers() frees the calling thread's idle pool
(OpenMP 5.0 omp_pause_resource_all, soft pause; it comes back by itself the next time that
thread runs a parallel op). AsyncEngine calls it before starting its engine thread, so the
engine's pool is the only one and keeps spinning, as the profiler's measurements assume.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import sys

import torch

from sloserve.estimator.profile_lookup import cpuinfo_field

log = logging.getLogger(__name__)

_OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: omp_pause_soft
# mallopt parameters (malloc.h) and the values set
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -2, -3, -8
_MALLOC_SETTINGS = (
    (_M_MMAP_THRESHOLD, 32 << 20),  # glibc's maximum on 64-bit: larger blocks still mmap
    (_M_TRIM_THRESHOLD, 1 << 30),
    (_M_TOP_PAD, 64 << 20),
    (_M_ARENA_MAX, 1),
)


@functools.cache
def _libc():
    try:
        return ctypes.CDLL(None)  # symbols already in the process
    except OSError:
        return None


@functools.cache
def tune_malloc() -> bool:
    """Apply the malloc settings once per process (glibc only); True when all took."""
    libc = _libc()
    if not sys.platform.startswith("linux") or libc is None or not hasattr(libc, "mallopt"):
        return False
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = all(libc.mallopt(param, value) == 1 for param, value in _MALLOC_SETTINGS)
    if not ok:
        log.info("glibc mallopt refused a setting; CPU steps may page-fault more")
    return ok


def release_openmp_workers() -> bool:
    """Free this thread's idle OpenMP worker pool; True when the runtime did it."""
    if "OpenMP" not in torch.__config__.parallel_info():
        return False
    libc = _libc()
    fn = getattr(libc, "omp_pause_resource_all", None) if libc is not None else None
    if fn is None:
        return False
    fn.argtypes = [ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn(_OMP_PAUSE_SOFT) == 0


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as the kernel reports them (/proc/cpuinfo; empty elsewhere).
    Read at run time: the machines this project runs on change from day to day."""
    return frozenset(cpuinfo_field("flags").split())


def cpu_vendor() -> str:
    """The CPU's vendor id as the kernel reports it ("GenuineIntel", "AuthenticAMD", ...;
    empty where /proc/cpuinfo has none)."""
    return cpuinfo_field("vendor_id")


def cpu_has_bf16_matmul() -> bool:
    """Whether this CPU multiplies bf16 matrices in hardware (AVX512-BF16 or AMX-BF16), where
    oneDNN's bf16 matmuls beat fp32 (measured ~6x per thread on an AMX Xeon). Without them
    bf16 is emulated and slower than fp32."""
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})
