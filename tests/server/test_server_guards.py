"""Issue 22, acceptance 5: --api-key (Bearer; /health open), a JSON Content-Type on every
body and on the state-changing routes (a web page cannot POST text/plain to /abort_request
any more), the Host header checked against the bound address (DNS rebinding), CORS off
unless origins are allowed."""

from __future__ import annotations

import threading

import httpx
import pytest
from server_testing import start_server, tiny_config

from sloserve.runtime.engine import Engine
from sloserve.server.http_options import HTTPOptions

KEY = "s3cret-key"
GEN = {"input_ids": [11, 57, 300], "sampling_params": {"max_new_tokens": 2}}


@pytest.fixture(scope="module")
def keyed(tiny_pair):
    srv = start_server(Engine(tiny_config(tiny_pair)), api_key=KEY)
    yield srv
    info = srv.wait_idle(headers={"Authorization": f"Bearer {KEY}"})
    srv.stop()
    assert info["kv_pool"]["used_blocks"] == 0


@pytest.mark.parametrize("auth", [None, "Bearer wrong", f"Basic {KEY}", KEY, "Bearer",
                                  f"Bearer {KEY}x"])
@pytest.mark.parametrize("method,path", [("POST", "/generate"), ("GET", "/server_info"),
                                         ("GET", "/v1/models"), ("POST", "/v1/completions"),
                                         ("POST", "/abort_request"), ("GET", "/model_info")])
def test_api_key_required(keyed, auth, method, path):
    headers = {"Authorization": auth} if auth else {}
    r = httpx.request(method, keyed.url + path, json=GEN, headers=headers)
    assert r.status_code == 401, r.text
    assert r.headers["www-authenticate"] == "Bearer"
    body = r.json()
    err = body["error"] if path.startswith("/v1/") else body
    assert err["param"] == "Authorization" and "API key" in err["message"]


def test_api_key_accepted(keyed):
    h = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(keyed.url + "/generate", json=GEN, headers=h, timeout=60)
    assert r.status_code == 200 and len(r.json()["output_ids"]) == 2, r.text
    r = httpx.post(keyed.url + "/v1/completions", json={"model": "m", "prompt": "hi",
                                                        "max_tokens": 2}, headers=h, timeout=60)
    assert r.status_code == 200, r.text
    assert httpx.get(keyed.url + "/server_info", headers=h).status_code == 200


def test_health_and_metrics_open_without_key(keyed):
    """As SGLang: liveness probes and scrapers need no secret."""
    assert httpx.get(keyed.url + "/health").status_code == 200
    assert httpx.get(keyed.url + "/health_generate", timeout=60).status_code == 200
    assert httpx.get(keyed.url + "/metrics").status_code == 200


def test_official_openai_client_sends_the_key(keyed):
    import openai

    with openai.OpenAI(base_url=keyed.url + "/v1", api_key=KEY, max_retries=0) as c:
        assert c.models.list().data
    with openai.OpenAI(base_url=keyed.url + "/v1", api_key="nope", max_retries=0) as c:
        with pytest.raises(openai.AuthenticationError):
            c.models.list()


@pytest.mark.parametrize("ctype", [None, "text/plain", "application/x-www-form-urlencoded",
                                   "multipart/form-data; boundary=x"])
def test_cross_site_abort_is_refused(live, ctype):
    """What a web page can send without a preflight cannot abort anyone's requests."""
    gate = threading.Event()
    body: dict = {}

    def long_request():
        with live.client() as c:
            body["r"] = c.post("/generate", json={"input_ids": [5, 6, 7], "sampling_params": {
                "max_new_tokens": 300, "ignore_eos": True}})
            gate.set()

    t = threading.Thread(target=long_request)
    t.start()
    headers = {"Content-Type": ctype} if ctype else {}
    with live.client() as c:
        while not live.engine.requests and not gate.is_set():
            t.join(0.01)
        r = c.post("/abort_request", content=b'{"abort_all": true}', headers=headers)
        assert r.status_code == 415, r.text
        assert r.json()["param"] == "Content-Type"
        r = c.request("GET", "/flush_cache", headers=headers)
        assert r.status_code == 415, r.text
    t.join(60)
    meta = body["r"].json()["meta_info"]
    assert meta["finish_reason"]["type"] == "length" and meta["completion_tokens"] == 300


@pytest.mark.parametrize("path", ["/generate", "/v1/completions", "/v1/chat/completions"])
def test_bodies_must_be_json(client, path):
    r = client.post(path, content=b'{"text": "hi"}', headers={"Content-Type": "text/plain"})
    assert r.status_code == 415, r.text


def test_json_with_charset_and_state_changing_routes_with_json(client):
    r = client.post("/generate", content=b'{"input_ids": [1, 2], "sampling_params": '
                    b'{"max_new_tokens": 1}}',
                    headers={"Content-Type": "application/json; charset=utf-8"})
    assert r.status_code == 200, r.text
    r = client.post("/flush_cache", headers={"Content-Type": "application/json"})
    assert r.status_code == 200
    r = client.post("/abort_request", json={"rid": "nobody"})
    assert r.status_code == 200 and r.json()["aborted"] == 0


@pytest.mark.parametrize("host", ["evil.example", "evil.example:80", "127.0.0.2",
                                  "attacker.localhost.example"])
def test_foreign_host_header_is_refused(live, host):
    """DNS rebinding: a page on evil.example whose name now resolves to 127.0.0.1 sends
    Host: evil.example."""
    r = httpx.post(live.url + "/generate", json=GEN, headers={"Host": host})
    assert r.status_code == 400, r.text
    assert r.json()["param"] == "Host"
    assert httpx.get(live.url + "/health", headers={"Host": host}).status_code == 400


@pytest.mark.parametrize("host", ["localhost", "LOCALHOST:30000", "127.0.0.1", "[::1]:8080"])
def test_loopback_names_are_served(client, host):
    assert client.get("/health", headers={"Host": host}).status_code == 200


def test_host_names_from_options():
    assert HTTPOptions(host="0.0.0.0").host_names() is None
    assert HTTPOptions(host="10.1.2.3").host_names() == ("10.1.2.3",)
    assert HTTPOptions(host="0.0.0.0", allowed_hosts=("api.example",)).host_names() == (
        "api.example",)
    assert HTTPOptions(host="127.0.0.1", allowed_hosts=("*",)).host_names() is None


def test_cors_off_by_default(client):
    pre = client.options("/generate", headers={
        "Origin": "https://evil.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type"})
    assert "access-control-allow-origin" not in pre.headers
    assert pre.status_code >= 400
    r = client.get("/health", headers={"Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in r.headers


def test_cors_for_allowed_origins(tiny_pair):
    srv = start_server(Engine(tiny_config(tiny_pair)), allowed_origins=("https://app.example",))
    try:
        with srv.client() as c:
            ok = c.options("/generate", headers={
                "Origin": "https://app.example", "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "content-type"})
            assert ok.status_code == 200
            assert ok.headers["access-control-allow-origin"] == "https://app.example"
            bad = c.options("/generate", headers={
                "Origin": "https://evil.example", "Access-Control-Request-Method": "POST"})
            assert bad.headers.get("access-control-allow-origin") != "https://evil.example"
    finally:
        srv.stop()
