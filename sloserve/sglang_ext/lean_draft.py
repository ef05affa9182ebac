"""The draft model's forward without SGLang's model runner, on SGLang's CPU runtime.

A draft forward through SGLang's runner at batch 4 on the 2-core EPYC took 7.3 ms, of which
its 17 GEMMs were 2.2 ms: the rest was ~150 small torch ops a layer (native RMSNorm, RoPE,
the KV write, the attention op's own bookkeeping) and the Python between them, and the
first round's extend another ForwardBatch and attention metadata (torch profiler over 40
drafting steps, 2026-12-06, BENCHMARKS.md). A 4-layer draft pays that per round, every
round, while the target pays it once a step: it decided whether drafting paid at all.

`LeanDraft` runs the same Llama decoder on the same weights, KV pool and slots with the
project's fused CPU kernels (runtime/csrc: add_rms_norm, rope_store, silu_mul and the paged
attention of short segments), ~20 ops a layer, and is used for every draft round, the first
round's catch-up extend included. Built only for what it reproduces: a Llama-type decoder
(pre-norm RMSNorm, neox RoPE over the whole head, SiLU MLP, no biases, no logit cap, scale
or sliding window), a float32 KV pool and the C++ kernels present; anything else keeps
SGLang's forward (`build` says why). Its logits equal SGLang's up to float rounding (the
fused kernels sum in another order): the draft's proposals may differ in a near tie, the
target's verdict never does (greedy output is the target's, whatever is proposed).
SLOSERVE_LEAN_DRAFT=0 keeps SGLang's forward (for comparisons).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

log = logging.getLogger(__name__)

ENV_SWITCH = "SLOSERVE_LEAN_DRAFT"  # "0": the draft runs through SGLang's model runner


class _Layer:
    """One decoder layer's weights and the linear methods that multiply them."""

    def __init__(self, layer: Any, pool: Any) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.qkv, self.o = attn.qkv_proj, attn.o_proj
        self.gate_up, self.down = mlp.gate_up_proj, mlp.down_proj
        self.w_in = layer.input_layernorm.weight.data
        self.eps_in = float(layer.input_layernorm.variance_epsilon)
        self.w_post = layer.post_attention_layernorm.weight.data
        self.eps_post = float(layer.post_attention_layernorm.variance_epsilon)
        self.pool, self.layer_id = pool, attn.attn.layer_id  # its KV: asked at each forward


def _linear(module: Any, x: torch.Tensor) -> torch.Tensor:
    """x [T, K] through the module's own quant method (packed float32, bf16): [T, N]."""
    return module.quant_method.apply(module, x, None)


def _unsupported(dw: Any) -> str | None:
    """Why LeanDraft cannot reproduce this draft worker's model, None when it can."""
    from sloserve.runtime.cpu_kernels import cpu_ops

    if os.environ.get(ENV_SWITCH, "1").strip() == "0":
        return f"{ENV_SWITCH}=0"
    runner = dw.draft_runner
    model = runner.model
    if type(model).__name__ != "LlamaForCausalLM":
        return f"draft model {type(model).__name__}, not LlamaForCausalLM"
    if cpu_ops() is None:
        return "no C++ CPU kernels"
    inner = getattr(model, "model", None)
    layers = list(getattr(inner, "layers", []))
    if not layers or getattr(inner, "start_layer", 0) != 0 \
            or getattr(inner, "end_layer", len(layers)) != len(layers):
        return "a pipeline stage of the model"
    lp = model.logits_processor
    if getattr(lp, "logit_scale", None) not in (None, 1.0) \
            or getattr(lp, "final_logit_softcapping", None):
        return "scaled or soft-capped logits"
    if not callable(getattr(getattr(model.lm_head, "quant_method", None), "apply", None)):
        return "an LM head without a quant method to multiply through"
    pool = runner.token_to_kv_pool
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        rope = attn.rotary_emb
        ra = attn.attn
        if type(rope).__name__ not in ("RotaryEmbedding", "Llama3RotaryEmbedding") \
                or not rope.is_neox_style or rope.rotary_dim != rope.head_size \
                or rope.head_size != attn.head_dim:
            return "a RoPE other than neox-style over the whole head"
        if getattr(ra, "logit_cap", 0.0) or getattr(ra, "sliding_window_size", -1) not in (-1, 0, None) \
                or abs(float(ra.scaling) - attn.head_dim ** -0.5) > 1e-9:
            return "a logit cap, a sliding window or a custom attention scale"
        if type(mlp.act_fn).__name__ != "SiluAndMul":
            return f"MLP activation {type(mlp.act_fn).__name__}"
        for lin in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
            if getattr(lin, "bias", None) is not None \
                    or not callable(getattr(getattr(lin, "quant_method", None), "apply", None)):
                return "a biased linear or one without a quant method"
        k, v = pool.get_key_buffer(ra.layer_id), pool.get_value_buffer(ra.layer_id)
        if k.dtype != torch.float32 or v.dtype != torch.float32 or not k.is_contiguous() \
                or not v.is_contiguous() or k.dim() != 3 or k.shape[1] != attn.num_kv_heads:
            return "a KV pool other than contiguous float32 [slots, kv heads, head dim]"
        if rope.cos_sin_cache.dtype != torch.float32:
            return "a RoPE cache other than float32"
    return None


