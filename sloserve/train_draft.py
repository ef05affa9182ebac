"""Distil a small draft model for SmolLM2-135M-Instruct on this machine, resumably.

    python -m sloserve.train_draft --out ~/.cache/sloserve/train-draft/run1   # all phases
    python -m sloserve.train_draft --out DIR --phase eval                      # agreement only
    python -m sloserve.train_draft --out DIR --export                          # ship the weights

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
   target's greedy answers to the held-out Spec-Bench prompts.

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


def build_prompts(seed: int) -> list[dict]:
    """The training prompt mix: [{id, category, messages}], deterministic from the seed."""
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
    rng.shuffle(out)
    return out


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


def generate(job: Job, prompts: list[dict], path: Path, max_new: int, threads: int,
             token_budget: int, sample_every: int = 4) -> None:
    """Append the target's answers to `path` (jsonl), skipping prompts already answered,
    until every prompt is answered or `token_budget` answer tokens are on disk."""
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
        ids = [tok(t, add_special_tokens=False)["input_ids"][:768] for t in texts]
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


def hash_id(s: str) -> int:
    h = 2166136261
    for ch in s.encode():
        h = ((h ^ ch) * 16777619) % 2**32
    return h


def read_answers(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


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


def _batches(records: list[dict], rng: random.Random, max_len: int, batch_tokens: int):
    """Lists of (record index, input_ids, answer start) of similar lengths, about
    batch_tokens each. The prompt is cut to its last PROMPT_KEEP tokens: the draft's
    context in training is shorter than in serving, most of the target's work is saved."""
    seqs = []
    for i, r in enumerate(records):
        prompt = r["prompt_ids"][-PROMPT_KEEP:]
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
    "embedding / tied LM head shared and frozen")


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
                     max_new: int, kv_positions: int, deadline: float, seed: int) -> None:
    """Append the target's answers (round 0 greedy, later rounds temperature 0.7) to `path`,
    batches of similar prompt lengths with at most `kv_positions` padded positions each,
    until every round is done or the deadline passes (checked between batches)."""
    import torch
    from transformers import GenerationConfig

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
            n = max(len(r["prompt_ids"]) for r in part)
            ids = torch.full((len(part), n), pad, dtype=torch.long)
            att = torch.zeros((len(part), n), dtype=torch.long)
            for b, r in enumerate(part):  # left padding
                ids[b, n - len(r["prompt_ids"]):] = torch.tensor(r["prompt_ids"])
                att[b, n - len(r["prompt_ids"]):] = 1
            torch.manual_seed(seed * 1000 + rnd * 100_003 + i)
            gc = GenerationConfig(max_new_tokens=max_new, do_sample=not greedy,
                                  temperature=0.7 if not greedy else None, top_k=None,
                                  top_p=None, eos_token_id=eos, pad_token_id=pad)
            with torch.no_grad():
                out = target.generate(input_ids=ids.to(dev), attention_mask=att.to(dev),
                                      generation_config=gc)[:, n:].tolist()
            with open(path, "a") as f:
                for r, o in zip(part, out):
                    if eos in o:
                        o = o[:o.index(eos) + 1]  # the answer ends with its EOS
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

    while tokens_seen < total and time.time() < deadline:
        batches = _batches(train, random.Random(args.seed * 1000 + epoch), args.max_len,
                           args.batch_tokens)
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
                with amp:
                    d_logits = d(input_ids=ids, attention_mask=att).logits[mask]
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
    if answers_path is not None and answers_path.is_file():
        with open(answers_path, "rb") as src, gzip.open(bundle / "answers.jsonl.gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
    for name in ("status.json", "log.txt"):
        if (job.out / name).is_file():
            shutil.copy(job.out / name, bundle / name)


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
        prompts_path.write_text("".join(json.dumps(q) + "\n" for q in build_prompts(args.seed)))
    prompts = load_prompt_records(prompts_path, target_dir, args.max_prompt)
    answers_path = job.out / "answers.jsonl"
    generate_batched(job, target, prompts, answers_path, args.rounds, args.max_new,
                     args.kv_positions, t0 + args.gen_minutes * 60, args.seed)
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
    p.add_argument("--phase", choices=("all", "generate", "distil", "eval"), default="all")
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
    if args.phase in ("all", "generate"):
        prompts = build_prompts(args.seed)
        (job.out / "prompts.jsonl").write_text("".join(json.dumps(q) + "\n" for q in prompts))
        evals = eval_prompts()
        generate(job, evals, job.out / "eval_answers.jsonl", 192, args.threads, 10**9,
                 sample_every=0)  # greedy: agreement is measured on the target's greedy path
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
