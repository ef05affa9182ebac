"""The draft-distillation job's own parts (issue #31), on the real target:

- FastLlama, the batched generator of the accelerator flow, gives transformers' greedy
  tokens on a left-padded batch of prompts of different lengths, also when the prompts are
  read in several chunks and finished rows leave the batch mid-way; sampled answers are
  valid tokens ending at EOS or the length cap;
- the prompt mix's optional sources (GSM8K questions, German sentences, templated MT-bench
  prompts) add prompts after the base mix and leave the base mix as it was.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import torch

from sloserve import train_draft

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

QUESTIONS = ("What is 2+2?", "Write a haiku about the sea.",
             "Translate German to English: Ein kleines Mädchen klettert in ein Spielhaus.",
             "Name three primary colours and one thing that is each colour.",
             "Explain recursion to a child in two sentences.", "Say hello.")


@pytest.fixture(scope="module")
def target():
    from sloserve.runtime.models.presets import resolve_dir

    d = resolve_dir("smollm2")
    return d, train_draft.load_target(d)  # float32


def _prompts(target_dir) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(target_dir))
    return [tok(tok.apply_chat_template([{"role": "user", "content": q}],
                                        add_generation_prompt=True, tokenize=False),
                add_special_tokens=False)["input_ids"] for q in QUESTIONS]


def test_fast_llama_gives_transformers_greedy_tokens(target):
    target_dir, model = target
    prompts = _prompts(target_dir)
    assert len({len(p) for p in prompts}) > 2  # left padding is exercised
    eos = int(model.config.eos_token_id)
    # chunk_tokens 3 x the longest prompt: several prefill chunks; min_rows 2: rows that
    # finished ("Say hello." stops early) leave the batch before the others end
    fast = train_draft.FastLlama(model).generate(prompts, 40, eos, 0.0, min_rows=2,
                                                 chunk_tokens=3 * max(map(len, prompts)))
    part = [{"prompt_ids": p} for p in prompts]
    ref = train_draft._hf_generate(model, part, 40, eos, eos, True, 0)
    assert sum(len(r) < 40 for r in ref) >= len(ref) // 2 and any(len(r) == 40 for r in ref)
    assert fast == ref


def test_fast_llama_samples_valid_answers(target):
    target_dir, model = target
    prompts = _prompts(target_dir)[:3]
    eos = int(model.config.eos_token_id)
    fl = train_draft.FastLlama(model)
    a = fl.generate(prompts, 24, eos, 0.7, torch.Generator().manual_seed(1))
    b = fl.generate(prompts, 24, eos, 0.7, torch.Generator().manual_seed(1))
    assert a == b  # the generator's seed decides
    for o in a:
        assert 1 <= len(o) <= 24 and all(0 <= t < model.config.vocab_size for t in o)
        assert eos not in o[:-1]  # cut at its first EOS


def test_prompt_sources_extend_the_base_mix(tmp_path: Path):
    base = train_draft.build_prompts(0)
    gsm = tmp_path / "train.jsonl"
    gsm.write_text("".join(json.dumps({"question": f"Tom has {i} apples. How many?",
                                       "answer": "#### 1"}) + "\n" for i in range(30)))
    de = tmp_path / "train.de.gz"
    de.write_bytes(gzip.compress("".join(f"Ein Hund Nummer {i} läuft.\n"
                                         for i in range(40)).encode()))
    mix = train_draft.build_prompts(0, gsm, de, templated=50, source_max=20)
    by_id = {r["id"]: r for r in mix}
    assert {r["id"] for r in base} <= set(by_id)
    assert all(by_id[r["id"]] == r for r in base)  # the base mix is unchanged
    extra = [r for r in mix if r["id"] not in {b["id"] for b in base}]
    cats = [r["category"] for r in extra]
    assert cats.count("math_reasoning") == 20  # source_max of GSM8K's 30
    de_prompts = [r for r in extra if r["id"].startswith("de-")]
    assert len(de_prompts) == 20 and all(
        r["messages"][0]["content"].startswith("Translate German to English: Ein Hund")
        for r in de_prompts)
    tpl = [r for r in extra if r["id"].startswith("tpl-")]
    assert len(tpl) == 50 and {r["category"] for r in tpl} <= {
        "writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}
    assert mix == train_draft.build_prompts(0, gsm, de, templated=50, source_max=20)


def test_prompt_sources_drop_spec_bench_questions(tmp_path: Path):
    bench = train_draft.spec_bench()
    if not bench:
        pytest.skip("../shared/data/prompts/spec_bench_questions.jsonl is absent")
    held = next(q for q in bench if q.held_out and q.category == "math_reasoning")
    gsm = tmp_path / "train.jsonl"
    gsm.write_text(json.dumps({"question": held.turns[0], "answer": ""}) + "\n"
                   + json.dumps({"question": "A new question?", "answer": ""}) + "\n")
    mix = train_draft.build_prompts(0, gsm)
    texts = [r["messages"][0]["content"] for r in mix if r["id"].startswith("gsm8k-")]
    assert texts == ["A new question?"]
