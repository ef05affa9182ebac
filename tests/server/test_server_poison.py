"""Issue 34, acceptance 1: no request can stop the server or fail its neighbours. Each poison
is sent while 8 ordinary greedy requests run: the poison gets a 400 or a served answer, the 8
get exactly the tokens they get alone, /health answers 200 throughout, no engine step fails,
and the KV pool is all free afterwards."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from server_testing import start_server, tiny_config

from sloserve.runtime.engine import Engine

ORDINARY = [[11 + i, 57, 300 + 7 * i, 42, 9] for i in range(8)]
GREEDY = {"max_new_tokens": 24, "temperature": 0.0, "ignore_eos": True}
P = [11, 57, 300, 42, 9]
CHAT = [{"role": "user", "content": "hi"}]
REF_LOOP = {"$defs": {"x": {"$ref": "#/$defs/x"}}, "$ref": "#/$defs/x"}
DEEP = "[" * 10000 + "]" * 10000


def _raw(digits: int, where: str) -> str:
    """A /generate body with a number literal of `digits` digits in `where`."""
    big = "1" * digits
    head = '{"input_ids": ' + json.dumps(P) + ', "sampling_params": {"max_new_tokens": 4, '
    if where == "temperature":
        return head + '"temperature": ' + big + "}}"
    if where == "float":
        return head + '"top_p": 0.' + big + "}}"
    schema = json.dumps('{"type": "integer", "maximum": ' + big + "}")
    return head + '"json_schema": ' + schema + "}}"


# (name, path, body: dict or raw JSON text)
POISONS = [
    ("n 10**6 generate", "/generate", {"input_ids": P, "sampling_params": {"n": 10**6}}),
    ("n 10**30 completions", "/v1/completions", {"model": "m", "prompt": P, "n": 10**30}),
    ("n 2**63 chat", "/v1/chat/completions", {"model": "m", "messages": CHAT, "n": 2**63}),
    ("repetition_penalty 1e-300", "/generate", {"input_ids": P, "sampling_params": {
        "max_new_tokens": 16, "repetition_penalty": 1e-300, "temperature": 1.0}}),
    ("repetition_penalty 1e-320 regex stream", "/generate", {
        "input_ids": P, "stream": True, "sampling_params": {
            "max_new_tokens": 8, "repetition_penalty": 1e-320, "regex": "[a-z ]+"}}),
    ("$ref loop schema", "/generate", {"input_ids": P, "sampling_params": {
        "json_schema": json.dumps(REF_LOOP)}}),
    ("$ref loop response_format", "/v1/chat/completions", {
        "model": "m", "messages": CHAT, "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": REF_LOOP}}}),
    ("temperature 1e-300 logprobs", "/generate", {
        "input_ids": P, "return_logprob": True, "top_logprobs_num": 5,
        "sampling_params": {"max_new_tokens": 8, "temperature": 1e-300}}),
    ("temperature 1e-38 logprobs regex", "/generate", {
        "input_ids": P, "return_logprob": True, "sampling_params": {
            "max_new_tokens": 8, "temperature": 1e-38, "regex": "[a-z]+"}}),
    ("temperature 1e-300 chat logprobs", "/v1/chat/completions", {
        "model": "m", "messages": CHAT, "max_tokens": 8, "temperature": 1e-300,
        "logprobs": True, "top_logprobs": 3}),
    ("temperature 1e-5 repetition_penalty 1e-30", "/generate", {
        "input_ids": P, "return_logprob": True, "sampling_params": {
            "max_new_tokens": 8, "temperature": 1e-5, "repetition_penalty": 1e-30}}),
    ("10k-deep schema string", "/generate", {"input_ids": P, "sampling_params": {
        "json_schema": DEEP}}),
    ("10k-deep schema completions", "/v1/completions", {"model": "m", "prompt": P,
                                                        "json_schema": DEEP}),
    ("10k-deep schema chat", "/v1/chat/completions", {"model": "m", "messages": CHAT,
                                                      "json_schema": DEEP}),
    ("number of 5000 digits", "/generate", _raw(5000, "temperature")),
    ("number of 10**6 digits", "/generate", _raw(10**6, "temperature")),
    ("fraction of 10**6 digits", "/generate", _raw(10**6, "float")),
    ("schema number of 5000 digits", "/generate", _raw(5000, "schema")),
    ("top_logprobs_num 10**6", "/generate", {"input_ids": P, "return_logprob": True,
                                             "top_logprobs_num": 10**6}),
    ("2000-prompt batch", "/generate", {"text": ["hi"] * 2000,
                                        "sampling_params": {"max_new_tokens": 1}}),
]


@pytest.fixture(scope="module")
def server(tiny_pair):
    srv = start_server(Engine(tiny_config(tiny_pair)))
    yield srv
    info = srv.wait_idle()
    alive, failed = srv.state.aengine.alive, srv.state.aengine.failed_steps
    srv.stop()
    assert info["kv_pool"]["used_blocks"] == 0, "KV blocks leaked"
    assert alive and failed == 0
    srv.engine.check_idle_integrity()


def _ordinary(c: httpx.Client, prompt: list[int]) -> list[int]:
    r = c.post("/generate", json={"input_ids": prompt, "sampling_params": GREEDY})
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


@pytest.fixture(scope="module")
def alone(server) -> list[list[int]]:
    """Each ordinary request's tokens when it runs alone."""
    with server.client() as c:
        return [_ordinary(c, p) for p in ORDINARY]


