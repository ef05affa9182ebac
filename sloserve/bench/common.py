"""Shared helpers for benchmark scripts: tables, JSON output, machine description, prompts."""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

import torch

SHARED_PROMPTS = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "prompts" / "spec_bench_questions.jsonl"

# Used when the Spec-Bench prompts are not beside the checkout.
FALLBACK_PROMPTS = [
    "Write a short story about a robot who learns to paint.",
    "Explain how a hash map works and when it is slow.",
    "Translate to German: The weather is nice today and we will walk to the lake.",
    "Summarize: The city council met on Tuesday to discuss the new budget for parks.",
    "What is the capital of Australia, and why was it chosen?",
    "Solve: a train travels 120 km in 1.5 hours. What is its average speed?",
    "def fibonacci(n):\n    # return the n-th Fibonacci number\n",
    "List five tips for writing clear technical documentation.",
]


def ordinary_prompts(n: int) -> list[str]:
    """n prompts: Spec-Bench questions (all categories, round-robin) when available."""
    if SHARED_PROMPTS.is_file():
        rows = [json.loads(line) for line in SHARED_PROMPTS.read_text().splitlines() if line.strip()]
        by_cat: dict[str, list[str]] = {}
        for r in rows:
            by_cat.setdefault(r["category"], []).append(r["turns"][0])
        cats = sorted(by_cat)
        out = [by_cat[cats[i % len(cats)]][i // len(cats) % len(by_cat[cats[i % len(cats)]])] for i in range(n)]
        return out
    return [FALLBACK_PROMPTS[i % len(FALLBACK_PROMPTS)] for i in range(n)]


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
