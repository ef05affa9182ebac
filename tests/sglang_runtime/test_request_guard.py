"""Issue 34: the front of SGLang's server (`--engine sglang`) refuses the request values that
stop SGLang's server process, and the limits, with a 400 naming the field, before SGLang sees
them; a top_k beyond any vocabulary becomes no top-k; everything else goes through unchanged,
streams included. Runs without SGLang: the upstream is a stand-in that records what reached
it."""

from __future__ import annotations

import dataclasses
import json
import threading
import time

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from sloserve.sglang_ext.front import create_front, upstream_keep_alive
from sloserve.sglang_ext.request_guard import GuardLimits, Refused, check_body

LIMITS = GuardLimits(max_n=4, max_batch_prompts=8, max_top_logprobs_num=5, vocab_size=100)
DEEP = "[" * 10000 + "]" * 10000

REFUSED = [
    ("/generate", {"input_ids": [1], "sampling_params": {"n": 10**6}}, "sampling_params.n"),
    ("/generate", {"input_ids": [1], "sampling_params": [{"n": 2**63}]}, "sampling_params[0].n"),
    ("/generate", {"text": ["a"] * 3, "sampling_params": {"n": 3}}, "sampling_params.n"),
    ("/generate", {"text": ["a"] * 9}, "text"),
    ("/generate", {"input_ids": [[1]] * 9}, "input_ids"),
    ("/generate", {"input_ids": [1, 100]}, "input_ids"),
    ("/generate", {"input_ids": [[1], [-1]]}, "input_ids[1]"),
    ("/generate", {"text": "a", "top_logprobs_num": 10**6}, "top_logprobs_num"),
    ("/generate", {"text": ["a", "b"], "top_logprobs_num": [1, 6]}, "top_logprobs_num"),
    ("/generate", {"text": "a", "logprob_start_len": -5}, "logprob_start_len"),
    ("/generate", {"text": "a", "top_logprobs_num": 4}, "top_logprobs_num", 3),
    ("/generate", {"text": "a", "sampling_params": {"top_k": -2}}, "sampling_params.top_k"),
    ("/generate", {"text": "a", "sampling_params": {"json_schema": DEEP}},
     "sampling_params.json_schema"),
    ("/v1/completions", {"model": "m", "prompt": [-1]}, "prompt"),
    ("/v1/completions", {"model": "m", "prompt": [[1], [100]]}, "prompt[1]"),
    ("/v1/completions", {"model": "m", "prompt": ["a"] * 9}, "prompt"),
    ("/v1/completions", {"model": "m", "prompt": "a", "n": 10**6}, "n"),
    ("/v1/completions", {"model": "m", "prompt": "a", "logprobs": 10**6}, "logprobs"),
    ("/v1/chat/completions", {"model": "m", "messages": [], "top_logprobs": 6}, "top_logprobs"),
    ("/v1/chat/completions", {"model": "m", "messages": [], "n": 0}, "n"),
    ("/v1/chat/completions", {"model": "m", "messages": [], "json_schema": "{"}, "json_schema"),
]


@pytest.mark.parametrize("case", REFUSED, ids=[f"{c[0]} {c[2]}" for c in REFUSED])
def test_refused_values_name_their_field(case):
    path, body, param, *vocab = case
    limits = dataclasses.replace(LIMITS, vocab_size=vocab[0]) if vocab else LIMITS
    with pytest.raises(Refused) as e:
        check_body(path, body, limits)
    assert e.value.param == param, str(e.value)


@pytest.mark.parametrize("path,body", [
    ("/generate", {"input_ids": [1, 99], "sampling_params": {"n": 4, "top_k": 5}}),
    ("/generate", {"text": ["a"] * 8, "top_logprobs_num": 5, "logprob_start_len": -1}),
    ("/generate", {"text": "a", "sampling_params": {"n": "x", "top_k": 1.5}}),  # SGLang's 400s
    ("/v1/completions", {"model": "m", "prompt": [[1, 2], [3]], "n": 4, "logprobs": 5}),
    ("/v1/chat/completions", {"model": "m", "messages": [], "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}}),
])
def test_ordinary_values_pass_unchanged(path, body):
    before = json.dumps(body)
    assert check_body(path, body, LIMITS) is False
    assert json.dumps(body) == before


def test_a_top_k_beyond_any_vocabulary_is_no_top_k():
    for path, body, sp in [("/generate", {"text": "a", "sampling_params": {"top_k": 2**63}},
                            lambda b: b["sampling_params"]),
                           ("/v1/completions", {"prompt": "a", "top_k": 10**30}, lambda b: b)]:
        assert check_body(path, body, LIMITS) is True
        assert sp(body)["top_k"] == -1


# ----- the front over a stand-in upstream
SEEN: list[tuple[str, bytes]] = []


async def _upstream(request: Request):
    body = await request.body()
    SEEN.append((request.url.path, body))
    if request.url.path == "/stream":
        async def chunks():
            for i in range(3):
                yield f"data: {i}\n\n".encode()
        return StreamingResponse(chunks(), media_type="text/event-stream")
    return JSONResponse({"path": request.url.path, "auth": request.headers.get("authorization"),
                         "query": str(request.query_params)}, status_code=201)


def _serve(app, **config) -> tuple[uvicorn.Server, str]:
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                           **config))
    threading.Thread(target=server.run, daemon=True).start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    return server, f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"


