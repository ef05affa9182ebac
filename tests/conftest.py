"""Shared fixtures: a tiny model pair built like the built-in one, engines that are checked for
KV leaks after every test, and a transformers reference for greedy decoding."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from sloserve_testing import SMOLLM2_NEW, SMOLLM2_QUESTIONS, TINY_SHAPE  # noqa: E402

from sloserve.runtime.config import EngineConfig  # noqa: E402
from sloserve.runtime.engine import Engine  # noqa: E402
from sloserve.runtime.models.builtin import build_pair  # noqa: E402
from sloserve.runtime.scheduler import SchedulerConfig  # noqa: E402


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory) -> tuple[str, str]:
    """(target, draft) directories of a tiny pair; alpha 0.5 so drafts are often rejected."""
    root = tmp_path_factory.mktemp("tiny") / "pair"
    build_pair(root, shape=TINY_SHAPE, seed=7, alpha=0.5)
    return str(root / "target"), str(root / "draft")


@pytest.fixture
def make_engine(tiny_pair):
    """Factory for engines on the tiny pair; after the test every engine must be idle with its
    KV pool all free and consistent."""
    made: list[Engine] = []

    def factory(**kw) -> Engine:
        sched = kw.pop("scheduler", None) or SchedulerConfig(
            max_running_requests=kw.pop("max_running", 64), max_step_tokens=kw.pop("max_step_tokens", 512)
        )
        kw.setdefault("model_path", tiny_pair[0])
        kw.setdefault("draft_model_path", tiny_pair[1])
        kw.setdefault("dtype", "float32")  # the reference path, compared with transformers
        cfg = EngineConfig(
            kv_cache_tokens=kw.pop("kv_cache_tokens", 16384), block_size=kw.pop("block_size", 8),
            scheduler=sched, **kw,
        )
        eng = Engine(cfg)
        made.append(eng)
        return eng

    yield factory
    for eng in made:
        assert not eng.has_work, "engine left with unfinished requests"
        eng.check_idle_integrity()
        assert eng.scheduler.alloc.num_free == eng.scheduler.alloc.num_blocks, "KV blocks leaked"


@pytest.fixture(scope="session")
def hf_target(tiny_pair):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_pair[0]).eval()
    model.generation_config.eos_token_id = None  # like ignore_eos: EOS is an ordinary token
    return model


@pytest.fixture(scope="session")
def smollm2_reference() -> tuple[list[list[int]], list[list[int]]]:
    """(SMOLLM2_QUESTIONS' prompt ids with the model's chat template, transformers' float32
    greedy answers up to <|im_end|> or SMOLLM2_NEW tokens): computed once a session, for the
    built-in engine's and SGLang's smollm2 modules alike."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sloserve.runtime.models.presets import resolve_dir

    path = str(resolve_dir("smollm2"))
    tok = AutoTokenizer.from_pretrained(path)
    # generation_config.json: stop at <|im_end|> (2) as the engines do. (Clearing
    # eos_token_id to mimic ignore_eos changes transformers' greedy tokens themselves.)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts, answers = [], []
    for q in SMOLLM2_QUESTIONS:
        p = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                    tokenize=True, return_dict=True)["input_ids"]
        with torch.inference_mode():
            out = hf.generate(torch.tensor([p]), max_new_tokens=SMOLLM2_NEW, do_sample=False,
                              pad_token_id=2)[0, len(p):].tolist()
        prompts.append(p)
        answers.append(out)
    return prompts, answers
