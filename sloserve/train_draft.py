"""Distil a small draft model for SmolLM2-135M-Instruct on this machine, resumably.

    python -m sloserve.train_draft --out ~/.cache/sloserve/train-draft/run1   # all phases
    python -m sloserve.train_draft --out DIR --phase eval                      # agreement only
    python -m sloserve.train_draft --out DIR --export                          # ship the weights
    python -m sloserve.train_draft --out DIR --phase eval-answers   # held-out answers only
    python -m sloserve.train_draft --out DIR --phase hot-vocab      # the draft's hot vocabulary
    python -m sloserve.train_draft --write-prompts P.jsonl.gz --gsm8k G --german D --templated N
    python -m sloserve.train_draft --device cuda --prompts P.jsonl.gz ...      # on a GPU

Phases (each resumes where the last run stopped; a run can span sessions):
1. prompts: a deterministic prompt mix from the seed: the Spec-Bench questions of the
   training split (../shared/data/prompts/spec_bench_questions.jsonl, when present; the
   held-out split is never trained on), and instructions built from text this machine has
   (functions of Python's standard library: explain / document / rewrite / test; module
   docstrings and package descriptions: summarise / extract / translate / answer; templated
   arithmetic word problems; writing and explanation topics).
2. generate: the target's own answers to those prompts with sloserve's engine (greedy for
   most, temperature 0.7 for every fourth), appended to answers.jsonl as they finish.
3. distil: a Llama draft of --layers decoder layers (initialised from the target's first
   layers; the target's embedding / tied LM head shared and frozen; final norm trainable),
   trained on the answers by full-vocabulary KL(target || draft) on answer tokens, bf16
   autocast where the CPU has bf16 matmuls, AdamW with warm-up and cosine decay, a
   checkpoint every --checkpoint-minutes (atomic), the data order fixed by the seed.
4. eval: held-out greedy per-token top-1 agreement with the target, per category, on the
   target's greedy answers to the held-out Spec-Bench prompts (kept whole up to 4,096
   tokens).

With --device cuda the same recipe runs at GPU scale (the section "the accelerator flow"
below): FastLlama answers in large batches, the teacher's logits are computed live.

Where the job stands is always in DIR/status.json (and DIR/log.txt), not only on the
terminal. --export writes the draft's own weights (not the shared embedding) and its card
(config, recipe, data sizes, agreement) into sloserve/runtime/models/drafts/.
"""

from __future__ import annotations

import argparse
import ast
import json
import logging
import math
import os
import random
import sys
import time
from pathlib import Path
from typing import Literal

log = logging.getLogger("sloserve.train_draft")



# ---------------------------------------------------------------- prompts

def spec_bench():
    """The Spec-Bench questions beside the checkout ([] where absent)."""
    from sloserve.replay.specbench import SHARED_PROMPTS, load_spec_bench

    return load_spec_bench(SHARED_PROMPTS) if SHARED_PROMPTS.is_file() else []


def _stdlib_functions(rng: random.Random, n: int) -> list[str]:
    import sysconfig

    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    out: list[str] = []
    for f in files:
        try:
            src = f.read_text()
            tree = ast.parse(src)
        except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.end_lineno is not None:
                lines = src.splitlines()[node.lineno - 1:node.end_lineno]
                if 4 <= len(lines) <= 30:
                    out.append("\n".join(lines))
    rng.shuffle(out)
    return out[:n]


def _paragraphs(rng: random.Random, n: int) -> list[str]:
    import sysconfig

    paras: list[str] = []
    for f in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        try:
            doc = ast.get_docstring(ast.parse(f.read_text()))
        except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
            continue
        if doc:
            paras += [p.strip() for p in doc.split("\n\n") if 200 <= len(p.strip()) <= 1200]
    site = Path(sysconfig.get_paths()["purelib"])
    for meta in sorted(site.glob("*.dist-info/METADATA")):
        try:
            body = meta.read_text(errors="ignore").split("\n\n", 1)[-1]
        except OSError:
            continue
        paras += [p.strip() for p in body.split("\n\n")
                  if 200 <= len(p.strip()) <= 1200 and "|" not in p and "http" not in p]
    rng.shuffle(paras)
    return paras[:n]


_TOPICS = ("a lighthouse keeper", "a robot learning to paint", "the first day at a new school",
           "a lost dog finding its way home", "a city under the sea", "an old bookshop",
           "a chess tournament", "a mountain village in winter", "a time traveller",
           "a friendly dragon", "a garden that grows at night", "a detective and a missing key")
_CONCEPTS = ("photosynthesis", "inflation", "recursion", "the water cycle", "gravity",
             "compound interest", "machine learning", "the immune system", "democracy",
             "plate tectonics", "supply and demand", "climate change", "a hash table",
             "the Pythagorean theorem", "electric circuits", "the French Revolution",
             "vaccines", "black holes", "binary numbers", "renewable energy")
_LANGS = ("French", "German", "Spanish")


def _math_prompt(rng: random.Random) -> str:
    a, b, c = rng.randint(2, 90), rng.randint(2, 40), rng.randint(2, 12)
    return rng.choice([
        f"A shop sells pencils for {c} dollars each. Tom buys {b} pencils and pays with "
        f"{b * c + a} dollars. How much change does he get? Explain step by step.",
        f"A train travels {a * c} km in {c} hours. What is its average speed in km per hour?",
        f"Sara has {a} apples. She gives {min(a - 1, b)} to her friends and then buys {c} more. "
        "How many apples does she have now?",
        f"Calculate {a} * {b} + {c}. Show your steps.",
        f"A rectangle is {a} cm long and {b} cm wide. What are its area and perimeter?",
        f"If {c} workers build a wall in {b} days, how many days do {c * 2} workers need?",
    ])


_PERSONAS = ("a pirate captain", "a famous chef", "a detective in 1920s London", "a tour guide "
             "in Rome", "a medieval knight", "an astronaut on the Moon", "a kindergarten teacher",
             "a wise old wizard", "a sports commentator", "a museum curator", "a doctor",
             "a startup founder pitching to investors", "a park ranger", "a barista",
             "a librarian", "an elf from a fantasy novel", "a news anchor", "a personal trainer")
_FORMS = ("a blog post", "a persuasive essay", "a product description", "a cover letter",
          "a short story", "a poem", "a speech", "a travel guide entry", "a formal email",
          "a limerick", "a diary entry", "a restaurant review", "a press release",
          "a letter to a friend", "a motivational message", "a social media post")
_STEM = ("photosynthesis", "recursion", "the water cycle", "gravity", "machine learning",
         "the immune system", "plate tectonics", "a hash table", "the Pythagorean theorem",
         "electric circuits", "vaccines", "black holes", "binary numbers", "renewable energy",
         "DNA replication", "quantum entanglement", "the speed of light", "enzymes", "entropy",
         "neural networks", "the periodic table", "volcanoes", "antibiotics", "semiconductors",
         "climate models", "prime numbers", "sorting algorithms", "the greenhouse effect",
         "cell division", "nuclear fusion", "public-key cryptography", "ocean currents")
_HUMANITIES = ("the French Revolution", "democracy", "supply and demand", "inflation",
               "the Renaissance", "existentialism", "the Cold War", "the Industrial Revolution",
               "utilitarianism", "the printing press", "globalisation", "the Roman Empire",
               "impressionist painting", "the Silk Road", "human rights", "opportunity cost",
               "the role of social media in politics", "Shakespeare's tragedies",
               "the causes of World War I", "minimalism in architecture", "game theory",
               "the ethics of artificial intelligence", "the history of jazz", "urbanisation")
_CODE_TASKS = ("reverses a string", "checks whether a number is prime",
               "returns the n-th Fibonacci number", "merges two sorted lists",
               "counts the words in a text", "finds the longest common prefix of a list of "
               "strings", "removes duplicates from a list while keeping the order",
               "checks whether a string is a palindrome", "computes the factorial of n",
               "flattens a nested list", "finds the second largest number in a list",
               "converts a Roman numeral to an integer", "implements binary search",
               "validates an email address", "transposes a matrix",
               "returns the most frequent element of a list", "implements a stack class",
               "parses a CSV line into fields", "computes the greatest common divisor",
               "groups a list of words by their anagrams", "implements bubble sort",
               "counts the vowels in a string", "rotates a list by k positions",
               "finds all pairs in a list that sum to a target")
_NAMES = ("Alice", "Bob", "Carol", "David", "Emma", "Frank", "Grace", "Henry", "Ivy", "Jack")