class LeanDraft:
    """The draft model's forward over segments of tokens (see the module's docstring)."""

    def __init__(self, dw: Any) -> None:
        from sloserve.runtime.cpu_kernels import cpu_ops

        model = dw.draft_runner.model
        pool = dw.draft_runner.token_to_kv_pool
        self.ops = cpu_ops()
        self.model = model
        self.embed = model.model.embed_tokens
        self.layers = [_Layer(layer, pool) for layer in model.model.layers]
        a = model.model.layers[0].self_attn
        self.heads, self.kv_heads, self.head_dim = a.num_heads, a.num_kv_heads, a.head_dim
        self.q_size = self.heads * self.head_dim
        self.scale = float(a.attn.scaling)
        # [max_pos, D]: cos | sin halves, every layer's (one config: SGLang's get_rope
        # builds them alike)
        self.cos_sin = a.rotary_emb.cos_sin_cache
        self.w_norm = model.model.norm.weight.data
        self.eps_norm = float(model.model.norm.variance_epsilon)

    @classmethod
    def build(cls, dw: Any) -> LeanDraft | None:
        """A LeanDraft for the draft worker `dw`'s model, None (logged) where it cannot
        reproduce it."""
        why = _unsupported(dw)
        if why is not None:
            log.info("draft forward through SGLang's model runner: %s", why)
            return None
        log.info("draft forward: sloserve's lean decoder on SGLang's draft weights and KV")
        return cls(dw)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                table: torch.Tensor, rows: torch.Tensor, q_lens: torch.Tensor,
                starts: torch.Tensor) -> torch.Tensor:
        """Segments of tokens through the draft, returning each segment's last row's logits.

        tokens, positions, slots [T] int64: the tokens, their positions and the KV slots
        their keys and values are written to; segment b is rows rows[b] .. rows[b] +
        q_lens[b] - 1 at positions starts[b] .. starts[b] + q_lens[b] - 1, attending to
        its keys at table[b, :starts[b] + q_lens[b]] ([B, W] int64 slots by position,
        block size 1), causally. -> [B, N] float32 (N: the head's rows)."""
        ops = self.ops
        T = tokens.shape[0]
        H, KVH, D = self.heads, self.kv_heads, self.head_dim
        x = self.embed(tokens).float().contiguous()  # [T, hidden] the residual stream
        cos_sin = self.cos_sin.index_select(0, positions)  # [T, D], one gather for all layers
        cos, sin = cos_sin[:, :D // 2], cos_sin[:, D // 2:]
        delta: torch.Tensor | None = None  # the last layer's MLP output, not yet added
        for layer in self.layers:
            h = (ops.rms_norm(x, layer.w_in, layer.eps_in) if delta is None
                 else ops.add_rms_norm(x, delta, layer.w_in, layer.eps_in))
            qkv = _linear(layer.qkv, h).contiguous()  # [T, (H + 2 KVH) D]
            k_cache = layer.pool.get_key_buffer(layer.layer_id)  # [S, KVH, D] float32
            v_cache = layer.pool.get_value_buffer(layer.layer_id)
            ops.rope_store(qkv, cos, sin, slots, k_cache, v_cache, H, KVH)
            q = qkv[:, :self.q_size].view(T, H, D)  # heads contiguous, row stride qkv's
            out = torch.empty((T, H, D), dtype=torch.float32)
            ops.paged_attention_small(q, k_cache, v_cache, rows, q_lens, starts, table, 1,
                                      self.scale, out)
            o = _linear(layer.o, out.view(T, H * D))
            h = ops.add_rms_norm(x, o.contiguous(), layer.w_post, layer.eps_post)
            delta = _linear(layer.down, ops.silu_mul(_linear(layer.gate_up, h).contiguous()))
            delta = delta.contiguous()
        last = rows + q_lens - 1  # [B] each segment's last row
        y = x.index_select(0, last)
        assert delta is not None
        y = ops.add_rms_norm(y, delta.index_select(0, last), self.w_norm, self.eps_norm)
        head = self.model.lm_head
        return head.quant_method.apply(head, y, None).float()  # [B, N]
