"""Acceptance 3: bad input of every kind gets a 4xx whose message names the problem, and the
server then serves a normal request correctly."""

from __future__ import annotations

import pytest

OK_SP = {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}
LONG = [7] * 1100  # the tiny pair's context window is 1024
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}

# (name, method/path, body (dict, or raw bytes), expected status, words the message must hold)
CASES = [
    ("malformed JSON", "/generate", b'{"text": "hi", ', 400, ["malformed JSON"]),
    ("empty body", "/generate", b"", 400, ["empty request body"]),
    ("not an object", "/generate", b'["hi"]', 400, ["JSON object"]),
    ("no prompt", "/generate", {"sampling_params": OK_SP}, 400, ["text", "input_ids"]),
    ("text and input_ids", "/generate", {"text": "a", "input_ids": [1]}, 400,
     ["exactly one of text or input_ids"]),
    ("text wrong type", "/generate", {"text": 5}, 400, ["text"]),
    ("empty text", "/generate", {"text": "", "sampling_params": OK_SP}, 400, ["text", "empty"]),
    ("empty input_ids", "/generate", {"input_ids": []}, 400, ["input_ids", "empty"]),
    ("token outside vocab", "/generate", {"input_ids": [1, 10**6]}, 400,
     ["input_ids", "vocabulary"]),
    ("prompt too long", "/generate", {"input_ids": LONG}, 400, ["1100 tokens", "context"]),
    ("unknown sampling key", "/generate", {"text": "a", "sampling_params": {"temprature": 1}},
     400, ["sampling_params.temprature", "unknown parameter"]),
    ("background true", "/generate", {"text": "a", "background": True}, 400,
     ["background", "not supported"]),
    ("return_bytes true", "/generate", {"text": "a", "return_bytes": True}, 400,
     ["return_bytes", "not supported"]),
    ("max_new_tokens negative", "/generate", {"text": "a", "sampling_params": {
        "max_new_tokens": -1}}, 400, ["max_new_tokens", ">= 0"]),
    ("max_new_tokens wrong type", "/generate", {"text": "a", "sampling_params": {
        "max_new_tokens": "ten"}}, 400, ["max_new_tokens", "integer"]),
    ("temperature negative", "/generate", {"text": "a", "sampling_params": {
        "temperature": -0.5}}, 400, ["temperature", ">= 0"]),
    ("top_p out of range", "/generate", {"text": "a", "sampling_params": {"top_p": 1.5}}, 400,
     ["top_p"]),
    ("top_k below -1", "/generate", {"text": "a", "sampling_params": {"top_k": -2}}, 400,
     ["top_k"]),
    ("stop wrong type", "/generate", {"text": "a", "sampling_params": {"stop": 3}}, 400,
     ["sampling_params.stop"]),
    ("n zero", "/generate", {"text": "a", "sampling_params": {"n": 0}}, 400,
     ["sampling_params.n", ">= 1"]),
    ("bad regex", "/generate", {"text": "a", "sampling_params": {"regex": "[ab"}}, 400,
     ["sampling_params.regex"]),
    ("json_schema not JSON", "/generate", {"text": "a", "sampling_params": {
        "json_schema": "{type: object"}}, 400, ["sampling_params.json_schema", "JSON"]),
    ("json_schema invalid", "/generate", {"text": "a", "sampling_params": {
        "json_schema": '{"type": "object", "properties": {"a": {"type": "integer", '
                       '"minimum": 5, "maximum": 1}}}'}}, 400,
     ["sampling_params.json_schema"]),
    ("bad ebnf", "/generate", {"text": "a", "sampling_params": {"ebnf": "root ::= (("}}, 400,
     ["sampling_params.ebnf"]),
    ("two grammars", "/generate", {"text": "a", "sampling_params": {
        "regex": "[ab]+", "ebnf": 'root ::= "a"'}}, 400, ["sampling_params.ebnf", "only one"]),
    ("min_new_tokens over max", "/generate", {"text": "a", "sampling_params": {
        "max_new_tokens": 4, "min_new_tokens": 9}}, 400, ["sampling_params.min_new_tokens"]),
    ("repetition_penalty 0", "/generate", {"text": "a", "sampling_params": {
        "repetition_penalty": 0.0}}, 400, ["sampling_params.repetition_penalty"]),
    ("frequency_penalty 3", "/generate", {"text": "a", "sampling_params": {
        "frequency_penalty": 3.0}}, 400, ["sampling_params.frequency_penalty", "[-2, 2]"]),
    ("structural_tag", "/generate", {"text": "a", "sampling_params": {
        "structural_tag": "{}"}}, 400, ["structural_tag", "not supported"]),
    ("min_p above 1", "/generate", {"text": "a", "sampling_params": {"min_p": 1.5}}, 400,
     ["sampling_params.min_p", "[0, 1]"]),
    ("logit_bias not a token", "/generate", {"text": "a", "sampling_params": {
        "logit_bias": {"x": 1.0}}}, 400, ["sampling_params.logit_bias"]),
    ("logit_bias beyond vocab", "/generate", {"text": "a", "sampling_params": {
        "logit_bias": {"999999": 1.0}}}, 400, ["logit_bias", "vocabulary"]),
    ("stream_interval 0", "/generate", {"text": "a", "sampling_params": {
        "stream_interval": 0}}, 400, ["sampling_params.stream_interval"]),
    ("token_ids_logprob without return_logprob", "/generate", {"text": "a",
     "token_ids_logprob": [1]}, 400, ["token_ids_logprob", "return_logprob"]),
    ("tpot_slo negative", "/generate", {"text": "a", "sampling_params": {"tpot_slo": -0.03}},
     400, ["tpot_slo", "positive"]),
    ("logprob_start_len beyond prompt", "/generate", {"input_ids": [1, 2, 3],
     "return_logprob": True, "logprob_start_len": 9}, 400, ["logprob_start_len"]),
    ("batch rid length", "/generate", {"text": ["a", "b"], "rid": ["x"]}, 400, ["rid"]),
    ("image input", "/generate", {"text": "a", "image_data": "x.png"}, 400, ["image_data"]),
    ("abort without rid", "/abort_request", {}, 400, ["rid"]),
    ("completions n 0", "/v1/completions", {"model": "m", "prompt": "a", "n": 0}, 400,
     ["n", ">= 1"]),
    ("completions bad regex", "/v1/completions", {"model": "m", "prompt": "a",
     "regex": "(a"}, 400, ["regex"]),
    ("completions logprobs 30", "/v1/completions", {"model": "m", "prompt": "a",
     "logprobs": 30}, 400, ["logprobs"]),
    ("completions presence_penalty", "/v1/completions", {"model": "m", "prompt": "a",
     "presence_penalty": -2.5}, 400, ["presence_penalty"]),
    ("chat response_format type", "/v1/chat/completions", {**CHAT, "response_format": {
        "type": "yaml"}}, 400, ["response_format", "yaml"]),
    ("chat response_format no schema", "/v1/chat/completions", {**CHAT, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x"}}}, 400, ["response_format",
                                                                     "schema"]),
    ("chat response_format bad schema", "/v1/chat/completions", {**CHAT, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "string", "minLength": 9, "maxLength": 2}}}}, 400, ["response_format"]),
    ("chat top_logprobs without logprobs", "/v1/chat/completions", {**CHAT,
     "top_logprobs": 2}, 400, ["top_logprobs", "logprobs"]),
    ("chat top_logprobs 21", "/v1/chat/completions", {**CHAT, "logprobs": True,
     "top_logprobs": 21}, 400, ["top_logprobs"]),
    ("completions max_tokens 0", "/v1/completions", {"model": "m", "prompt": "a",
     "max_tokens": 0}, 400, ["max_tokens"]),
    ("completions no prompt", "/v1/completions", {"model": "m"}, 400, ["prompt"]),
    ("chat no messages", "/v1/chat/completions", {"model": "m", "messages": []}, 400,
     ["messages"]),
    ("chat bad role", "/v1/chat/completions", {**CHAT, "messages": [{"role": "robot",
     "content": "x"}]}, 400, ["role"]),
    ("chat continue_final_message", "/v1/chat/completions", {**CHAT,
     "continue_final_message": True}, 400, ["continue_final_message", "not supported"]),
    ("chat min_p above 1", "/v1/chat/completions", {**CHAT, "min_p": 2.0}, 400, ["min_p"]),
    ("chat stop_regex", "/v1/chat/completions", {**CHAT, "stop_regex": "a+"}, 400,
     ["stop_regex", "not supported"]),
    ("chat lora_path", "/v1/chat/completions", {**CHAT, "lora_path": "x"}, 400,
     ["lora_path", "not supported"]),
    ("chat custom_logit_processor", "/v1/chat/completions", {**CHAT,
     "custom_logit_processor": "x"}, 400, ["custom_logit_processor", "not supported"]),
    ("chat logit_bias beyond vocab", "/v1/chat/completions", {**CHAT,
     "logit_bias": {"999999": 1.0}}, 400, ["logit_bias", "vocabulary"]),
    ("chat tools", "/v1/chat/completions", {**CHAT, "tools": [{"type": "function"}]}, 400,
     ["tools[0].function", "is required"]),
    ("chat malformed JSON", "/v1/chat/completions", b"{oops", 400, ["malformed JSON"]),
    ("unknown route", "/no/such/route", {}, 404, ["Not Found", "/no/such/route"]),
]


def _message(resp) -> str:
    body = resp.json()
    return body["error"]["message"] if "error" in body else body["message"]


@pytest.mark.parametrize("name,path,body,status,words", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_a_clear_4xx(client, name, path, body, status, words):
    if isinstance(body, bytes):
        r = client.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = client.post(path, json=body)
    assert r.status_code == status, r.text
    msg = _message(r)
    for w in words:
        assert w in msg, f"{name}: {w!r} not in {msg!r}"


def test_server_still_serves_after_bad_input(client):
    assert len(CASES) >= 15
    for _, path, body, _, _ in CASES:  # all of them again, back to back
        if isinstance(body, bytes):
            client.post(path, content=body)
        else:
            client.post(path, json=body)
    r = client.post("/generate", json={"input_ids": [11, 57, 300, 42], "sampling_params": OK_SP})
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["completion_tokens"] == 4
    r = client.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1
    assert client.get("/server_info").json()["kv_pool"]["used_blocks"] == 0