def _mtbench_like(rng: random.Random, n: int, paragraphs: list[str]) -> list[tuple[str, str]]:
    """(category, prompt) pairs in the eight MT-bench categories of Spec-Bench, templated."""
    out: list[tuple[str, str]] = []
    for _ in range(n):
        cat = rng.choice(("writing", "roleplay", "reasoning", "math", "coding", "extraction",
                          "stem", "humanities"))
        if cat == "writing":
            p = f"Write {rng.choice(_FORMS)} about {rng.choice(_TOPICS + _HUMANITIES + _STEM)}."
            if rng.random() < 0.3:
                p += f" Keep it under {rng.choice((100, 150, 200, 300))} words."
        elif cat == "roleplay":
            p = f"Pretend you are {rng.choice(_PERSONAS)}. " + rng.choice((
                "Describe your typical day.", f"Explain {rng.choice(_STEM + _HUMANITIES)} to me.",
                "What advice would you give to someone just starting out?",
                "Tell me about the most memorable moment of your career.",
                f"Convince me to visit {rng.choice(('Paris', 'Tokyo', 'Cairo', 'Lima'))}."))
        elif cat == "reasoning":
            a, b, c = rng.sample(_NAMES, 3)
            x, y = rng.randint(2, 9), rng.randint(2, 9)
            p = rng.choice((
                f"{a} is taller than {b}, and {b} is taller than {c}. Who is the shortest? "
                "Explain your reasoning.",
                f"What comes next in the sequence {x}, {2 * x}, {4 * x}, {8 * x}? Explain.",
                f"If {a} has {x} apples and gives half to {b}, who then gives {y} to {c}, "
                f"can {c} have more than {a}? Think step by step.",
                f"{a} is {x} years older than {b}. In {y} years {a} will be twice as old as "
                f"{b}. How old is {b} now?",
                "A bat and a ball cost $1.10 in total. The bat costs $1.00 more than the ball."
                " How much does the ball cost? Explain step by step.",
                f"There are {x} red and {y} blue balls in a bag. If you take one at random, "
                "what is the probability that it is red?"))
        elif cat == "math":
            u, v, w = rng.randint(2, 20), rng.randint(1, 50), rng.randint(51, 200)
            p = rng.choice((f"Solve for x: {u}x + {v} = {w}.",
                            f"What is the area of a circle with radius {u}?",
                            f"Find the sum of the first {w} positive integers.",
                            f"How many ways can you choose {u % 5 + 2} items from {u + 6}?",
                            f"Find the derivative of f(x) = {u}x^3 + {v}x^2 - x + {w}.",
                            f"A triangle has sides {u}, {u + 1} and {u + 2}. Is it acute, "
                            "right or obtuse?",
                            f"What is {v}% of {w}?",
                            f"Solve the system: x + y = {w}, x - y = {v}."))
        elif cat == "coding":
            lang = rng.choice(("Python", "Python", "JavaScript", "C++", "Java"))
            p = f"Write a {lang} function that {rng.choice(_CODE_TASKS)}."
            if rng.random() < 0.3:
                p += " Explain its time complexity."
        elif cat == "extraction":
            what = rng.choice(("names and terms", "numbers and dates", "main claims",
                               "technical terms", "key facts"))
            p = (f"Extract the {what} from the following text. Return them as "
                 f"{rng.choice(('a JSON object', 'a bulleted list', 'a table'))}.\n\n"
                 f"{rng.choice(paragraphs)}")
        else:
            pool = _STEM if cat == "stem" else _HUMANITIES
            p = rng.choice((f"Explain {rng.choice(pool)} in simple terms.",
                            f"What are the main ideas behind {rng.choice(pool)}?",
                            f"Compare {rng.choice(pool)} and {rng.choice(pool)}.",
                            f"Why does {rng.choice(pool)} matter today? Give examples.",
                            f"Describe {rng.choice(pool)} to a high-school student."))
        out.append((cat, p))
    return out


def _gsm8k(path: Path) -> list[str]:
    """GSM8K's questions (its train.jsonl: one {"question", "answer"} object per line)."""
    return [json.loads(line)["question"] for line in path.read_text().splitlines()
            if line.strip()]


def _lines(path: Path) -> list[str]:
    """The lines of a text file (gzip where the name ends with .gz)."""
    import gzip

    raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    return [x.strip() for x in raw.decode("utf-8").splitlines() if x.strip()]


def build_prompts(seed: int, gsm8k: Path | None = None, german: Path | None = None,
                  templated: int = 0, source_max: int = 4000) -> list[dict]:
    """The training prompt mix: [{id, category, messages}], deterministic from the seed and
    the files. Optional sources (each adds prompts after the base mix, which they leave as
    it is): GSM8K's training questions (`gsm8k`, math_reasoning), German sentences to
    translate into English, one or two a prompt (`german`, Spec-Bench's translation format),
    and `templated` prompts in the eight MT-bench categories; GSM8K and German give at most
    `source_max` prompts each (a seeded sample). A prompt whose text is one of Spec-Bench's
    questions (either split) is dropped."""
    rng = random.Random(seed)
    out: list[dict] = []
    for q in spec_bench():
        if not q.held_out:
            out.append({"id": f"sb-{q.question_id}", "category": q.category,
                        "messages": [{"role": "user", "content": q.turns[0]}]})
    for i, fn in enumerate(_stdlib_functions(rng, 700)):
        ask = rng.choice(["Explain what this Python function does.",
                          "Add type hints and a docstring to this Python function.",
                          "Rewrite this Python function to make it easier to read.",
                          "Write two unit tests for this Python function.",
                          "Find possible bugs in this Python function."])
        out.append({"id": f"code-{i}", "category": "code",
                    "messages": [{"role": "user", "content": f"{ask}\n\n```python\n{fn}\n```"}]})
    for i, p in enumerate(_paragraphs(rng, 700)):
        kind = rng.choice(["summarization", "extraction", "qa", "translation"])
        ask = {"summarization": "Summarize the following text in two or three sentences.",
               "extraction": "List the key terms and facts in the following text.",
               "qa": "Read the text and answer: what is its main purpose?",
               "translation": f"Translate the following text into {rng.choice(_LANGS)}."}[kind]
        out.append({"id": f"text-{i}", "category": kind,
                    "messages": [{"role": "user", "content": f"{ask}\n\n{p}"}]})
    for i in range(300):
        out.append({"id": f"math-{i}", "category": "math_reasoning",
                    "messages": [{"role": "user", "content": _math_prompt(rng)}]})
    for i in range(300):
        t, c = rng.choice(_TOPICS), rng.choice(_CONCEPTS)
        content = rng.choice([f"Write a short story about {t}.", f"Explain {c} in simple terms.",
                              f"Give me three tips for learning about {c}.",
                              f"Write a poem about {t}.", f"What are the pros and cons of {c}?"])
        out.append({"id": f"chat-{i}", "category": "chat",
                    "messages": [{"role": "user", "content": content}]})
    bench = {" ".join(q.turns[0].split()) for q in spec_bench()}
    extra: list[tuple[str, str, str]] = []  # (id, category, prompt)
    if gsm8k is not None:
        qs = list(enumerate(_gsm8k(gsm8k)))
        random.Random(seed + 4).shuffle(qs)
        extra += [(f"gsm8k-{i}", "math_reasoning", q) for i, q in sorted(qs[:source_max])]
    if german is not None:
        grng = random.Random(seed + 1)
        sents = _lines(german)
        grng.shuffle(sents)
        i, start = 0, len(extra)
        while i < len(sents) and len(extra) - start < source_max:
            k = grng.choice((1, 1, 2))
            extra.append((f"de-{i}", "translation",
                          "Translate German to English: " + " ".join(sents[i:i + k])))
            i += k
    if templated:
        trng = random.Random(seed + 2)
        paras = _paragraphs(random.Random(seed + 3), 2000)
        extra += [(f"tpl-{i}", c, p) for i, (c, p) in
                  enumerate(_mtbench_like(trng, templated, paras))]
    for rid, cat, text in extra:
        if " ".join(text.split()) not in bench:
            out.append({"id": rid, "category": cat,
                        "messages": [{"role": "user", "content": text}]})
    rng.shuffle(out)
    return out


EVAL_NEW = 192  # tokens of each held-out greedy answer
EVAL_PROMPT = 4096  # held-out prompts are kept whole up to this (RAG and summarisation are long)


def eval_prompts() -> list[dict]:
    return [{"id": f"sb-{q.question_id}", "category": q.category,
             "messages": [{"role": "user", "content": q.turns[0]}]}
            for q in spec_bench() if q.held_out]


# ---------------------------------------------------------------- job state

class Job:
    """The output folder: status.json, log.txt, answers, checkpoints."""

    def __init__(self, out: Path):
        self.out = out
        out.mkdir(parents=True, exist_ok=True)
        self.status_path = out / "status.json"
        self.status = json.loads(self.status_path.read_text()) if self.status_path.is_file() \
            else {}
        handler = logging.FileHandler(out / "log.txt")
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        logging.getLogger().addHandler(handler)

    def update(self, **kw) -> None:
        self.status.update(kw, updated=time.strftime("%Y-%m-%d %H:%M:%S"))
        tmp = self.status_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.status, indent=1))
        os.replace(tmp, self.status_path)


def _engine(threads: int):
    from sloserve.runtime.config import EngineConfig
    from sloserve.runtime.engine import Engine
    from sloserve.runtime.scheduler import SchedulerConfig

    return Engine(EngineConfig(model_path="smollm2", drafter="none", spec_policy="ar",
                               kv_cache_tokens=65536, num_threads=threads,
                               scheduler=SchedulerConfig(max_running_requests=48,
                                                         max_step_tokens=4096)))


