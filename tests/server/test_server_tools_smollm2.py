"""#33 on the real model (SmolLM2-135M-Instruct, the n-gram drafter and the default policy):
tool_choice "required" and a named function through the official `openai` client, 50 sampled
answers each (temperature 1, different seeds, every fifth streamed): every answer is a call
whose arguments validate against its function's schema. SmolLM2's chat template has no tool
support, so the tools are offered in the Hermes / Qwen2.5 form in the system message.

The server writes compact JSON (constrained_json_disable_any_whitespace), as the tiny pair's
do: with whitespace allowed between JSON tokens a call has no length bound at temperature 1.
Most calls take 30-50 tokens either way (100 answers: at most 45-67 tokens with whitespace,
38 without), but a rare one runs on in whitespace and is cut at max_tokens, which is no call
(one in 50 at 96 tokens on 2026-11-30, one in 50 at 192 in a CI run on 2026-12-02); without
whitespace the schemas (an enum, a string of at most 8 characters) bound every call."""

from __future__ import annotations

import json

import pytest
from server_testing import start_server
from test_server_tools import forced_calls

from sloserve.runtime.config import EngineConfig
from sloserve.runtime.engine import Engine
from sloserve.runtime.scheduler import SchedulerConfig

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


@pytest.fixture(scope="module")
def server():
    eng = Engine(EngineConfig(model_path="smollm2", drafter="ngram", kv_cache_tokens=32768,
                              scheduler=SchedulerConfig(max_running_requests=16),
                              constrained_json_disable_any_whitespace=True))
    srv = start_server(eng, tool_call_parser="qwen25")
    yield srv
    info = srv.wait_idle()
    srv.stop()
    assert info["kv_pool"]["used_blocks"] == 0, "KV blocks leaked"


@pytest.mark.parametrize("choice", ["required", "named"])
def test_forced_calls_always_validate_on_the_real_model(server, choice):
    tool_choice = "required" if choice == "required" else {
        "type": "function", "function": {"name": "get_weather"}}
    names = ("get_weather", "add") if choice == "required" else ("get_weather",)
    # compact JSON: every call fits (the module docstring)
    answers = forced_calls(server, tool_choice, names, max_tokens=192, workers=10)
    assert len({json.dumps(a) for a in answers}) > 5  # sampled, not one answer
