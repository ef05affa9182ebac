"""Helpers shared by the test packages (imported as `sloserve_testing`)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import torch
from scipy.stats import chi2

TINY_SHAPE = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
)
SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


def hf_greedy(model, prompt_ids: list[int], n: int) -> list[int]:
    """transformers' greedy generate, the reference for token-for-token equality."""
    ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt_ids):].tolist()


def prompts_of_lengths(lengths: list[int], seed: int = 0, vocab: int = 2048) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, vocab, (n,), generator=g).tolist() for n in lengths]


def chi2_pvalue(samples: Counter, dist: dict) -> float:
    """Pearson's test of observed outputs against an exact distribution {output: p}; cells
    expected below 5 are pooled, with any output outside the support."""
    n = sum(samples.values())
    big = [s for s, p in dist.items() if n * p >= 5]
    obs = [samples.get(s, 0) for s in big]
    exp = [n * dist[s] for s in big]
    obs.append(n - sum(obs))
    exp.append(n - sum(exp))
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp) if e > 0)
    if exp[-1] <= 0 and obs[-1] > 0:
        return 0.0
    return float(chi2.sf(stat, len(obs) - 1))


# chat prompts for the real model's tests (tests/runtime/test_smollm2.py, the SGLang one):
# code, facts, a summary, copying, explaining, translating, a code fix, a poem
SMOLLM2_NEW = 64  # answer tokens the smollm2 modules compare (up to <|im_end|>)
SMOLLM2_QUESTIONS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "What is the capital of France? Answer in one sentence.",
    "Summarize in one sentence: The city council met on Tuesday to discuss the new park. "
    "Residents asked for more trees and a playground. The council agreed to fund both.",
    "Repeat this list exactly: apples, pears, plums, cherries, grapes, melons.",
    "Explain photosynthesis to a child.",
    "Translate into French: The weather is nice today.",
    "Fix the bug in this code:\ndef add(a, b):\n    return a - b",
    "Write a haiku about the sea.",
]
