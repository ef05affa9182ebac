"""Runs one model over ragged batches of segments against its own KV storage."""

from __future__ import annotations

import torch

from sloserve.runtime.attention.base import AttentionBackend
from sloserve.runtime.batch import ForwardBatch, Segment, build_forward_batch
from sloserve.runtime.kv_cache import KVStorage
from sloserve.runtime.models.llama import LlamaModel


class ModelRunner:
    def __init__(self, model: LlamaModel, kv: KVStorage, backend: AttentionBackend, block_size: int):
        self.model = model
        self.kv = kv
        self.backend = backend
        self.block_size = block_size
        self.device = next(model.parameters()).device

    @property
    def cfg(self):
        return self.model.cfg

    @torch.inference_mode()
    def forward(self, segments: list[Segment]) -> tuple[torch.Tensor, ForwardBatch]:
        """Logits [L, vocab] (float32) for each segment's last token, or all its tokens when
        segment.all_logits; rows of segment i are batch.logits_indptr[i]:[i+1]."""
        batch = build_forward_batch(segments, self.block_size)
        if self.device.type != "cpu":
            for name in ("input_ids", "positions", "slot_mapping", "logits_indices"):
                setattr(batch, name, getattr(batch, name).to(self.device, non_blocking=True))
        batch.attn = self.backend.plan(batch)
        return self.model(batch, self.kv, self.backend), batch
