"""The first start says what it builds and how long it took: the model pair (ensure_pair)
and the C++ kernels (cpu_kernels); a later start, with both cached, says nothing of it."""

from __future__ import annotations

import logging
import re

from sloserve_testing import TINY_SHAPE

from sloserve.runtime import cpu_kernels
from sloserve.runtime.models.builtin import ensure_pair


def test_building_the_pair_is_logged_with_its_time(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="sloserve.runtime.models.builtin"):
        ensure_pair(tmp_path / "pair", shape=TINY_SHAPE, seed=3)
    msgs = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("building the model pair in") for m in msgs), msgs
    assert any(re.fullmatch(r"built the model pair in \d+\.\d s", m) for m in msgs), msgs
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="sloserve.runtime.models.builtin"):
        ensure_pair(tmp_path / "pair", shape=TINY_SHAPE, seed=3)
    assert not caplog.records


def test_kernel_build_state_is_known():
    """cpu_ops logs a compile only when the library is not cached yet: after a load it is."""
    if cpu_kernels.cpu_ops() is None:
        return  # no compiler here: the portable path, nothing is compiled
    assert cpu_kernels._is_built(cpu_kernels.build_name())
    assert not cpu_kernels._is_built("sloserve_cpu_never_built")
