"""Issue 22, acceptance 1: no request can leave the engine dead. Each input that once killed
the engine (it passed validation and failed inside the sampler or the seeded generator) or
answered a plain-text 500 is now served correctly or answered with a 4xx JSON error naming
the field; after each, /health is 200 and a normal request gets its exact greedy tokens. A
request whose step work fails (parameters corrupted after validation, sent in-process)
fails alone and its neighbours get their own output (issue 34); a step that fails as a whole
(the forward pass) fails only its batch, and the engine goes on."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time

import httpx
import pytest
import uvicorn
from server_testing import start_server, tiny_config

from sloserve import launch
from sloserve.listen import bind
from sloserve.runtime.async_engine import (
    MAX_CONSECUTIVE_STEP_FAILURES,
    RequestFailed,
    StepFailed,
)
from sloserve.runtime.engine import Engine
from sloserve.runtime.request import SamplingParams
from sloserve.server.app import create_app

PROMPT = [11, 57, 300, 42, 9]
GREEDY = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}


def _gen(client, **sp) -> httpx.Response:
    return client.post("/generate", json={"input_ids": PROMPT, "sampling_params": {
        "max_new_tokens": 6, "ignore_eos": True, **sp}})


def _message(r: httpx.Response) -> str:
    body = r.json()
    return body["error"]["message"] if "error" in body else body["message"]


def _normal_request_succeeds(client, reference: list[int]) -> None:
    assert client.get("/health").status_code == 200
    r = client.post("/generate", json={"input_ids": PROMPT, "sampling_params": GREEDY})
    assert r.status_code == 200, r.text
    assert r.json()["output_ids"] == reference


@pytest.fixture(scope="module")
def reference(live) -> list[int]:
    with live.client() as c:
        r = c.post("/generate", json={"input_ids": PROMPT, "sampling_params": GREEDY})
        assert r.status_code == 200, r.text
        return r.json()["output_ids"]


# inputs that used to pass validation and kill the engine in the sampler: now served, with the
# tokens they mean (a temperature below SGLang's epsilon or a top_p below float32's smallest
# value is greedy decoding; a top_k beyond the vocabulary is no top-k)
@pytest.mark.parametrize("sp", [
    {"temperature": 1e-300}, {"temperature": 1e-40}, {"temperature": 1e-7},
    {"temperature": 1.0, "top_p": 1e-300}, {"temperature": 1.0, "top_p": 1e-46},
], ids=["temperature 1e-300", "temperature 1e-40", "temperature 1e-7", "top_p 1e-300",
        "top_p 1e-46"])
def test_extreme_values_decode_greedily(client, reference, sp):
    r = _gen(client, **sp)
    assert r.status_code == 200, r.text
    assert r.json()["output_ids"] == reference
    _normal_request_succeeds(client, reference)


def test_huge_top_k_is_no_top_k(client, reference):
    sampled = _gen(client, temperature=1.0, sampling_seed=5)
    assert sampled.status_code == 200, sampled.text
    for top_k in (10**30, 2**63, 2048, 10**6):
        r = _gen(client, temperature=1.0, sampling_seed=5, top_k=top_k)
        assert r.status_code == 200, r.text
        assert r.json()["output_ids"] == sampled.json()["output_ids"], top_k
    r = client.post("/v1/completions", json={"model": "m", "prompt": PROMPT, "max_tokens": 6,
                                             "top_k": 10**30, "seed": 5, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 6
    _normal_request_succeeds(client, reference)


BAD = [
    ("seed 10**30", "/generate", {"text": "hi", "sampling_params": {"seed": 10**30}},
     "sampling_params.seed"),
    ("sampling_seed -2**64", "/generate", {"text": "hi", "sampling_params": {
        "sampling_seed": -2**64}}, "sampling_params.sampling_seed"),
    ("openai seed 10**30", "/v1/completions", {"model": "m", "prompt": "hi", "seed": 10**30},
     "seed"),
    ("chat seed 2**64", "/v1/chat/completions", {"model": "m", "seed": 2**64, "messages": [
        {"role": "user", "content": "hi"}]}, "seed"),
    ("lone surrogate in text", "/generate", '{"text": "\\ud800x"}', "text"),
    ("lone surrogate in stop", "/generate", '{"text": "hi", "sampling_params": {"stop": '
     '["a", "\\udfff"]}}', "sampling_params.stop[1]"),
    ("lone surrogate in a chat message", "/v1/chat/completions", '{"model": "m", "messages": '
     '[{"role": "user", "content": "\\ud83d"}]}', "messages[0].content"),
    ("lone surrogate in a key", "/generate", '{"text": "hi", "\\ud800": 1}', "\\ud800"),
    ("JSON nested 10k deep", "/generate", '{"text": "hi", "custom_params": ' + "[" * 10000
     + "]" * 10000 + "}", "body"),
    # inside sampling_params (strict): a top-level unknown key is ignored, as SGLang does
    ("JSON nested 500 deep", "/generate", '{"text": "hi", "sampling_params": {"custom_params": '
     '{"a": ' + "[" * 500 + "]" * 500 + "}}}", "sampling_params.custom_params"),
]


@pytest.mark.parametrize("name,path,body,param", BAD, ids=[b[0] for b in BAD])
def test_bad_values_are_a_4xx_naming_the_field(client, reference, name, path, body, param):
    if isinstance(body, str):
        r = client.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    assert r.headers["content-type"] == "application/json"
    got = r.json()["error"]["param"] if path.startswith("/v1/") else r.json()["param"]
    assert got == param, _message(r)
    _normal_request_succeeds(client, reference)


def test_surrogate_pairs_are_fine(client):
    """A correctly paired escape (an emoji) is ordinary text."""
    r = client.post("/generate", content='{"text": "hi \\ud83d\\ude00", "sampling_params": '
                    '{"max_new_tokens": 2}}', headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text


def _corrupted() -> SamplingParams:
    """Parameters that passed validation and were corrupted afterwards (as a future bug
    might): a NaN temperature makes the sampler raise inside the step."""
    sp = SamplingParams(max_new_tokens=50, ignore_eos=True, seed=1)
    object.__setattr__(sp, "temperature", float("nan"))
    return sp


def _submit(state, params: SamplingParams) -> BaseException | None:
    """Run one request in-process on the server's engine; the exception it ended with."""
    async def run():
        try:
            async for _ in state.aengine.generate(PROMPT, params):
                pass
        except BaseException as e:  # noqa: B036 - the test inspects it
            return e
        return None

    return asyncio.run(run())


