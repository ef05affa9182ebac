"""Shared fixtures: a tiny model pair built like the built-in one, engines that are checked for
KV leaks after every test, and a transformers reference for greedy decoding."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from sloserve_testing import TINY_SHAPE  # noqa: E402

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
