"""Shared helpers for benchmark scripts: tables, JSON output, machine description, and
their prompts (Spec-Bench questions, replay/specbench.py `ordinary_prompts`, in a target's
chat template where it has one)."""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

from sloserve.replay.specbench import ordinary_prompts


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info() -> dict:
    from sloserve.runtime.cpu_tuning import cpu_flags, cpu_has_bf16_matmul

    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_model": cpu_model(),
        "cpu_bf16_matmul": cpu_has_bf16_matmul(),
        "cpu_features": sorted(cpu_flags() & {"avx2", "avx512f", "avx512_bf16", "amx_bf16",
                                               "amx_tile"}),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def print_table(header: list[str], rows: list[list]) -> None:
    cells = [[str(c) for c in header]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    line = "| " + " | ".join(h.ljust(w) for h, w in zip(cells[0], widths)) + " |"
    print(line)
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in cells[1:]:
        print("| " + " | ".join(c.rjust(w) for c, w in zip(r, widths)) + " |")


def write_json(path: str, data: dict) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(data, indent=2, default=float))
    print(f"wrote {p}")


def bench_prompts(target: str, prompt_tokens: int, chat: str,
                  n: int = 64) -> tuple[list[list[int]], bool]:
    """(n prompts as token ids, whether in the chat template): Spec-Bench questions, its
    categories round-robin (so every batch mixes them), cut to prompt_tokens."""
    questions = ordinary_prompts(n)
    if chat != "off":
        from transformers import AutoTokenizer

        hf = AutoTokenizer.from_pretrained(target)
        if hf.chat_template:
            ids: list[list[int]] = []
            for q in questions:
                enc: Any = hf.apply_chat_template(
                    [{"role": "user", "content": q[:4 * prompt_tokens]}],
                    add_generation_prompt=True, tokenize=True, return_dict=True)
                ids.append([int(t) for t in enc["input_ids"]])
            # a long question keeps its head and the template's tail (the assistant turn)
            return [x if len(x) <= prompt_tokens else x[: prompt_tokens - 8] + x[-8:]
                    for x in ids], True
        if chat == "on":
            sys.exit(f"--chat on: {target} has no chat template")
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(target) / "tokenizer.json"))
    return [tok.encode(q).ids[:prompt_tokens] for q in questions], False