def fit_prompt(ids: list[int], limit: int, tail: int = 8) -> list[int]:
    """A prompt of at most `limit` tokens: a longer one keeps its head and its last `tail`
    tokens (the chat template's assistant header), so it is still a question to answer."""
    return ids if len(ids) <= limit else ids[:limit - tail] + ids[-tail:]


def generate(job: Job, prompts: list[dict], path: Path, max_new: int, threads: int,
             token_budget: int, sample_every: int = 4, max_prompt: int = 768) -> None:
    """Append the target's answers to `path` (jsonl), skipping prompts already answered,
    until every prompt is answered or `token_budget` answer tokens are on disk. Prompts
    over max_prompt tokens are cut by fit_prompt."""
    from tqdm import tqdm

    from sloserve.runtime.request import SamplingParams

    done, tokens = set(), 0
    if path.is_file():
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            done.add(rec["id"])
            tokens += len(rec["output_ids"])
    todo = [p for p in prompts if p["id"] not in done]
    if not todo or tokens >= token_budget:
        return
    eng = _engine(threads)
    tok = eng.tokenizer
    bar = tqdm(total=token_budget, initial=min(tokens, token_budget), unit="tok",
               desc=f"generate {path.name}", mininterval=10)
    chunk = 96
    for i in range(0, len(todo), chunk):
        part = todo[i:i + chunk]
        texts = [tok.apply_chat_template(p["messages"], add_generation_prompt=True,
                                          tokenize=False) for p in part]
        ids = [fit_prompt(tok(t, add_special_tokens=False)["input_ids"], max_prompt)
               for t in texts]
        params = [SamplingParams(max_new_tokens=max_new, temperature=0.7,
                                 seed=hash_id(p["id"]))
                  if sample_every and hash_id(p["id"]) % sample_every == 0 else
                  SamplingParams(max_new_tokens=max_new, temperature=0.0) for p in part]
        outs = eng.generate(ids, params)
        with open(path, "a") as f:
            for p, pid, sp, o in zip(part, ids, params, outs):
                f.write(json.dumps({"id": p["id"], "category": p["category"], "prompt_ids": pid,
                                    "output_ids": o["output_ids"],
                                    "greedy": sp.temperature == 0}) + "\n")
                tokens += len(o["output_ids"])
        bar.update(min(tokens, token_budget) - bar.n)
        job.update(phase=f"generate {path.name}", answered=len(done) + i + len(part),
                   prompts=len(prompts), answer_tokens=tokens, token_budget=token_budget)
        if tokens >= token_budget:
            break
    bar.close()


HOT_NEW = 160  # tokens of each answer the hot vocabulary is counted on
HOT_SIZES = (4096, 8192, 16384, 32768)  # sizes whose held-out coverage the card records


def build_hot_vocab(job: Job, size: int, n_prompts: int, seed: int, threads: int) -> Path:
    """The draft's hot vocabulary (FR-Spec's frequency-ranked draft head): the target's
    greedy answers (HOT_NEW tokens) to the first n_prompts prompts of the training mix
    without Spec-Bench's questions (OUT/hot_answers.jsonl, resumable); every tenth answer
    held out, the rest counted; tokens ranked by their count in those answers, then in
    their prompts, then by id; the top `size` written with the held-out answers' coverage
    at several sizes into drafts/ (HOT_VOCAB), which smollm2_draft names in the draft's
    config.json."""
    from collections import Counter

    from sloserve.runtime.models.config import load_config
    from sloserve.runtime.models.presets import resolve_dir
    from sloserve.runtime.models.smollm2_draft import HOT_VOCAB

    prompts = [q for q in build_prompts(seed) if not q["id"].startswith("sb-")][:n_prompts]
    path = job.out / "hot_answers.jsonl"
    generate(job, prompts, path, HOT_NEW, threads, n_prompts * HOT_NEW, sample_every=0)
    recs = read_answers(path)
    held = [r for i, r in enumerate(recs) if i % 10 == 9]
    counted = [r for i, r in enumerate(recs) if i % 10 != 9]
    answers = Counter(t for r in counted for t in r["output_ids"])
    in_prompts = Counter(t for r in counted for t in r["prompt_ids"])
    vocab = load_config(resolve_dir("smollm2")).vocab_size
    ranked = sorted(range(vocab), key=lambda t: (-answers[t], -in_prompts[t], t))
    held_tokens = [t for r in held for t in r["output_ids"]]

    def coverage(n: int) -> float:
        top = set(ranked[:n])
        return round(sum(t in top for t in held_tokens) / max(1, len(held_tokens)), 4)

    card = {"tokens": sorted(ranked[:size]), "size": size,
            "held_out_coverage": {str(n): coverage(n) for n in sorted({*HOT_SIZES, size})},
            "answers": {"counted": len(counted), "held_out": len(held),
                        "answer_tokens": sum(answers.values()),
                        "held_out_tokens": len(held_tokens)},
            "recipe": f"python -m sloserve.train_draft --phase hot-vocab --hot-size {size} "
                      f"--hot-prompts {n_prompts} --seed {seed}: the target's greedy answers "
                      f"({HOT_NEW} new tokens, sloserve's engine) to the first {n_prompts} "
                      "prompts of build_prompts(seed) without Spec-Bench's questions; every "
                      "tenth answer held out for the coverage, the rest counted; ranked by "
                      "count in the answers, then in their prompts, then by token id"}
    HOT_VOCAB.write_text(json.dumps(card, separators=(",", ":")) + "\n")
    job.update(phase="done", hot_vocab=str(HOT_VOCAB), size=size,
               held_out_coverage=card["held_out_coverage"])
    log.info("hot vocabulary of %d tokens in %s; held-out coverage %s", size, HOT_VOCAB,
             card["held_out_coverage"])
    return HOT_VOCAB


def hash_id(s: str) -> int:
    h = 2166136261
    for ch in s.encode():
        h = ((h ^ ch) * 16777619) % 2**32
    return h


def read_answers(path: Path) -> list[dict]:
    """Records of a jsonl file (gzip where the name ends with .gz)."""
    import gzip

    text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" \
        else path.read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


# ---------------------------------------------------------------- models

def load_target(target_dir: Path):
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32)
    return m.eval().requires_grad_(False)


def make_draft(target, layers: int):
    """A LlamaForCausalLM of `layers` layers: the target's embedding (tied LM head) shared
    and frozen, layers and final norm initialised from the target's and trainable."""
    import copy

    from transformers import LlamaForCausalLM

    cfg = copy.deepcopy(target.config)
    cfg.num_hidden_layers = layers
    cfg.tie_word_embeddings = True
    draft = LlamaForCausalLM(cfg)
    sd = {k: v for k, v in target.state_dict().items()
          if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers}
    draft.load_state_dict(sd, strict=False)
    draft.model.embed_tokens.weight = target.model.embed_tokens.weight  # shared, frozen
    draft.lm_head.weight = draft.model.embed_tokens.weight
    draft.model.embed_tokens.weight.requires_grad_(False)
    return draft


def own_state(draft) -> dict:
    """The draft's own tensors (HF names): its layers and final norm, not the embedding."""
    return {k: v.detach().clone() for k, v in draft.state_dict().items()
            if k not in ("model.embed_tokens.weight", "lm_head.weight")}


PROMPT_KEEP = 192  # prompt tokens kept before an answer in training (the most recent)


def _batches(records: list[dict], rng: random.Random, max_len: int, batch_tokens: int,
             prompt_keep: int = PROMPT_KEEP):
    """Lists of (record index, input_ids, answer start) of similar lengths, about
    batch_tokens each. The prompt is cut to its last prompt_keep tokens: the draft's
    context in training is shorter than in serving, most of the target's work is saved."""
    seqs = []
    for i, r in enumerate(records):
        prompt = r["prompt_ids"][-prompt_keep:]
        ids = (prompt + r["output_ids"])[:max_len]
        if len(ids) - len(prompt) >= 2:
            seqs.append((i, ids, len(prompt)))
    rng.shuffle(seqs)
    out = []
    for i in range(0, len(seqs), 256):  # sort within windows: little padding, still shuffled
        window = sorted(seqs[i:i + 256], key=lambda s: len(s[1]))
        cur: list = []
        for s in window:
            if cur and (len(cur) + 1) * max(len(s[1]), len(cur[-1][1])) > batch_tokens:
                out.append(cur)
                cur = []
            cur.append(s)
        if cur:
            out.append(cur)
    rng.shuffle(out)
    return out


def _tensors(batch):
    """input_ids, attention mask [B, n] and the loss mask [B, n] (True at positions that
    predict an answer token: start - 1 .. len - 2) of (index, ids, start) rows."""
    import torch

    n = max(len(ids) for _, ids, _ in batch)
    ids = torch.full((len(batch), n), 2, dtype=torch.long)
    att = torch.zeros((len(batch), n), dtype=torch.long)
    loss_mask = torch.zeros((len(batch), n), dtype=torch.bool)
    for i, (_, seq, start) in enumerate(batch):
        ids[i, :len(seq)] = torch.tensor(seq)
        att[i, :len(seq)] = 1
        loss_mask[i, start - 1:len(seq) - 1] = True
    return ids, att, loss_mask


