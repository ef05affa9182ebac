"""The distilled draft of SmolLM2-135M-Instruct: its own weights ship in the repository, the
embedding (tied with the LM head) is the target's and is not shipped.

The repository holds `drafts/smollm2-draft.safetensors` (the draft's decoder layers and final
norm, Hugging Face names; matrices int8 with per-row scales, see pack_weights) and `drafts/smollm2-draft.json` (its config.json fields, and the
recipe that produced it: command, corpus, data sizes, measured agreement). `ensure_draft`
assembles an ordinary Hugging Face directory from those and the converted target's
embedding and tokenizer, once, under the target's cache, with a manifest (a broken one is
rebuilt, never loaded). It is made by `python -m sloserve.train_draft`.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

log = logging.getLogger(__name__)

DRAFTS_DIR = Path(__file__).resolve().parent / "drafts"
WEIGHTS = DRAFTS_DIR / "smollm2-draft.safetensors"
CARD = DRAFTS_DIR / "smollm2-draft.json"
# the draft's hot vocabulary (runtime/models/config.py HOT_VOCAB_KEY): the token ids its LM
# head is cut to inside SGLang (sglang_ext/draft_chain.AlignedDraft.use_hot_vocab); made by
# `python -m sloserve.train_draft --phase hot-vocab`
HOT_VOCAB = DRAFTS_DIR / "smollm2-draft-hot-vocab.json"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "chat_template.jinja", "generation_config.json")


def pack_weights(state: dict) -> dict:
    """The shipped form of the draft's own tensors: each matrix as int8 with one float32
    scale per row (`name` int8 [rows, cols], `name.scale` float32 [rows]; scale = the row's
    largest magnitude / 127), vectors (norms) as bf16. Halves the bf16 size; a draft only
    proposes tokens, so its precision never changes what is served, only how often a draft
    token is accepted (the card's agreement is measured on the unpacked weights)."""
    import torch

    out = {}
    for name, t in state.items():
        t = t.detach().float()
        if t.dim() == 2:
            scale = (t.abs().amax(dim=1) / 127).clamp_min(1e-12)
            out[name] = torch.round(t / scale[:, None]).clamp(-127, 127).to(torch.int8)
            out[name + ".scale"] = scale.contiguous()
        else:
            out[name] = t.to(torch.bfloat16).contiguous()
    return out


def unpack_weights(packed: dict) -> dict:
    """float32 tensors under Hugging Face names from pack_weights' form."""
    import torch

    out = {}
    for name, t in packed.items():
        if name.endswith(".scale"):
            continue
        if t.dtype == torch.int8:
            out[name] = t.float() * packed[name + ".scale"].float()[:, None]
        else:
            out[name] = t.float()
    return out


def shipped_draft() -> Path | None:
    """The shipped draft weights, or None when this checkout has none."""
    return WEIGHTS if WEIGHTS.is_file() and CARD.is_file() else None


def draft_config(target_cfg: dict, layers: int) -> dict:
    """config.json of a draft with the target's width, vocabulary and embedding, `layers`
    decoder layers."""
    cfg = dict(target_cfg)
    cfg["num_hidden_layers"] = layers
    cfg["tie_word_embeddings"] = True
    return cfg


def write_draft_dir(out: Path, target_dir: Path, draft_state: dict, layers: int,
                    hot_vocab: Path | None = None) -> None:
    """An HF directory at `out` (must not exist): the draft's own tensors (`draft_state`,
    HF names, torch tensors) plus the target's embedding and tokenizer files; with
    `hot_vocab` (a JSON file {"tokens": [...]}) that file too, named in config.json."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    from sloserve.runtime.models.config import HOT_VOCAB_KEY
    from sloserve.runtime.models.smollm2 import _write_manifest

    target_cfg = json.loads((target_dir / "config.json").read_text())
    with safe_open(str(target_dir / "model.safetensors"), framework="pt") as f:
        embed = f.get_tensor("model.embed_tokens.weight")
    state = {k: v.detach().to(torch.float32).contiguous() for k, v in draft_state.items()}
    state["model.embed_tokens.weight"] = embed
    out.mkdir(parents=True)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = draft_config(target_cfg, layers)
    if hot_vocab is not None:
        shutil.copy(hot_vocab, out / "hot_vocab.json")
        cfg[HOT_VOCAB_KEY] = "hot_vocab.json"
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    for name in _TOKENIZER_FILES:
        if (target_dir / name).is_file():
            shutil.copy(target_dir / name, out / name)
    _write_manifest(out)


def ensure_draft(root: Path, target_dir: Path) -> Path:
    """The assembled draft directory under `root` (built on first use or when broken)."""
    from safetensors.torch import load_file

    from sloserve.runtime.models.smollm2 import cache_problem, file_sha256

    weights = shipped_draft()
    if weights is None:
        raise FileNotFoundError(f"no shipped draft at {WEIGHTS}")
    hot = HOT_VOCAB if HOT_VOCAB.is_file() else None
    key = file_sha256(weights)[:12]
    if hot is not None:  # another head, another directory (and another cost profile)
        key = f"{key}-hot{file_sha256(hot)[:6]}"
    out = root / f"draft-{key}"
    if out.is_dir():
        problem = cache_problem(out)
        if problem is None:
            return out
        log.warning("the cached draft in %s is broken (%s): rebuilding it", out, problem)
        shutil.rmtree(out, ignore_errors=True)
    card = json.loads(CARD.read_text())
    staging = Path(tempfile.mkdtemp(prefix=".building-draft-", dir=root))
    t0 = time.perf_counter()
    try:
        write_draft_dir(staging / "draft", target_dir, unpack_weights(load_file(str(weights))),
                        int(card["num_hidden_layers"]), hot)
        try:
            os.rename(staging / "draft", out)
        except OSError:
            if cache_problem(out) is not None:
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log.info("assembled the SmolLM2 draft in %s in %.1f s", out, time.perf_counter() - t0)
    return out
