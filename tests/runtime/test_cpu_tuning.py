"""The process-level CPU settings apply on this platform and are safe to repeat."""

import sys
import threading

import pytest
import torch

from sloserve.runtime.cpu_tuning import release_openmp_workers, tune_malloc


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
def test_tune_malloc_applies_once():
    assert tune_malloc() is True
    assert tune_malloc() is True  # cached: a second engine does not re-apply


def test_release_openmp_workers_then_parallel_ops_still_work():
    x = torch.randn(64, 256)
    w = torch.randn(256, 256)
    ref = x @ w  # creates this thread's OpenMP pool
    released = release_openmp_workers()
    if "OpenMP" in torch.__config__.parallel_info():
        assert released is True
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("y", x @ w))
    t.start()
    t.join()
    torch.testing.assert_close(out["y"], ref)
    torch.testing.assert_close(x @ w, ref)  # the pool comes back on this thread