class TargetCache:
    """The target's final (normed) hidden state at every position that predicts an answer
    token, bf16, in one memory-mapped file: the target runs once over the data, and every
    epoch's teacher logits are one matmul with the shared embedding. Rows of record i are
    offsets[i] .. offsets[i] + count[i], in answer order (position start - 1 onwards)."""

    def __init__(self, path: Path, records: list[dict], max_len: int, hidden: int):
        import numpy as np

        self.counts = []
        for r in records:
            prompt = r["prompt_ids"][-PROMPT_KEEP:]
            self.counts.append(max(0, min(len(prompt) + len(r["output_ids"]), max_len)
                                   - len(prompt)))
        self.offsets = np.concatenate([[0], np.cumsum(self.counts)]).astype(np.int64)
        self.path, self.progress_path = path, path.with_suffix(".done")
        mode: Literal["r+", "w+"] = "r+" if path.is_file() else "w+"
        self.mem = np.memmap(path, dtype=np.int16, mode=mode,
                             shape=(int(self.offsets[-1]), hidden))
        self.done = int(self.progress_path.read_text()) if self.progress_path.is_file() else 0

    def fill(self, job: Job, target, records: list[dict], max_len: int, batch_tokens: int) -> None:
        import torch
        from tqdm import tqdm

        bar = tqdm(total=len(records), initial=self.done, unit="answer", desc="target states",
                   mininterval=10)
        while self.done < len(records):
            rows: list[tuple[int, list[int], int]] = []  # (record, ids, prompt length)
            tokens = 0
            while self.done + len(rows) < len(records) and tokens < batch_tokens:
                i = self.done + len(rows)
                r = records[i]
                prompt = r["prompt_ids"][-PROMPT_KEEP:]
                ids = (prompt + r["output_ids"])[:max_len]
                rows.append((i, ids, len(prompt)))
                tokens += len(ids)
            ids, att, _ = _tensors(rows)
            with torch.no_grad(), _autocast():
                h = target.model(input_ids=ids, attention_mask=att).last_hidden_state
            h = h.to(torch.bfloat16)
            for b, (i, _, start) in enumerate(rows):
                n = self.counts[i]
                if n:
                    rows_h = h[b, start - 1:start - 1 + n].contiguous().view(torch.int16)
                    self.mem[self.offsets[i]:self.offsets[i] + n] = rows_h.numpy()
            self.done += len(rows)
            self.mem.flush()
            self.progress_path.write_text(str(self.done))
            bar.update(len(rows))
            job.update(phase="target states", target_states=self.done, answers=len(records))
        bar.close()

    def hidden(self, batch):
        """[sum of answer positions, hidden] bf16 in the order of _tensors' loss mask."""
        import numpy as np
        import torch

        parts = [self.mem[self.offsets[i]:self.offsets[i] + self.counts[i]] for i, _, _ in batch]
        return torch.from_numpy(np.concatenate(parts)).view(torch.bfloat16)


def _autocast():
    import contextlib

    import torch

    from sloserve.runtime.cpu_tuning import cpu_has_bf16_matmul

    if cpu_has_bf16_matmul():
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def agreement(draft, records: list[dict], max_len: int = 4096, device=None) -> dict:
    """Greedy per-token top-1 agreement of the draft with the target on `records`, the
    target's greedy answers: at each answer position the target's argmax is the answer's
    next token, so agreement = the draft's argmax equals it (teacher-forced on the target's
    path, exactly what greedy speculation accepts). Sequences are cut at max_len tokens
    (after the prompt: a prompt is never cut, a record whose prompt fills max_len would
    count nothing). {category: (agree, total)}."""
    import torch

    res: dict[str, list[int]] = {}
    amp = _autocast() if device is None or device.type == "cpu" else \
        torch.autocast(device.type, dtype=torch.bfloat16)
    with torch.no_grad(), amp:
        for k, r in enumerate(records):
            prompt = r["prompt_ids"]
            seq = (prompt + r["output_ids"])[:max_len]
            ids, att, mask = (t.to(device) if device is not None else t
                              for t in _tensors([(k, seq, len(prompt))]))
            d = draft(input_ids=ids, attention_mask=att).logits[mask].argmax(-1)
            want = ids[0, len(prompt):len(seq)]
            a = res.setdefault(r["category"], [0, 0])
            a[0] += int((want == d).sum())
            a[1] += int(want.numel())
    return {k: (v[0], v[1]) for k, v in sorted(res.items())}


def summarize(agree: dict) -> dict:
    per = {k: round(a / max(n, 1), 4) for k, (a, n) in agree.items()}
    return {"per_category": per, "mean_over_categories":
            round(sum(per.values()) / max(len(per), 1), 4)}


def distil(job: Job, target, cache: TargetCache, answers: list[dict], evals: list[dict],
           args) -> None:
    import torch
    import torch.nn.functional as F
    from tqdm import tqdm

    ckpt_path = job.out / "checkpoint.pt"
    draft = make_draft(target, args.layers)
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.98), weight_decay=0.0)
    step, epoch, cursor, tokens_seen = 0, 0, 0, 0
    if ckpt_path.is_file():
        ck = torch.load(ckpt_path, weights_only=False)
        draft.load_state_dict(ck["draft"], strict=False)
        opt.load_state_dict(ck["opt"])
        step, epoch, cursor, tokens_seen = ck["step"], ck["epoch"], ck["cursor"], ck["tokens"]
        log.info("resumed at step %d (epoch %d, batch %d, %d tokens)", step, epoch, cursor,
                 tokens_seen)

    def save() -> None:
        tmp = ckpt_path.with_suffix(".tmp")
        torch.save({"draft": own_state(draft), "opt": opt.state_dict(), "step": step,
                    "epoch": epoch, "cursor": cursor, "tokens": tokens_seen,
                    "layers": args.layers, "seed": args.seed}, tmp)
        os.replace(tmp, ckpt_path)

    total = args.train_tokens
    bar = tqdm(total=total, initial=min(tokens_seen, total), unit="tok", desc="distil",
               mininterval=10)
    last_ckpt, last_eval = time.time(), time.time()
    t_start, tok_start = time.time(), tokens_seen
    draft.train()
    while tokens_seen < total:
        batches = _batches(answers, random.Random(args.seed * 1000 + epoch), args.max_len,
                           args.batch_tokens)
        while cursor < len(batches) and tokens_seen < total:
            ids, att, mask = _tensors(batches[cursor])
            lr = args.lr * min(1.0, (step + 1) / 100) * (
                0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, tokens_seen / total))))
            for g in opt.param_groups:
                g["lr"] = lr
            embed = draft.model.embed_tokens.weight  # [V, hidden], shared and frozen
            with _autocast():
                with torch.no_grad():  # teacher logits [N, V] from the cached states
                    t_logits = (cache.hidden(batches[cursor]).to(embed.dtype) @ embed.T).float()
                d_logits = draft(input_ids=ids, attention_mask=att).logits[mask].float()
            t_logp = F.log_softmax(t_logits, -1)
            loss = F.kl_div(F.log_softmax(d_logits, -1), t_logp, log_target=True,
                            reduction="batchmean")
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            with torch.no_grad():
                top1 = float((t_logits.argmax(-1) == d_logits.argmax(-1)).float().mean())
            n = int(mask.sum())
            tokens_seen += n
            step, cursor = step + 1, cursor + 1
            bar.update(min(tokens_seen, total) - bar.n)
            rate = (tokens_seen - tok_start) / max(time.time() - t_start, 1e-9)
            if step % 10 == 0:
                job.update(phase="distil", step=step, epoch=epoch, tokens=tokens_seen,
                           train_tokens=total, loss=round(float(loss), 4),
                           batch_top1=round(top1, 4), lr=lr,
                           tokens_per_s=round(rate, 1),
                           eta_minutes=round((total - tokens_seen) / max(rate, 1e-9) / 60, 1))
            if time.time() - last_ckpt > args.checkpoint_minutes * 60:
                save()
                last_ckpt = time.time()
                log.info("checkpoint at step %d, %d tokens, loss %.3f", step, tokens_seen,
                         float(loss))
            if evals and time.time() - last_eval > args.eval_minutes * 60:
                draft.eval()
                ev = summarize(agreement(draft, evals))
                draft.train()
                job.update(eval=ev, eval_step=step)
                log.info("held-out agreement at step %d: %.3f", step,
                         ev["mean_over_categories"])
                last_eval = time.time()
        if cursor >= len(batches):
            epoch, cursor = epoch + 1, 0
    save()
    bar.close()


def read_bundle(bundle: Path, layers: int) -> dict:
    """A draft's own tensors from a device run's bundle (draft{L}-{k}.safetensors)."""
    from safetensors.torch import load_file

    files = sorted(bundle.glob(f"draft{layers}-*.safetensors"))
    if not files:
        raise SystemExit(f"error: no draft{layers}-*.safetensors in {bundle}")
    state: dict = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


