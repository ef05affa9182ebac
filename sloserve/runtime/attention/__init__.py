"""Attention backends behind one interface (base.py); importing the package registers them."""

from sloserve.runtime.attention import cpu_backend, torch_backend  # noqa: F401  (registration)
from sloserve.runtime.attention.base import AttentionBackend, make_backend

__all__ = ["AttentionBackend", "make_backend"]
