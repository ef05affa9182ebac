"""Prompt sources and ReplayRequest construction."""

from __future__ import annotations

import json

import numpy as np
import pytest

from sloserve.replay.prompts import SyntheticIdsSource, SyntheticTextSource, build_requests
from sloserve.replay.records import ReplayRequest
from sloserve.replay.specbench import SpecBenchSource, load_spec_bench
from sloserve.replay.trace import TraceFormatError, TraceRequest


def rng() -> np.random.Generator:
    return np.random.default_rng(0)


def test_synthetic_ids_exact_length_and_range():
    src = SyntheticIdsSource(vocab_size=50, id_low=10)
    p = src.prompt_for(TraceRequest(0.0, 300, 5), rng())
    assert p.text is None and len(p.input_ids) == 300 and p.num_tokens == 300
    assert min(p.input_ids) >= 10 and max(p.input_ids) < 50
    with pytest.raises(ValueError):
        SyntheticIdsSource(vocab_size=10, id_low=10)


def test_synthetic_ids_share_prefix_blocks():
    src = SyntheticIdsSource(vocab_size=1000, block_tokens=4, seed=1)
    a = src.prompt_for(TraceRequest(0.0, 10, 1, prefix_hash_ids=(7, 8, 9)), rng())
    b = src.prompt_for(TraceRequest(0.0, 6, 1, prefix_hash_ids=(7, 3)), np.random.default_rng(9))
    assert a.input_ids[:4] == b.input_ids[:4]  # block 7 is the same everywhere
    assert a.input_ids[4:6] != b.input_ids[4:6]
    assert len(a.input_ids) == 10 and len(b.input_ids) == 6


def count_words_plus_bos(text: str) -> int:
    return len(text.split()) + 1


def test_synthetic_text_sized_by_tokenizer_callback():
    src = SyntheticTextSource(count_words_plus_bos)
    p = src.prompt_for(TraceRequest(0.0, 50, 1), rng())
    assert p.input_ids is None and count_words_plus_bos(p.text) == 50 == p.num_tokens

    def chars(text: str) -> int:  # a "tokenizer" with several tokens per word
        return len(text)

    q = SyntheticTextSource(chars).prompt_for(TraceRequest(0.0, 200, 1), rng())
    assert 189 <= len(q.text) <= 200 and q.num_tokens == len(q.text)


SPEC = [
    {"question_id": 81, "category": "writing", "turns": ["write a poem", "shorter"]},
    {"question_id": 90, "category": "coding", "turns": ["write code", "again"]},
    {"question_id": 161, "category": "translation", "turns": ["translate this"]},
    {"question_id": 241, "category": "qa", "turns": ["who is it"], "reference": ["x"]},
]


@pytest.fixture
def questions(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text("".join(json.dumps(q) + "\n" for q in SPEC))
    return load_spec_bench(path)


def test_spec_bench_picks_by_category(questions):
    src = SpecBenchSource(questions)
    g = rng()
    assert src.prompt_for(TraceRequest(0.0, 1, 1, "qa"), g).text == "who is it"
    mt = {src.prompt_for(TraceRequest(0.0, 1, 1, "mt_bench"), g).text for _ in range(50)}
    assert mt == {"write a poem", "write code"}  # the task alias, first turns only
    other = {src.prompt_for(TraceRequest(0.0, 1, 1, "ChatGPT"), g).text for _ in range(100)}
    assert len(other) == 4  # unknown categories draw from the whole pool
    only = SpecBenchSource(questions, categories=["translation"])
    assert only.prompt_for(TraceRequest(0.0, 1, 1, None), g).text == "translate this"
    assert only.categories() == ["translation"]
    with pytest.raises(ValueError):
        SpecBenchSource(questions, categories=["nope"])


def test_spec_bench_lengths_with_tokenizer(questions):
    def tok(text: str) -> list[int]:
        return [len(w) for w in text.split()]

    src = SpecBenchSource(questions, ["qa"], tokenize=tok)
    assert src.prompt_for(TraceRequest(0.0, 7, 1), rng()).num_tokens == 3
    fit = SpecBenchSource(questions, ["qa"], tokenize=tok, match_length=True)
    p = fit.prompt_for(TraceRequest(0.0, 7, 1), rng())
    assert p.input_ids == (3, 2, 2, 3, 2, 2, 3) and p.text is None
    with pytest.raises(ValueError):
        SpecBenchSource(questions, match_length=True)


def test_spec_bench_malformed(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text(json.dumps(SPEC[0]) + "\n" + '{"question_id": 2, "category": "qa"}\n')
    with pytest.raises(TraceFormatError, match=r"q\.jsonl:2: turns must be"):
        load_spec_bench(path)


def test_build_requests():
    trace = [TraceRequest(0.0, 4, 3), TraceRequest(0.5, 5, 9, "qa", None, 0.4, 0.02)]
    reqs = build_requests(trace, SyntheticIdsSource(100), seed=5)
    assert [r.request_id for r in reqs] == ["r000000", "r000001"]
    assert [r.max_new_tokens for r in reqs] == [3, 9] and all(r.ignore_eos for r in reqs)
    assert reqs[1].arrival_s == 0.5 and reqs[1].category == "qa"
    assert (reqs[1].ttft_slo_s, reqs[1].tpot_slo_s) == (0.4, 0.02)
    assert reqs[1].prompt_tokens == 5
    assert build_requests(trace, SyntheticIdsSource(100), seed=5) == reqs  # deterministic
    with pytest.raises(ValueError, match="output_min"):
        build_requests([TraceRequest(0.0, 4, 0)], SyntheticIdsSource(100), seed=0)


def test_replay_request_validation():
    with pytest.raises(ValueError):
        ReplayRequest("a", 0.0, 4)  # neither text nor ids
    with pytest.raises(ValueError):
        ReplayRequest("a", 0.0, 4, text="x", input_ids=(1,))
    with pytest.raises(ValueError):
        ReplayRequest("a", 0.0, 0, text="x")
