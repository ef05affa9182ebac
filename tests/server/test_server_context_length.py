"""--context-length caps prompt + output tokens per request below the model's window (issue 18
item 4): a request beyond it is a 400 naming the lengths, one without a limit stops at it, and
the cap shows in /v1/models and /model_info."""

from __future__ import annotations

import pytest
from server_testing import start_server, tiny_config

from sloserve.launch import build_parser, config_from_args
from sloserve.runtime.engine import Engine

CTX = 64


@pytest.fixture(scope="module")
def short(tiny_pair):
    srv = start_server(Engine(tiny_config(tiny_pair, context_length=CTX)))
    yield srv
    info = srv.wait_idle()
    srv.stop()
    assert info["kv_pool"]["used_blocks"] == 0, "KV blocks leaked"
    srv.engine.check_idle_integrity()


def test_cli_option():
    parser = build_parser()
    cfg = config_from_args(parser, parser.parse_args(["--context-length", "64"]))
    assert cfg.context_length == 64
    assert config_from_args(parser, parser.parse_args([])).context_length is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--context-length", "1"])


def test_beyond_the_model_window_is_refused(tiny_pair):
    with pytest.raises(ValueError, match="context window of 1024"):
        Engine(tiny_config(tiny_pair, context_length=5000))


def test_cap_is_reported(short):
    with short.client() as c:
        assert c.get("/v1/models").json()["data"][0]["max_model_len"] == CTX
        assert c.get("/model_info").json()["max_context_length"] == CTX


def test_requests_beyond_the_cap_are_a_400(short):
    ids = [11, 57, 300, 42, 7] * 10  # 50 tokens
    with short.client() as c:
        r = c.post("/generate", json={"input_ids": ids, "sampling_params": {
            "max_new_tokens": 20}})
        assert r.status_code == 400, r.text
        msg = r.json()["message"]
        assert r.json()["param"] == "sampling_params.max_new_tokens"
        assert "50 tokens" in msg and "20" in msg and f"context length of {CTX}" in msg
        r = c.post("/v1/completions", json={"model": "m", "prompt": ids, "max_tokens": 15})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
        r = c.post("/generate", json={"input_ids": [7] * CTX})  # no room for one token
        assert r.status_code == 400 and "context" in r.json()["message"]
        # within the cap: served to the last token the cap allows
        ok = c.post("/generate", json={"input_ids": ids, "sampling_params": {
            "max_new_tokens": CTX - 50, "ignore_eos": True, "temperature": 0}})
        assert ok.status_code == 200, ok.text
        assert ok.json()["meta_info"]["completion_tokens"] == CTX - 50
        # no limit given: the cap ends it
        free = c.post("/v1/completions", json={"model": "m", "prompt": ids, "max_tokens": None,
                                               "ignore_eos": True, "temperature": 0})
        assert free.status_code == 200, free.text
        assert free.json()["usage"]["completion_tokens"] == CTX - 50
        assert free.json()["choices"][0]["finish_reason"] == "length"
