"""Spec-Bench prompts (`{question_id, category, turns[]}` JSONL) as a prompt source.

Spec-Bench has six tasks: MT-Bench (80 questions in 8 fine categories: writing, roleplay,
reasoning, math, coding, extraction, stem, humanities), translation, summarization, qa,
math_reasoning and rag (80 each). A category name given to the source may be a fine
category or a task name ("mt_bench" selects all 80 MT-Bench questions).

Only the first turn is used: the second MT-Bench turn needs the model's first answer.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sloserve.replay.prompts import Prompt
from sloserve.replay.trace import TraceFormatError, TraceRequest

# the Spec-Bench questions beside the checkout (what benchmarks, the profiler and draft
# distillation read)
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


MT_BENCH_CATEGORIES = (
    "writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities",
)
SPEC_BENCH_TASKS = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")


@dataclass(frozen=True)
class SpecBenchQuestion:
    question_id: int
    category: str
    turns: tuple[str, ...]

    @property
    def task(self) -> str:
        """The Spec-Bench task: "mt_bench" for the MT-Bench categories, else the category."""
        return "mt_bench" if self.category in MT_BENCH_CATEGORIES else self.category

    @property
    def held_out(self) -> bool:
        """In the evaluation split that draft distillation never trains on (train_draft):
        half of each MT-Bench category (10 questions each), a quarter of the others (80)."""
        qid = self.question_id
        return qid % 2 == 1 if self.category in MT_BENCH_CATEGORIES else qid % 4 == 0


def load_spec_bench(path: str | Path) -> list[SpecBenchQuestion]:
    """Load Spec-Bench questions; malformed lines raise `TraceFormatError`."""
    questions = []
    with open(path, encoding="utf-8") as f:
        for line, text in enumerate(f, start=1):
            if not text.strip():
                continue
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as e:
                raise TraceFormatError(path, line, f"invalid JSON: {e.msg}") from None
            questions.append(_question(path, line, obj))
    if not questions:
        raise TraceFormatError(path, None, "no questions")
    return questions


def _question(path: str | Path, line: int, obj: object) -> SpecBenchQuestion:
    if not isinstance(obj, dict):
        raise TraceFormatError(path, line, "expected a JSON object")
    qid, category, turns = obj.get("question_id"), obj.get("category"), obj.get("turns")
    if not isinstance(qid, int) or isinstance(qid, bool):
        raise TraceFormatError(path, line, f"question_id must be an integer, got {qid!r}")
    if not isinstance(category, str) or not category:
        raise TraceFormatError(path, line, f"category must be a non-empty string: {category!r}")
    if (not isinstance(turns, list) or not turns
            or not all(isinstance(t, str) and t for t in turns)):
        raise TraceFormatError(path, line, "turns must be a non-empty list of non-empty strings")
    return SpecBenchQuestion(qid, category, tuple(turns))


class SpecBenchSource:
    """Picks a Spec-Bench question per trace request, uniformly within its category.

    categories: the allowed pool (fine categories or task names); None allows all.
    A request whose category names a category or task of the pool draws from it; any other
    request (category None, or e.g. a BurstGPT model name) draws from the whole pool.
    tokenize (text -> ids) gives prompt lengths; with match_length the tokenized first turn
    is repeated / truncated to the trace's input length and sent as input_ids.
    """

    def __init__(
        self,
        questions: Sequence[SpecBenchQuestion],
        categories: Sequence[str] | None = None,
        tokenize: Callable[[str], Sequence[int]] | None = None,
        match_length: bool = False,
    ):
        if match_length and tokenize is None:
            raise ValueError("match_length needs a tokenize callback")
        allowed = set(categories) if categories else None
        self.pool = [q for q in questions
                     if allowed is None or q.category in allowed or q.task in allowed]
        if not self.pool:
            raise ValueError(f"no Spec-Bench question in categories {sorted(allowed or [])}")
        self.by_name: dict[str, list[SpecBenchQuestion]] = {}
        for q in self.pool:
            self.by_name.setdefault(q.category, []).append(q)
            if q.task != q.category:
                self.by_name.setdefault(q.task, []).append(q)
        self.tokenize = tokenize
        self.match_length = match_length

    def prompt_for(self, request: TraceRequest, rng: np.random.Generator) -> Prompt:
        pool = self.by_name.get(request.category or "", self.pool)
        question = pool[int(rng.integers(0, len(pool)))]
        text = question.turns[0]
        if self.tokenize is None:
            return Prompt(text=text)
        ids = list(self.tokenize(text))
        if not self.match_length:
            return Prompt(text=text, num_tokens=len(ids))
        n = request.input_tokens
        reps = -(-n // max(len(ids), 1))  # ceil
        fitted = (ids * reps)[:n]
        return Prompt(input_ids=tuple(int(i) for i in fitted), num_tokens=n)

    def categories(self) -> list[str]:
        """Names a trace request's category may use to select a pool."""
        return sorted(self.by_name)