LONG = {"max_new_tokens": 120, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def long_reference(live) -> list[int]:
    with live.client() as c:
        r = c.post("/generate", json={"input_ids": PROMPT, "sampling_params": LONG})
        assert r.status_code == 200, r.text
        return r.json()["output_ids"]


def test_a_request_whose_rows_fail_fails_alone(live, client, reference, long_reference):
    """Issue 34: the corrupted request's sampling raises inside the step; it alone fails
    (RequestFailed), the stream it shared its steps with ends with the tokens it gets alone."""
    failed_steps, failed = live.state.aengine.failed_steps, live.engine.stats.requests_failed
    events: list[str] = []
    started = threading.Event()

    def stream():
        body = {"input_ids": PROMPT, "stream": True, "sampling_params": LONG}
        with live.client() as c, c.stream("POST", "/generate", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    events.append(line)
                    started.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert started.wait(30)
    err = _submit(live.state, _corrupted())  # joins the running stream's batch
    reader.join(60)
    assert isinstance(err, RequestFailed), err
    assert live.state.aengine.failed_steps == failed_steps  # no step failed as a whole
    assert live.engine.stats.requests_failed == failed + 1
    assert events[-1] == "data: [DONE]"
    last = json.loads(events[-2][5:])
    assert "error" not in last, last
    assert last["output_ids"] == long_reference
    assert live.state.aengine.alive
    _normal_request_succeeds(client, reference)
    assert live.wait_idle()["kv_pool"]["used_blocks"] == 0


def test_a_failing_request_leaves_a_non_streamed_neighbour_its_output(live, client, reference,
                                                                       long_reference):
    # a normal HTTP request shares its steps with a corrupted one: it gets its own output
    results: dict = {}

    def post():
        with live.client() as c:
            results["r"] = c.post("/generate", json={"input_ids": PROMPT,
                                                     "sampling_params": LONG})

    t = threading.Thread(target=post)
    t.start()
    while live.engine.stats.generated_tokens == 0 or not live.engine.requests:
        t.join(0.01)
    err = _submit(live.state, _corrupted())
    assert isinstance(err, RequestFailed) and "alone" in str(err), err
    t.join(60)
    r = results["r"]
    assert r.status_code == 200, r.text
    assert r.json()["output_ids"] == long_reference
    _normal_request_succeeds(client, reference)


def test_a_failed_step_fails_its_batch_and_the_engine_goes_on(live, client, reference):
    """A step that raises as a whole (here the forward pass, once) fails its batch with
    StepFailed; the engine goes on."""
    before = live.state.aengine.failed_steps
    with _forward_raises(live.state, times=1):
        err = _submit(live.state, SamplingParams(max_new_tokens=4, ignore_eos=True))
    assert isinstance(err, StepFailed), err
    assert live.state.aengine.failed_steps == before + 1
    assert live.state.aengine.alive
    _normal_request_succeeds(client, reference)


@contextlib.contextmanager
def _forward_raises(state, times: int):
    """The target model's forward raises `times` times (a broken device, say), then works."""
    target = state.engine.parts.target
    real, left = target.forward, [times]

    def forward(*a, **kw):
        if left[0] > 0:
            left[0] -= 1
            raise RuntimeError("forward failed (test)")
        return real(*a, **kw)

    target.forward = forward
    try:
        yield
    finally:
        del target.forward  # the class's method again


def _break_for_good(state) -> BaseException | None:
    """MAX_CONSECUTIVE_STEP_FAILURES failed steps in a row; the last request's error."""
    with _forward_raises(state, times=10**9):
        for i in range(MAX_CONSECUTIVE_STEP_FAILURES):
            assert state.aengine.alive, i
            err = _submit(state, SamplingParams(max_new_tokens=4, ignore_eos=True))
    return err


def test_engine_broken_for_good_stops_and_health_says_so(tiny_pair):
    """Step after step failing is a broken engine, not a bad batch: it stops, and /health
    and every request answer 503."""
    srv = start_server(Engine(tiny_config(tiny_pair)))
    try:
        with srv.client() as c:
            assert c.get("/health").status_code == 200
            err = _break_for_good(srv.state)
            assert not srv.state.aengine.alive and "in a row" in str(err), err
            r = c.get("/health")
            assert r.status_code == 503 and "not running" in r.json()["message"]
            r = c.post("/generate", json={"input_ids": PROMPT, "sampling_params": GREEDY})
            assert r.status_code == 503 and r.json()["object"] == "error"
    finally:
        srv.stop()


def test_launch_exits_1_when_the_engine_stops(tiny_pair):
    """launch's serve loop shuts the server down with exit status 1 once the engine has
    stopped, so that a supervisor restarts it."""
    app = create_app(Engine(tiny_config(tiny_pair)))
    state = app.state.serving
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                           lifespan="on"))
    sock = bind("127.0.0.1", 0)  # launch binds before loading, then serves on that socket
    status: list[int] = []
    thread = threading.Thread(target=lambda: status.append(
        asyncio.run(launch._serve(server, sock, "127.0.0.1", state))))
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started and thread.is_alive():
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert server.started, "the serve loop ended before the server started"
        _break_for_good(state)
        thread.join(30)
        assert status == [1]
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