def _send(c: httpx.Client, path: str, body) -> httpx.Response:
    if isinstance(body, str):
        return c.post(path, content=body, headers={"content-type": "application/json"})
    return c.post(path, json=body)


def _served(r: httpx.Response) -> None:
    """A 400 naming the problem, or a 200 whose answer holds no error."""
    assert r.status_code in (200, 400), (r.status_code, r.text[:300])
    if r.status_code == 400:
        body = r.json()
        msg = body["error"]["message"] if "error" in body else body["message"]
        assert msg and "internal" not in msg, body
    elif r.headers["content-type"].startswith("text/event-stream"):
        events = [ln for ln in r.text.splitlines() if ln.startswith("data:")]
        assert events[-1] == "data: [DONE]"
        assert not any('"error"' in e for e in events), events[-2:]
    else:
        assert "error" not in r.json(), r.text[:300]


@pytest.mark.parametrize("name,path,body", POISONS, ids=[p[0] for p in POISONS])
def test_poison_beside_eight_ordinary_requests(server, alone, name, path, body):
    got: dict[int, list[int]] = {}
    health: list[int] = []
    running = threading.Event()
    stop = threading.Event()

    def ordinary(i: int) -> None:
        with server.client() as c:
            got[i] = _ordinary(c, ORDINARY[i])

    def watch_health() -> None:
        with server.client() as c:
            while not stop.is_set():
                health.append(c.get("/health").status_code)
                time.sleep(0.02)

    threads = [threading.Thread(target=ordinary, args=(i,)) for i in range(8)]
    watcher = threading.Thread(target=watch_health)
    watcher.start()
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while server.engine.stats.generated_tokens == 0 or not server.engine.requests:
        assert time.monotonic() < deadline, "the ordinary requests did not start"
        time.sleep(0.005)
    running.set()
    with server.client() as c:
        r = _send(c, path, body)
    for t in threads:
        t.join(120)
    stop.set()
    watcher.join(30)
    _served(r)
    assert [got.get(i) for i in range(8)] == alone, name
    assert health and set(health) == {200}, health
    assert server.state.aengine.alive and server.state.aengine.failed_steps == 0
    assert server.engine.stats.requests_failed == 0
    info = server.wait_idle()
    assert info["kv_pool"]["used_blocks"] == 0, info["kv_pool"]