def export(job: Job, target, args, evals: list[dict]) -> None:
    """Write the draft's own weights (int8 per-row, smollm2_draft.pack_weights) and card into the package's drafts/ folder: from
    the job's checkpoint, or with --from-bundle from a device run's bundle (the card then
    records that run's status and --recipe-command). The held-out agreement on the card is
    measured here, on this machine, at export."""
    import platform

    import torch
    from safetensors.torch import save_file

    from sloserve.bench.common import cpu_model
    from sloserve.runtime.models.smollm2_draft import (
        CARD,
        DRAFTS_DIR,
        WEIGHTS,
        pack_weights,
        unpack_weights,
    )

    if args.from_bundle:
        layers = int(args.layers)
        state = read_bundle(args.from_bundle, layers)
        status = json.loads((args.from_bundle / "status.json").read_text())
        made = {"status": status, "command": args.recipe_command,
                "device": args.recipe_device}
    else:
        ck = torch.load(job.out / "checkpoint.pt", weights_only=False)
        layers, state = ck["layers"], ck["draft"]
        made = {"status": job.status, "seed": ck["seed"], "steps": ck["step"],
                "distilled_tokens": ck["tokens"],
                "command": "python -m sloserve.train_draft " + " ".join(sys.argv[1:])}
    if args.from_bundle and made["status"].get("args", {}).get("init_from") not in (None, "None") \
            and CARD.is_file():  # the draft this run started from: its card, as it was
        prev = json.loads(CARD.read_text())
        made["started_from"] = {k: prev[k] for k in ("held_out_agreement", "command", "device",
                                                      "status", "started_from") if k in prev}
    packed = pack_weights(state)
    draft = make_draft(target, layers)
    draft.load_state_dict(unpack_weights(packed), strict=False)  # measure what ships
    ev = summarize(agreement(draft.eval(), evals)) if evals else None
    DRAFTS_DIR.mkdir(parents=True, exist_ok=True)
    save_file(packed, str(WEIGHTS), metadata={"format": "pt"})
    card = {"num_hidden_layers": layers, "held_out_agreement": ev,
            "held_out_agreement_measured_on": f"{cpu_model()} ({platform.machine()}), "
                                              "bf16 autocast where the CPU has it",
            "corpus": CORPUS_RECIPE, **made}
    CARD.write_text(json.dumps(card, indent=1) + "\n")
    log.info("exported %s (%.1f MB) and %s; held-out agreement %s", WEIGHTS,
             WEIGHTS.stat().st_size / 1e6, CARD, ev and ev["mean_over_categories"])


CORPUS_RECIPE = (
    "stage 1 (the draft --init-from starts from; its card is kept as started_from): "
    "prompts: build_prompts(seed 0) = the Spec-Bench questions of the training split (first "
    "turns; the held-out split never trained on) + 700 functions of Python's standard library "
    "(explain / type-hint / rewrite / test / find bugs) + 700 paragraphs of stdlib module "
    "docstrings and installed packages' descriptions (summarise / extract / answer / "
    "translate) + 300 templated arithmetic word problems + 300 writing and explanation "
    "requests; prompts over 768 tokens dropped; answers: the target's own, up to 512 new "
    "tokens, round 0 greedy, later rounds temperature 0.7; 3% of the prompts kept apart for "
    "checkpoint choice; distillation: full-vocabulary KL(target || draft) on answer tokens "
    "(prompt cut to its last 192 tokens), AdamW lr 1e-3, warm-up 100 steps, cosine to 10%, "
    "16k-token batches; draft = target layers 0..L-1 as initialisation, the target's "
    "embedding / tied LM head shared and frozen. Stage 2 (--gsm8k/--german/--templated): "
    "the stage-1 mix + 3,000 of GSM8K's training questions (github openai/grade-school-math "
    "3101c7d, grade_school_math/data/train.jsonl) + 3,000 prompts of one or two German "
    "sentences of Multi30k's training captions (github multi30k/dataset a3d2e0d, "
    "data/task1/raw/train.de.gz; 'Translate German to English: ...', Spec-Bench's form) + "
    "8,000 templated prompts in the eight MT-bench categories (writing, roleplay, reasoning, "
    "math, coding, extraction, stem, humanities); prompts equal to a Spec-Bench question "
    "dropped; answers by FastLlama (bf16), up to 320 new tokens, round 0 greedy, later "
    "rounds temperature 0.7 until the generation cap; distillation as in stage 1 but the "
    "prompt cut to its last 768 tokens, sequences of at most 1152 tokens, 32k-token batches, "
    "the draft's LM head applied at answer positions only")


# ---------------------------------------------------------------- the accelerator's generator
#
# transformers' `generate` reached 5.9k tokens/s on an H200 (2026-11-26): its cache grows by
# concatenation, GQA heads are copied out per step and finished rows decode on to the end.
# This is the target's own forward over a preallocated KV cache, batched, with finished
# rows dropped as they finish. Rows are left-padded; each row's RoPE position is its slot
# minus its padding, the same positions transformers gives a left-padded batch.

