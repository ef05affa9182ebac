"""Acceptance 1 and 6: `python -m sloserve.launch` on the built-in pair, as a subprocess, driven
by a real SGLang frontend program (sgl.function with sgl.gen and sgl.select through
sgl.RuntimeEndpoint) and by the official openai client; SIGTERM stops the server with exit
status 0. README's examples are run by test_readme_examples.py."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

REPO = Path(__file__).resolve().parents[2]


def _sglang():
    try:
        import sglang
    except ImportError:
        pytest.fail("the SGLang frontend is not installed: bash scripts/install_sglang_frontend.sh")
    return sglang


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """(url, process) of `python -m sloserve.launch --port 0` on the built-in pair."""
    log = tmp_path_factory.mktemp("launch") / "server.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log, "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "sloserve.launch", "--port", "0", "--host", "127.0.0.1",
             "--log-level", "warning", "--tpot-slo", "50ms"],
            cwd=REPO, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()
    url, deadline = None, time.monotonic() + 180  # the first run builds the pair (~10 s)
    while url is None and time.monotonic() < deadline and proc.poll() is None:
        try:
            m = re.match(r"sloserve ready: (http://\S+)", lines.get(timeout=1))
            url = m.group(1) if m else None
        except queue.Empty:
            pass
    if url is None:
        proc.kill()
        pytest.fail(f"server did not start:\n{log.read_text()[-3000:]}")
    yield url, proc, lines
    if proc.poll() is None:
        proc.kill()
        proc.wait(10)


def test_sglang_frontend_program(launched):
    sgl = _sglang()
    url, _, _ = launched

    @sgl.function
    def qa(s, question):
        s += "Q: " + question + "\nA:" + sgl.gen("answer", max_tokens=12, temperature=0)
        s += "\nVerdict: " + sgl.select("verdict", choices=["yes", "no", "unsure"])

    backend = sgl.RuntimeEndpoint(url)
    state = qa.run(question="Is the sky blue?", backend=backend)
    assert isinstance(state["answer"], str) and state["answer"]
    assert state["verdict"] in ("yes", "no", "unsure")
    meta = state.get_meta_info("answer")
    assert meta["completion_tokens"] <= 12 and meta["spec_verify_ct"] >= 0
    scores = state.get_meta_info("verdict")["normalized_prompt_logprobs"]
    assert len(scores) == 3 and all(s < 0 for s in scores)
    assert state["verdict"] == ("yes", "no", "unsure")[max(range(3), key=scores.__getitem__)]
    again = qa.run(question="Is the sky blue?", backend=backend)
    assert again["answer"] == state["answer"] and again["verdict"] == state["verdict"]
    streamed = qa.run(question="Is the sky blue?", backend=backend, stream=True)
    assert "".join(streamed.text_iter("answer")) == state["answer"]


def test_openai_client(launched):
    url, _, _ = launched
    with openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60) as c:
        model = c.models.list().data[0].id
        r = c.completions.create(model=model, prompt="Once upon a time", max_tokens=8,
                                 temperature=0, extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 8
        s = c.completions.create(model=model, prompt="Once upon a time", max_tokens=8,
                                 temperature=0, stream=True, extra_body={"ignore_eos": True})
        assert "".join(x.choices[0].text for x in s) == r.choices[0].text
        msgs = [{"role": "user", "content": "Hello"}]
        ch = c.chat.completions.create(model=model, messages=msgs, max_tokens=8, temperature=0,
                                       extra_body={"ignore_eos": True})
        assert ch.choices[0].message.role == "assistant" and ch.usage.completion_tokens == 8
        cs = c.chat.completions.create(model=model, messages=msgs, max_tokens=8, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
        assert "".join(x.choices[0].delta.content or "" for x in cs) == ch.choices[0].message.content


def test_sigterm_stops_cleanly(launched):
    """SIGTERM during a stream: the stream ends (finish_reason abort, then [DONE]), the
    process exits 0."""
    url, proc, lines = launched
    body = {"text": "x", "stream": True, "sampling_params": {"max_new_tokens": 3000,
                                                             "ignore_eos": True}}
    events: list[str] = []
    started = threading.Event()

    def stream():
        with httpx.stream("POST", url + "/generate", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    events.append(line)
                    started.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert started.wait(60)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0
    reader.join(30)
    assert events[-1] == "data: [DONE]" and '"type": "abort"' in events[-2]
    rest: list[str] = []
    deadline = time.monotonic() + 10
    while not any("sloserve stopped" in x for x in rest) and time.monotonic() < deadline:
        try:
            rest.append(lines.get(timeout=0.5))
        except queue.Empty:
            pass
    assert any("sloserve stopped" in x for x in rest), rest
