"""Llama-family decoder (Llama 2/3, Mistral, Qwen2) over ragged batches and a paged KV cache.

Differences from transformers' module are for speed, not semantics: q/k/v and gate/up are fused
into one matmul each, and every layer reads the attention metadata carried on the batch.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from sloserve.runtime.attention.base import AttentionBackend
from sloserve.runtime.batch import ForwardBatch
from sloserve.runtime.kv_cache import KVStorage
from sloserve.runtime.models.config import ModelConfig, RopeConfig


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    inv = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if rope.kind == "linear":
        inv = inv / rope.factor
    elif rope.kind == "llama3":
        low_wl = rope.original_max_position / rope.low_freq_factor
        high_wl = rope.original_max_position / rope.high_freq_factor
        wl = 2 * math.pi / inv
        smooth = (rope.original_max_position / wl - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        scaled = torch.where(wl > low_wl, inv / rope.factor, inv)
        mid = (wl <= low_wl) & (wl >= high_wl)
        blended = (1 - smooth) * inv / rope.factor + smooth * inv
        inv = torch.where(mid, blended, scaled)
    return inv.float()


class Rotary(nn.Module):
    cos: torch.Tensor  # buffers
    sin: torch.Tensor
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        inv = rope_inv_freq(cfg.rope, cfg.head_dim)
        t = torch.arange(cfg.max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(t, inv)  # [max_pos, D/2]
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def tables(self, positions: torch.Tensor,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin: [T, 1, D/2] in the activations' dtype (computed in float32, rounded
        once, as transformers does), once per forward, used by every layer."""
        return (self.cos[positions].unsqueeze(1).to(dtype),
                self.sin[positions].unsqueeze(1).to(dtype))

    @staticmethod
    def apply(  # type: ignore[override]  # the rotation, not nn.Module.apply(fn)
            x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: [T, heads, D]; rotate-half convention (first half pairs with second half)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, idx: int):
        super().__init__()
        self.idx = idx
        self.n_q = cfg.num_heads * cfg.head_dim
        self.n_kv = cfg.num_kv_heads * cfg.head_dim
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.eps = cfg.rms_norm_eps
        self.input_norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.post_norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.qkv = nn.Linear(cfg.hidden_size, self.n_q + 2 * self.n_kv, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.n_q, cfg.hidden_size, bias=False)
        self.gate_up = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, h, batch: ForwardBatch, rope: tuple, kv: KVStorage, attn, scale):
        # h: [T, hidden]
        x = F.rms_norm(h, (h.shape[-1],), self.input_norm, self.eps)
        qkv = self.qkv(x)
        T = qkv.shape[0]
        # rotate q and k heads together: [T, heads + kv_heads, D]
        qk = Rotary.apply(qkv[:, : self.n_q + self.n_kv].view(T, -1, self.head_dim), *rope)
        q, k = qk[:, : self.heads], qk[:, self.heads :]
        v = qkv[:, self.n_q + self.n_kv :].view(T, self.kv_heads, self.head_dim)
        kv.write(self.idx, batch.slot_mapping, k, v)
        o = attn.forward(q, kv.k[self.idx], kv.v[self.idx], batch.attn, scale)
        h = h + self.o_proj(o.reshape(T, self.n_q))
        x = F.rms_norm(h, (h.shape[-1],), self.post_norm, self.eps)
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return h + self.down(F.silu(gate) * up)

    def forward_fused(self, x, h, batch: ForwardBatch, cos, sin, kv: KVStorage, attn, scale, ops):
        """The same layer through the C++ CPU ops (sloserve/runtime/cpu_kernels.py). x: this
        layer's normed input [T, hidden]; h: the residual stream, to which the attention
        output is added in place. Returns the MLP output, for the caller to add to h."""
        T = x.shape[0]
        qkv = self.qkv(x)  # [T, (heads + 2 kv_heads) * D]; q and k rotated in place below
        ops.rope_store(qkv, cos, sin, batch.slot_mapping, kv.k[self.idx], kv.v[self.idx],
                       self.heads, self.kv_heads)
        q = qkv[:, : self.n_q].view(T, self.heads, self.head_dim)
        o = attn.forward(q, kv.k[self.idx], kv.v[self.idx], batch.attn, scale)
        x = ops.add_rms_norm(h, self.o_proj(o.reshape(T, self.n_q)), self.post_norm, self.eps)
        return self.down(ops.silu_mul(self.gate_up(x)))


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        self.rotary = Rotary(cfg)
        self.scale = cfg.head_dim**-0.5
        self.cpu_ops: Any = None  # torch.ops.sloserve_cpu when the fused CPU path is on

    def use_cpu_ops(self, ops) -> bool:
        """Run through the fused C++ CPU ops from now on, where they apply (float32 weights on
        the CPU); returns whether they are in use."""
        params = list(self.parameters())
        applies = (ops is not None and self.cfg.head_dim % 2 == 0
                   and all(p.device.type == "cpu" and p.dtype == torch.float32 for p in params))
        self.cpu_ops = ops if applies else None
        return applies

    def forward(self, batch: ForwardBatch, kv: KVStorage, attn: AttentionBackend) -> torch.Tensor:
        """Runs the batch, writes its K/V, returns logits [L, vocab] for batch.logits_indices."""
        h = self.embed(batch.input_ids)
        if self.cpu_ops is not None:
            h = self._layers_fused(h, batch, kv, attn)
        else:
            rope = self.rotary.tables(batch.positions, h.dtype)
            for layer in self.layers:
                h = layer(h, batch, rope, kv, attn, self.scale)
        h = h.index_select(0, batch.logits_indices)
        h = F.rms_norm(h, (h.shape[-1],), self.norm, self.cfg.rms_norm_eps)
        return self.lm_head(h).float()

    def _layers_fused(self, h, batch: ForwardBatch, kv: KVStorage, attn) -> torch.Tensor:
        # each MLP output is added to the residual stream by the next layer's fused norm
        ops, eps, n = self.cpu_ops, self.cfg.rms_norm_eps, len(self.layers)
        cos, sin = self.rotary.cos[batch.positions], self.rotary.sin[batch.positions]  # [T, D/2]
        x = ops.rms_norm(h, self.layers[0].input_norm, eps)
        layer: DecoderLayer
        for i, layer in enumerate(self.layers):  # type: ignore[assignment]  # a ModuleList
            mlp = layer.forward_fused(x, h, batch, cos, sin, kv, attn, self.scale, ops)
            if i + 1 < n:
                x = ops.add_rms_norm(h, mlp, self.layers[i + 1].input_norm, eps)
            else:
                h.add_(mlp)
        return h