class FastLlama:
    """A Llama (transformers' LlamaForCausalLM weights, shared, not copied) that generates
    a batch of prompts with a static KV cache [B, kv_heads, T, head_dim] per layer."""

    def __init__(self, hf):
        import torch

        c = hf.config
        self.heads, self.kv_heads = c.num_attention_heads, c.num_key_value_heads
        self.head_dim = getattr(c, "head_dim", None) or c.hidden_size // self.heads
        self.eps = c.rms_norm_eps
        self.embed = hf.model.embed_tokens.weight  # [V, H], tied LM head
        self.norm = hf.model.norm.weight
        self.layers = [(lyr.input_layernorm.weight, lyr.self_attn.q_proj.weight,
                        lyr.self_attn.k_proj.weight, lyr.self_attn.v_proj.weight,
                        lyr.self_attn.o_proj.weight, lyr.post_attention_layernorm.weight,
                        lyr.mlp.gate_proj.weight, lyr.mlp.up_proj.weight,
                        lyr.mlp.down_proj.weight) for lyr in hf.model.layers]
        theta = float(getattr(c, "rope_theta", None)
                      or (getattr(c, "rope_parameters", None) or {}).get("rope_theta", 10000.0))
        d = self.head_dim
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32,
                                                      device=self.embed.device) / d))

    def _rms(self, x, w):
        import torch

        xf = x.float()
        return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(w.dtype)

    def _rope(self, x, pos):
        """x [B, h, n, d], pos [B, n] (int) -> x rotated at its positions."""
        import torch

        f = pos.float()[..., None] * self.inv_freq  # [B, n, d/2]
        emb = torch.cat((f, f), -1)[:, None]  # [B, 1, n, d]
        cos, sin = emb.cos(), emb.sin()
        half = x.shape[-1] // 2
        rot = torch.cat((-x[..., half:], x[..., :half]), -1)
        return (x.float() * cos + rot.float() * sin).to(x.dtype)

    def generate(self, prompts: list[list[int]], max_new: int, eos: int, temperature: float,
                 generator=None, min_rows: int = 32,
                 chunk_tokens: int = 2**20) -> list[list[int]]:
        """Each prompt's answer (up to and with its first EOS, at most max_new tokens);
        greedy where temperature == 0, else sampled at that temperature. Once half of the
        live rows (at least min_rows) have finished, they leave the batch and its cache. The
        prompts are read in chunks of about chunk_tokens padded positions."""
        import torch
        import torch.nn.functional as F

        dev, dt = self.embed.device, self.embed.dtype
        B, P = len(prompts), max(len(p) for p in prompts)
        T = P + max_new
        pad = torch.tensor([P - len(p) for p in prompts], device=dev)
        ids = torch.full((B, P), eos, dtype=torch.long, device=dev)
        for b, p in enumerate(prompts):
            ids[b, P - len(p):] = torch.tensor(p, device=dev)
        slots = torch.arange(T, device=dev)
        valid = slots[None, :] >= pad[:, None]  # [B, T]: key slots holding a real token
        h, g, d = self.heads, self.heads // self.kv_heads, self.head_dim
        kv = [(torch.empty((B, self.kv_heads, T, d), dtype=dt, device=dev),
               torch.empty((B, self.kv_heads, T, d), dtype=dt, device=dev))
              for _ in self.layers]
        # prefill, in chunks of rows (bounded scratch memory): causal over real tokens; a
        # padding position attends to itself (no NaN rows; no real token reads it)
        pos = (slots[None, :P] - pad[:, None]).clamp(min=0)  # [B, P]
        causal = torch.ones((P, P), dtype=torch.bool, device=dev).tril()[None]
        eye = torch.eye(P, dtype=torch.bool, device=dev)[None]
        last = torch.empty((B, self.embed.shape[1]), dtype=dt, device=dev)  # [B, H]
        rows = max(1, min(chunk_tokens // P, int(2**31 // (h * P * P * 4))))
        for r0 in range(0, B, rows):
            r = slice(r0, r0 + rows)
            allow = ((causal & valid[r, None, :P]) | eye)[:, None]  # [b, 1, P, P]
            x = F.embedding(ids[r], self.embed)  # [b, P, H]
            b = x.shape[0]
            for (n1, wq, wk, wv, wo, n2, wg, wu, wd), (K, V) in zip(self.layers, kv):
                y = self._rms(x, n1)
                q = self._rope((y @ wq.T).view(b, P, h, d).transpose(1, 2), pos[r])
                K[r, :, :P] = self._rope((y @ wk.T).view(b, P, -1, d).transpose(1, 2), pos[r])
                V[r, :, :P] = (y @ wv.T).view(b, P, -1, d).transpose(1, 2)
                att = F.scaled_dot_product_attention(  # kv head j serves q heads j*g..j*g+g-1
                    q, K[r, :, :P].repeat_interleave(g, 1), V[r, :, :P].repeat_interleave(g, 1),
                    attn_mask=allow)
                x = x + att.transpose(1, 2).reshape(b, P, h * d) @ wo.T
                y = self._rms(x, n2)
                x = x + (F.silu(y @ wg.T) * (y @ wu.T)) @ wd.T
            last[r] = self._rms(x[:, -1], self.norm)
        out = torch.full((B, max_new), eos, dtype=torch.long, device=dev)
        row = torch.arange(B, device=dev)  # the original row of each live row
        done = torch.zeros(B, dtype=torch.bool, device=dev)
        bias = torch.zeros((B, T), dtype=torch.float32, device=dev).masked_fill_(~valid, -math.inf)
        for s in range(max_new):
            logits = (last @ self.embed.T).float()  # [b, V]
            if temperature > 0:
                tok = torch.multinomial(F.softmax(logits / temperature, -1), 1,
                                        generator=generator)[:, 0]
            else:
                tok = logits.argmax(-1)
            out[row, s] = tok
            done = done | (tok == eos)
            if s == max_new - 1 or bool(done.all()):
                break
            if len(row) >= min_rows and int(done.sum()) * 2 >= len(row):  # drop finished rows
                keep = (~done).nonzero()[:, 0]
                kv = [(K[keep], V[keep]) for K, V in kv]
                row, done, tok, pad, bias = row[keep], done[keep], tok[keep], pad[keep], bias[keep]
            t = P + s  # the slot this token's K/V goes to
            n = len(row)
            x = F.embedding(tok, self.embed)[:, None]  # [n, 1, H]
            p1 = (t - pad)[:, None]
            for (n1, wq, wk, wv, wo, n2, wg, wu, wd), (K, V) in zip(self.layers, kv):
                y = self._rms(x, n1)
                q = self._rope((y @ wq.T).view(n, 1, h, d).transpose(1, 2), p1)
                K[:, :, t:t + 1] = self._rope((y @ wk.T).view(n, 1, -1, d).transpose(1, 2), p1)
                V[:, :, t:t + 1] = (y @ wv.T).view(n, 1, -1, d).transpose(1, 2)
                qg = q.view(n, self.kv_heads, g, d)  # q heads j*g .. j*g+g-1 read kv head j
                sc = (qg @ K[:, :, :t + 1].transpose(-1, -2)).float() / math.sqrt(d)
                pr = F.softmax(sc + bias[:, None, None, :t + 1], -1).to(dt)
                a = (pr @ V[:, :, :t + 1]).reshape(n, 1, h * d)  # [n, kv, g, d] -> [n, 1, h*d]
                x = x + a @ wo.T
                y = self._rms(x, n2)
                x = x + (F.silu(y @ wg.T) * (y @ wu.T)) @ wd.T
            last = self._rms(x[:, 0], self.norm)
        res = []
        for o in out.tolist():
            res.append(o[:o.index(eos) + 1] if eos in o else o)
        return res


# ---------------------------------------------------------------- the accelerator flow
#
# With --device cuda the same recipe runs at GPU scale: the target (Hugging Face Llama, bf16)
# answers every prompt --rounds times in large padded batches (round 0 greedy, later rounds
# temperature 0.7), and the teacher's logits are computed live in each distillation step
# instead of from a cache. Several drafts (--layers 2,4) train side by side on the same
# teacher logits. Every phase has a wall-clock cap (--gen-minutes, --distil-minutes); the
# sizes actually reached are written into status.json and the bundle.

def load_prompt_records(path: Path, target_dir: Path, max_prompt: int) -> list[dict]:
    """Prompt records with `prompt_ids` (tokenised here with the target's chat template
    when the file has only messages); prompts longer than max_prompt tokens are dropped
    (cutting one would cut its assistant header)."""
    recs = read_answers(path)
    if any("prompt_ids" not in r for r in recs):
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(target_dir))
        for r in recs:
            if "prompt_ids" not in r:
                text = tok.apply_chat_template(r["messages"], add_generation_prompt=True,
                                               tokenize=False)
                r["prompt_ids"] = tok(text, add_special_tokens=False)["input_ids"]
    return [r for r in recs if len(r["prompt_ids"]) <= max_prompt]


def generate_batched(job: Job, target, prompts: list[dict], path: Path, rounds: int,
                     max_new: int, kv_positions: int, deadline: float, seed: int,
                     fast: FastLlama | None = None) -> None:
    """Append the target's answers (round 0 greedy, later rounds temperature 0.7) to `path`,
    batches of similar prompt lengths with at most `kv_positions` padded positions each,
    until every round is done or the deadline passes (checked between batches); with
    `fast`, generated by FastLlama, else by transformers' `generate`."""
    import torch

    eos = int(target.config.eos_token_id)
    pad = int(target.config.pad_token_id if target.config.pad_token_id is not None else eos)
    dev = next(target.parameters()).device
    done = {json.loads(line)["id"] for line in path.read_text().splitlines()} \
        if path.is_file() else set()
    tokens = 0
    order = sorted(prompts, key=lambda r: len(r["prompt_ids"]))
    t0 = time.time()
    for rnd in range(rounds):
        greedy = rnd == 0
        todo = [r for r in order if f"{r['id']}#{rnd}" not in done]
        i = 0
        while i < len(todo):
            if time.time() > deadline:
                log.info("generation stopped at its time cap (round %d, %d answer tokens)",
                         rnd, tokens)
                return
            longest = len(todo[i]["prompt_ids"])
            part: list[dict] = []
            while i < len(todo):  # sorted: the last one added is the longest so far
                longest = max(longest, len(todo[i]["prompt_ids"]))
                if part and (len(part) + 1) * (longest + max_new) > kv_positions:
                    break
                part.append(todo[i])
                i += 1
            if fast is not None:  # sloserve's own batched forward (FastLlama)
                gen = torch.Generator(device=dev).manual_seed(seed * 1000 + rnd * 100_003 + i)
                out = fast.generate([r["prompt_ids"] for r in part], max_new, eos,
                                    0.0 if greedy else 0.7, gen)
            else:
                out = _hf_generate(target, part, max_new, eos, pad, greedy,
                                   seed * 1000 + rnd * 100_003 + i)
            with open(path, "a") as f:
                for r, o in zip(part, out):
                    f.write(json.dumps({"id": f"{r['id']}#{rnd}", "category": r["category"],
                                        "prompt_ids": r["prompt_ids"], "output_ids": o,
                                        "greedy": greedy}) + "\n")
                    tokens += len(o)
            rate = tokens / max(time.time() - t0, 1e-9)
            job.update(phase="generate", round=rnd, rounds=rounds, answered_in_round=i,
                       prompts=len(order), new_answer_tokens=tokens,
                       generate_tokens_per_s=round(rate, 1))
            log.info("round %d: %d/%d prompts, %d answer tokens (%.0f tokens/s)", rnd, i,
                     len(todo), tokens, rate)


def _hf_generate(target, part: list[dict], max_new: int, eos: int, pad: int, greedy: bool,
                 seed: int) -> list[list[int]]:
    """transformers' `generate` on a left-padded batch (the reference FastLlama matches)."""
    import torch
    from transformers import GenerationConfig

    dev = next(target.parameters()).device
    n = max(len(r["prompt_ids"]) for r in part)
    ids = torch.full((len(part), n), pad, dtype=torch.long)
    att = torch.zeros((len(part), n), dtype=torch.long)
    for b, r in enumerate(part):  # left padding
        ids[b, n - len(r["prompt_ids"]):] = torch.tensor(r["prompt_ids"])
        att[b, n - len(r["prompt_ids"]):] = 1
    torch.manual_seed(seed)
    gc = GenerationConfig(max_new_tokens=max_new, do_sample=not greedy,
                          temperature=0.7 if not greedy else None, top_k=None,
                          top_p=None, eos_token_id=eos, pad_token_id=pad)
    with torch.no_grad():
        out = target.generate(input_ids=ids.to(dev), attention_mask=att.to(dev),
                              generation_config=gc)[:, n:].tolist()
    return [o[:o.index(eos) + 1] if eos in o else o for o in out]  # ends with its EOS


def _is_validation(rec_id: str) -> bool:
    """3% of the training prompts (all their rounds) are kept apart to choose checkpoints."""
    return hash_id(rec_id.split("#")[0]) % 100 < 3


def distil_live(job: Job, target, answers: list[dict], evals: list[dict], layers: list[int],
                args, deadline: float, on_check=None) -> dict:
    """Train one draft per entry of `layers` on the same live teacher logits until
    args.train_tokens answer tokens or the deadline. Returns {layers: best own state} (best
    by agreement on the validation answers, checked every args.eval_every steps)."""
    import torch
    import torch.nn.functional as F

    dev = next(target.parameters()).device
    train = [r for r in answers if not _is_validation(r["id"])]
    val = [r for r in answers if _is_validation(r["id"]) and r.get("greedy")][:200]
    drafts = {n: make_draft(target, n).to(dev) for n in layers}
    if args.init_from is not None:  # go on from a shipped draft (int8 per row, as packed)
        from safetensors.torch import load_file

        from sloserve.runtime.models.smollm2_draft import unpack_weights

        init = unpack_weights(load_file(str(args.init_from)))
        depth = 1 + max(int(k.split(".")[2]) for k in init if k.startswith("model.layers."))
        if depth in drafts:
            drafts[depth].load_state_dict(init, strict=False)
            log.info("the %d-layer draft starts from %s", depth, args.init_from)
    for d in drafts.values():  # own layers in float32 (autocast computes in bf16)
        for p in d.parameters():
            if p.requires_grad:
                p.data = p.data.float()
        d.train()
    opts = {n: torch.optim.AdamW([p for p in d.parameters() if p.requires_grad], lr=args.lr,
                                 betas=(0.9, 0.98), weight_decay=0.01)
            for n, d in drafts.items()}
    best: dict[int, tuple[float, dict]] = {}
    step, epoch, tokens_seen = 0, 0, 0
    total = args.train_tokens
    embed = target.model.embed_tokens.weight  # [V, hidden], shared and frozen
    t0 = time.time()
    amp = torch.autocast(dev.type, dtype=torch.bfloat16)

    def check() -> dict:
        res = {}
        for n, d in drafts.items():
            d.eval()
            v = summarize(agreement(d, val, device=dev))["mean_over_categories"] if val else 0.0
            e = summarize(agreement(d, evals, device=dev)) if evals else {}
            d.train()
            if n not in best or v >= best[n][0]:
                best[n] = (v, own_state(d))
            res[n] = {"validation": v, "held_out": e.get("mean_over_categories"),
                      "held_out_per_category": e.get("per_category")}
        if on_check is not None:  # e.g. write the best drafts so far where a caller wants them
            on_check({n: b[1] for n, b in best.items()})
        return res

    if args.init_from is not None:  # where the start stands (and a candidate for best)
        res = check()
        job.update(initial_checks={str(n): r for n, r in res.items()})
        log.info("before training: %s", {n: (r["validation"], r["held_out"])
                                          for n, r in res.items()})
    while tokens_seen < total and time.time() < deadline:
        batches = _batches(train, random.Random(args.seed * 1000 + epoch), args.max_len,
                           args.batch_tokens, args.prompt_keep)
        for batch in batches:
            if tokens_seen >= total or time.time() > deadline:
                break
            ids, att, mask = (t.to(dev) for t in _tensors(batch))
            lr = args.lr * min(1.0, (step + 1) / 100) * (
                0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, max(
                    tokens_seen / total, (time.time() - t0) / max(deadline - t0, 1e-9))))))
            with torch.no_grad(), amp:  # teacher log-probs [N, V]
                h = target.model(input_ids=ids, attention_mask=att).last_hidden_state[mask]
                t_logp = F.log_softmax((h @ embed.T).float(), -1)
            stats = {}
            for n, d in drafts.items():
                for g in opts[n].param_groups:
                    g["lr"] = lr
                with amp:  # the shared head only at answer positions
                    d_logits = d.model(input_ids=ids,
                                       attention_mask=att).last_hidden_state[mask] @ embed.T
                d_logp = F.log_softmax(d_logits.float(), -1)
                loss = F.kl_div(d_logp, t_logp, log_target=True, reduction="batchmean")
                opts[n].zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_([p for p in d.parameters() if p.requires_grad],
                                               1.0)
                opts[n].step()
                with torch.no_grad():
                    top1 = float((t_logp.argmax(-1) == d_logp.argmax(-1)).float().mean())
                stats[n] = {"loss": round(loss.item(), 4), "batch_top1": round(top1, 4)}
                del d_logits, d_logp, loss
            tokens_seen += int(mask.sum())
            step += 1
            if step % 20 == 0:
                rate = tokens_seen / max(time.time() - t0, 1e-9)
                job.update(phase="distil", step=step, epoch=epoch, tokens=tokens_seen,
                           train_tokens=total, lr=lr, drafts=stats,
                           tokens_per_s=round(rate, 1))
            if step % args.eval_every == 0:
                res = check()
                job.update(checks={str(n): r for n, r in res.items()}, check_step=step)
                log.info("step %d, %d tokens, epoch %d: %s", step, tokens_seen, epoch,
                         {n: (r["validation"], r["held_out"]) for n, r in res.items()})
        else:
            epoch += 1
    res = check()
    job.update(phase="distilled", step=step, epoch=epoch, tokens=tokens_seen,
               checks={str(n): r for n, r in res.items()}, check_step=step,
               best_validation={str(n): b[0] for n, b in best.items()})
    log.info("distilled %d tokens in %d steps (%d epochs): %s", tokens_seen, step, epoch,
             {n: r["held_out"] for n, r in res.items()})
    return {n: b[1] for n, b in best.items()}


