"""Attention backend interface: ragged queries over a paged KV cache.

A backend builds its metadata once per forward (`plan`), then every layer calls `forward`
with that metadata. Models and scheduler never see backend details, so a FlashInfer backend
slots in on CUDA without touching them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import torch

from sloserve.runtime.batch import ForwardBatch


class AttentionBackend(ABC):
    name: str = "base"

    @abstractmethod
    def plan(self, batch: ForwardBatch) -> Any:
        """Build per-forward metadata (index tensors, masks) shared by all layers."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k_cache: torch.Tensor,  # [num_slots, KVH, D] this layer's keys, new tokens written
        v_cache: torch.Tensor,  # [num_slots, KVH, D]
        meta: Any,
        scale: float,
    ) -> torch.Tensor:  # [T, H, D]
        """Causal attention of each segment's queries over its KV positions 0..kv_len-1."""


_REGISTRY: dict[str, Callable[[], AttentionBackend]] = {}


def register_backend(name: str, factory: Callable[[], AttentionBackend]) -> None:
    _REGISTRY[name] = factory


def make_backend(name: str, device: str = "cpu") -> AttentionBackend:
    """The backend called `name`; "auto" picks by device: the torch backend on CUDA, on the
    CPU the C++ kernel backend ("cpu", which keeps the torch path where its kernel cannot be
    built)."""
    if name == "auto":
        name = "torch" if str(device).startswith("cuda") else "cpu"
    if name not in _REGISTRY:
        raise ValueError(f"unknown attention backend {name!r}; available: {sorted(_REGISTRY)}")
    return _REGISTRY[name]()