@pytest.fixture(scope="module")
def front():
    up, up_url = _serve(Starlette(routes=[Route("/{p:path}", _upstream,
                                                methods=["GET", "POST"])]))
    fr, fr_url = _serve(create_front(up_url, LIMITS))
    yield fr_url, up
    fr.should_exit = up.should_exit = True


def test_front_refuses_before_sglang_sees_it(front):
    url, _ = front
    SEEN.clear()
    r = httpx.post(url + "/generate", json={"input_ids": [1], "sampling_params": {"n": 10**6}})
    assert r.status_code == 400 and r.json()["param"] == "sampling_params.n", r.text
    r = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": [-1]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    r = httpx.post(url + "/generate", content=b'{"text": "a", "x": ' + b"1" * 5000 + b"}",
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["param"] == "body", r.text
    r = httpx.post(url + "/generate", content=b'{"text": ' + b"[" * 10000 + b"]" * 10000
                   + b"}", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["param"] == "body", r.text
    assert SEEN == []


def test_front_forwards_the_rest_unchanged(front):
    url, _ = front
    SEEN.clear()
    r = httpx.post(url + "/generate?x=1", json={"text": "a", "sampling_params": {"top_k": 3}},
                   headers={"Authorization": "Bearer k"})
    assert r.status_code == 201
    assert r.json() == {"path": "/generate", "auth": "Bearer k", "query": "x=1"}
    assert json.loads(SEEN[-1][1]) == {"text": "a", "sampling_params": {"top_k": 3}}
    httpx.post(url + "/generate", json={"text": "a", "sampling_params": {"top_k": 2**63}})
    assert json.loads(SEEN[-1][1])["sampling_params"]["top_k"] == -1
    r = httpx.post(url + "/stream", content=b"not json")
    assert r.text == "data: 0\n\ndata: 1\n\ndata: 2\n\n" and SEEN[-1] == ("/stream", b"not json")
    assert httpx.get(url + "/health").status_code == 201


async def _peer(request: Request):
    client = request.client
    return JSONResponse({"peer": client.port if client else None})


def test_front_drops_idle_connections_before_sglang_does():
    """SGLang's server closes a connection idle for its keep-alive (uvicorn's
    timeout_keep_alive); a request the front writes on it just then fails (a ReadError, a 503
    to the client). The front must open a new connection after half that idle time, and reuse
    one within it."""
    up, up_url = _serve(Starlette(routes=[Route("/peer", _peer)]), timeout_keep_alive=2)
    fr, url = _serve(create_front(up_url, LIMITS, upstream_keep_alive=2.0))
    try:
        with httpx.Client() as c:
            first = c.get(url + "/peer").json()["peer"]
            assert c.get(url + "/peer").json()["peer"] == first  # kept alive
            time.sleep(1.5)  # past half SGLang's keep-alive, before SGLang closes it
            assert c.get(url + "/peer").json()["peer"] != first
    finally:
        fr.should_exit = up.should_exit = True
    assert upstream_keep_alive({}) == 5.0
    assert upstream_keep_alive({"SGLANG_TIMEOUT_KEEP_ALIVE": "30"}) == 30.0
    assert upstream_keep_alive({"SGLANG_TIMEOUT_KEEP_ALIVE": "x"}) == 5.0


def test_front_answers_others_while_it_checks_a_body(front, monkeypatch):
    """The guard's check of one body (a 32 MB one, a deep schema: seconds) runs off the
    front's event loop: other requests are answered meanwhile. The check here waits until
    /health has been answered through the front, so on the loop it would wait in vain."""
    import sloserve.sglang_ext.front as front_module

    url, _ = front
    answered, checking = threading.Event(), threading.Event()

    def slow_check(path, body, limits):
        checking.set()
        answered.wait(10)
        return check_body(path, body, limits)

    monkeypatch.setattr(front_module, "check_body", slow_check)
    result: dict[str, httpx.Response] = {}
    t = threading.Thread(target=lambda: result.update(
        r=httpx.post(url + "/generate", json={"text": "a"}, timeout=30)))
    t.start()
    assert checking.wait(10)
    assert httpx.get(url + "/health", timeout=5).status_code == 201
    answered.set()
    t.join(30)
    assert result["r"].status_code == 201


def test_front_answers_503_while_sglang_is_not_up():
    fr, url = _serve(create_front("http://127.0.0.1:9", LIMITS))  # nothing listens there
    try:
        r = httpx.get(url + "/health")
        assert r.status_code == 503 and "not answering" in r.json()["message"]
    finally:
        fr.should_exit = True
