"""A tiny deterministic (target, draft) pair for tests that start SGLang's server on a CPU:
built exactly like the built-in pair (sloserve/runtime/models/builtin.py: same tokenizer,
Llama architecture, the draft = the target's embedding, first layer, final norm and LM head)
but with hidden 64 and 2 target layers, so a server forward costs milliseconds.
Cached under $SLOSERVE_CACHE (default ~/.cache/sloserve)/sglang-tiny-<version>.
"""

from __future__ import annotations

from pathlib import Path

from sloserve.runtime.models.builtin import cache_root, ensure_pair

TINY_VERSION = "v1"  # bump whenever the construction below changes
TINY_SHAPE = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
)
TINY_SEED = 7
# Residual write scale of target layer 2: the 1-layer draft then agrees with the target's
# greedy token often but not always, so both accepted and rejected drafts occur.
TINY_ALPHA = 0.3


def ensure_tiny_pair() -> tuple[Path, Path]:
    """(target, draft) directories, built on first use (about 3 s)."""
    return ensure_pair(
        cache_root() / f"sglang-tiny-{TINY_VERSION}", shape=TINY_SHAPE, seed=TINY_SEED,
        alpha=TINY_ALPHA,
    )
