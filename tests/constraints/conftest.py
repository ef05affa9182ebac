"""Fixtures: the built-in pair's tokenizer (from the tiny pair, built the same way) and grammar
compilers for a model vocabulary larger than the tokenizer's, so the padding ids are covered."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from sloserve.runtime.constraints import GrammarCompiler

PAD = 40  # model vocabulary = tokenizer vocabulary + PAD (ids the tokenizer never produces)


@pytest.fixture(scope="session")
def tokenizer(tiny_pair):
    return AutoTokenizer.from_pretrained(tiny_pair[0])


@pytest.fixture(scope="session")
def vocab(tokenizer) -> int:
    return len(tokenizer) + PAD


@pytest.fixture(scope="session")
def compiler(tokenizer, vocab) -> GrammarCompiler:
    return GrammarCompiler.from_hf(tokenizer, vocab, [tokenizer.eos_token_id])


@pytest.fixture(scope="session")
def compiler_compact(tokenizer, vocab) -> GrammarCompiler:
    """JSON without free whitespace: shorter random walks."""
    return GrammarCompiler.from_hf(tokenizer, vocab, [tokenizer.eos_token_id], any_whitespace=False)



@pytest.fixture(autouse=True)
def _one_intra_op_thread():
    """These tests run thousands of tiny [k + 1, V] ops; on a loaded 2-core machine two intra-op
    threads make each multi-row softmax wait milliseconds at an OpenMP barrier. Results do not
    depend on the thread count."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