def write_bundle(bundle: Path, job: Job, states: dict, answers_path: Path | None = None,
                 max_file_bytes: int = 15 * 2**20) -> None:
    """What a device run sends back: each draft's own weights in bf16, in files of at most
    max_file_bytes (draft{L}-{k}.safetensors), the answers (gzip jsonl), status and log."""
    import gzip
    import shutil

    import torch
    from safetensors.torch import save_file

    bundle.mkdir(parents=True, exist_ok=True)
    for n, st in states.items():
        part: dict = {}
        size, k = 0, 0
        for name in sorted(st):
            t = st[name].to(torch.bfloat16).contiguous().cpu()
            if part and size + t.numel() * 2 > max_file_bytes:
                save_file(part, str(bundle / f"draft{n}-{k}.safetensors"))
                part, size, k = {}, 0, k + 1
            part[name] = t
            size += t.numel() * 2
        save_file(part, str(bundle / f"draft{n}-{k}.safetensors"))
    if answers_path is not None and answers_path.is_file() \
            and answers_path.stat().st_size < 40 * 2**20:  # else too large to send back
        with open(answers_path, "rb") as src, gzip.open(bundle / "answers.jsonl.gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
    for name in ("status.json", "log.txt"):
        if (job.out / name).is_file():
            shutil.copy(job.out / name, bundle / name)


def check_fast(target_dir: Path, prompts: list[dict], dev, n: int = 8) -> tuple[int, int]:
    """FastLlama against transformers' `generate` in float32 on `dev` (no TF32), greedy, 32
    new tokens, on n prompts spread over the lengths: (answers the same, n)."""
    import torch
    from transformers import AutoModelForCausalLM

    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        m = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32)
        m = m.to(dev).eval().requires_grad_(False)  # type: ignore[arg-type]
        order = sorted(prompts, key=lambda r: len(r["prompt_ids"]))
        part = order[::max(1, len(order) // n)][:n]
        eos = int(m.config.eos_token_id)
        with torch.no_grad():
            a = FastLlama(m).generate([r["prompt_ids"] for r in part], 32, eos, 0.0)
        b = _hf_generate(m, part, 32, eos, eos, True, 0)
        del m
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    return sum(x == y for x, y in zip(a, b)), len(part)


def run_accelerated(job: Job, target_dir: Path, args) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    t0 = time.time()
    dev = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = True
    target = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.bfloat16)
    target = target.to(dev).eval().requires_grad_(False)  # type: ignore[arg-type]
    prompts_path = args.prompts or (job.out / "prompts.jsonl")
    if not prompts_path.is_file():
        prompts_path.write_text("".join(json.dumps(q) + "\n" for q in build_prompts(
            args.seed, args.gsm8k, args.german, args.templated, args.source_max)))
    prompts = load_prompt_records(prompts_path, target_dir, args.max_prompt)
    fast = None
    if args.generator == "fast":
        same, n = check_fast(target_dir, prompts, dev)
        job.update(fast_check={"same_as_transformers": same, "of": n})
        log.info("FastLlama vs transformers' generate (float32, greedy, 32 tokens): %d of %d "
                 "answers the same", same, n)
        if same < n - 1:  # a near-tie may flip one answer; more is a bug
            raise SystemExit(f"error: FastLlama disagrees with transformers on {n - same} of "
                             f"{n} greedy answers; rerun with --generator hf")
        fast = FastLlama(target)
    answers_path = job.out / "answers.jsonl"
    generate_batched(job, target, prompts, answers_path, args.rounds, args.max_new,
                     args.kv_positions, t0 + args.gen_minutes * 60, args.seed, fast)
    answers = read_answers(answers_path)
    job.update(answers=len(answers), answer_tokens=sum(len(r["output_ids"]) for r in answers),
               generate_seconds=round(time.time() - t0, 1))
    evals_path = args.evals or (job.out / "eval_answers.jsonl")
    evals = read_answers(evals_path) if evals_path.is_file() else []
    layers = [int(x) for x in str(args.layers).split(",")]
    if args.bundle:
        write_bundle(args.bundle, job, {}, answers_path)
    states = distil_live(job, target, answers, evals, layers, args,
                         time.time() + args.distil_minutes * 60,
                         on_check=(lambda st: write_bundle(args.bundle, job, st))
                         if args.bundle else None)
    for n, st in states.items():
        torch.save({"draft": st, "layers": n, "seed": args.seed, "tokens": job.status.get("tokens"),
                    "step": job.status.get("step")}, job.out / f"draft{n}.pt")
    job.update(phase="done", seconds=round(time.time() - t0, 1))
    if args.bundle:
        write_bundle(args.bundle, job, states)


def main(argv: list[str] | None = None) -> int:
    from sloserve.runtime.models.builtin import cache_root

    p = argparse.ArgumentParser(prog="python -m sloserve.train_draft", allow_abbrev=False,
                                description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=cache_root() / "train-draft" / "run1",
                   help="the job's folder: status.json, log.txt, answers, checkpoint")
    p.add_argument("--phase", choices=("all", "generate", "distil", "eval", "eval-answers",
                                        "hot-vocab"),
                   default="all", help="eval-answers: only (re)write OUT/eval_answers.jsonl, "
                   "the target's greedy answers to the held-out questions; hot-vocab: the "
                   "draft's hot vocabulary (--hot-size tokens) into "
                   "sloserve/runtime/models/drafts/")
    p.add_argument("--hot-size", type=int, default=16384,
                   help="hot-vocab: tokens the draft's LM head keeps")
    p.add_argument("--hot-prompts", type=int, default=800,
                   help="hot-vocab: prompts of the mix (Spec-Bench's left out) answered")
    p.add_argument("--export", action="store_true",
                   help="write the checkpoint's draft into sloserve/runtime/models/drafts/")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--layers", default="2",
                   help="draft decoder layers (with --device cuda a list: 2,4 trains both)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="cuda: the accelerator flow (batched generation, live teacher)")
    p.add_argument("--prompts", type=Path, default=None,
                   help="(cuda) prompt records jsonl (messages or prompt_ids); default: built")
    p.add_argument("--evals", type=Path, default=None,
                   help="(cuda) held-out greedy answers jsonl; default: OUT/eval_answers.jsonl")
    p.add_argument("--rounds", type=int, default=4,
                   help="(cuda) answers per prompt: round 0 greedy, then temperature 0.7")
    p.add_argument("--max-prompt", type=int, default=768, help="(cuda) longest prompt kept")
    p.add_argument("--kv-positions", type=int, default=600_000,
                   help="(cuda) padded positions per generation batch")
    p.add_argument("--gen-minutes", type=float, default=60.0, help="(cuda) generation cap")
    p.add_argument("--distil-minutes", type=float, default=60.0, help="(cuda) training cap")
    p.add_argument("--eval-every", type=int, default=500, help="(cuda) steps between checks")
    p.add_argument("--from-bundle", type=Path, default=None,
                   help="with --export: take the draft of --layers from a device run's bundle")
    p.add_argument("--recipe-command", default="",
                   help="with --from-bundle: the command that made the bundle (for the card)")
    p.add_argument("--recipe-device", default="", help="with --from-bundle: where it ran")
    p.add_argument("--bundle", type=Path, default=None,
                   help="(cuda) also write the drafts (bf16, split) and answers here")
    p.add_argument("--gen-tokens", type=int, default=400_000,
                   help="answer tokens the target generates for training (budget)")
    p.add_argument("--max-new", type=int, default=256, help="longest answer generated")
    p.add_argument("--train-tokens", type=int, default=3_000_000,
                   help="answer tokens the distillation runs over (epochs repeat the data)")
    p.add_argument("--batch-tokens", type=int, default=2048)
    p.add_argument("--max-len", type=int, default=640)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--checkpoint-minutes", type=float, default=4.0)
    p.add_argument("--prompt-keep", type=int, default=PROMPT_KEEP,
                   help="prompt tokens kept before an answer in distillation (the latest)")
    p.add_argument("--init-from", type=Path, default=None,
                   help="(cuda) start the draft of that depth from a shipped draft's weights")
    p.add_argument("--generator", choices=("fast", "hf"), default="fast",
                   help="(cuda) who generates: sloserve's batched forward or transformers'")
    p.add_argument("--gsm8k", type=Path, default=None,
                   help="add GSM8K's training questions (its train.jsonl) to the prompt mix")
    p.add_argument("--german", type=Path, default=None,
                   help="add German sentences (a text file, .gz read) to translate")
    p.add_argument("--source-max", type=int, default=4000,
                   help="most prompts taken from each of --gsm8k and --german")
    p.add_argument("--templated", type=int, default=0,
                   help="add this many templated prompts in the MT-bench categories")
    p.add_argument("--write-prompts", type=Path, default=None,
                   help="write the prompt mix (jsonl, gzip where it ends .gz) and stop")
    p.add_argument("--eval-minutes", type=float, default=15.0)
    args = p.parse_args(argv)
    try:  # a list (2,4) trains several drafts side by side: with --device cuda only
        depths = [int(x) for x in str(args.layers).split(",")]
    except ValueError:
        p.error(f"argument --layers: not a number or list of numbers: {args.layers!r}")
    if any(n < 1 for n in depths) or (len(depths) > 1 and (args.device == "cpu"
                                                           or args.export)):
        p.error(f"argument --layers: {args.layers!r}: one positive number (a list such as "
                f"2,4 trains several drafts with --device cuda; --export takes one)")
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(message)s")
    for opt in ("gsm8k", "german"):
        if getattr(args, opt) is not None and not getattr(args, opt).is_file():
            p.error(f"argument --{opt}: no such file: {getattr(args, opt)}")
    if args.write_prompts is not None:
        import gzip

        text = "".join(json.dumps(q) + "\n" for q in build_prompts(
            args.seed, args.gsm8k, args.german, args.templated, args.source_max)).encode()
        args.write_prompts.write_bytes(gzip.compress(text, mtime=0)
                                       if args.write_prompts.suffix == ".gz" else text)
        return 0
    import torch

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    job = Job(args.out)
    job.update(args={k: str(v) for k, v in vars(args).items()})
    from sloserve.runtime.models.presets import resolve_dir

    target_dir = resolve_dir("smollm2")
    if args.from_bundle:
        if not args.export:
            p.error("--from-bundle goes with --export")
        evals_path = args.evals or (job.out / "eval_answers.jsonl")
        export(job, load_target(target_dir), args,
               read_answers(evals_path) if evals_path.is_file() else [])
        return 0
    if args.device != "cpu":
        run_accelerated(job, target_dir, args)
        return 0
    args.layers = int(args.layers)
    if args.phase == "hot-vocab":
        if not 1 <= args.hot_size:
            p.error(f"argument --hot-size: {args.hot_size} is not positive")
        build_hot_vocab(job, args.hot_size, args.hot_prompts, args.seed, args.threads)
        return 0
    if args.phase == "eval-answers":
        generate(job, eval_prompts(), job.out / "eval_answers.jsonl", EVAL_NEW, args.threads,
                 10**9, sample_every=0, max_prompt=EVAL_PROMPT)
        return 0
    if args.phase in ("all", "generate"):
        prompts = build_prompts(args.seed, args.gsm8k, args.german, args.templated,
                                args.source_max)
        (job.out / "prompts.jsonl").write_text("".join(json.dumps(q) + "\n" for q in prompts))
        evals = eval_prompts()
        generate(job, evals, job.out / "eval_answers.jsonl", EVAL_NEW, args.threads, 10**9,
                 sample_every=0, max_prompt=EVAL_PROMPT)  # greedy: the path greedy accepts
        generate(job, prompts, job.out / "answers.jsonl", args.max_new, args.threads,
                 args.gen_tokens)
    if args.phase == "generate":
        return 0
    target = load_target(target_dir)
    evals = read_answers(job.out / "eval_answers.jsonl") \
        if (job.out / "eval_answers.jsonl").is_file() else []
    if args.phase in ("all", "distil"):
        answers = read_answers(job.out / "answers.jsonl")
        job.update(answers=len(answers),
                   answer_tokens=sum(len(r["output_ids"]) for r in answers))
        cache = TargetCache(job.out / f"target_states-{len(answers)}.i16", answers,
                            args.max_len, target.config.hidden_size)
        cache.fill(job, target, answers, args.max_len, args.batch_tokens)
        distil(job, target, cache, answers, evals, args)
    if args.phase in ("all", "distil", "eval") and (job.out / "checkpoint.pt").is_file():
        draft = make_draft(target, args.layers)
        draft.load_state_dict(torch.load(job.out / "checkpoint.pt",
                                         weights_only=False)["draft"], strict=False)
        ev = summarize(agreement(draft.eval(), evals))
        job.update(phase="done", final_eval=ev)
        log.info("held-out agreement: %s", json.dumps(ev))
    if args.export:
        export(job, target, args, evals)
    return 0


if __name__ == "__main__":
    sys.exit(main())
