"""`python -m sloserve.launch` as a subprocess with --tokenizer-path, --chat-template (a file),
--served-model-name and --api-key, checked end to end: the prompt a chat request renders (its
token count in usage) follows the template file, prompts are tokenized by the given tokenizer,
the model id is the served name, and every route but /health needs the Bearer key."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

REPO = Path(__file__).resolve().parents[2]
KEY = "test-key-1"
TEMPLATE = ("{% for m in messages %}[{{ m['role'] | upper }}] {{ m['content'] }} "
            "{{ m['content'] }} {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}[ASSISTANT]{% endif %}")
MESSAGES = [{"role": "user", "content": "Hello there, how are you today?"}]


def coarse_tokenizer(src: str, dst: Path) -> Path:
    """A copy of src's tokenizer with most BPE merges dropped: same vocabulary, other (longer)
    tokenizations."""
    dst.mkdir()
    for f in Path(src).iterdir():
        if f.name.startswith("tokenizer") or f.name.endswith(".jinja"):
            shutil.copy(f, dst / f.name)
    tok = json.loads((dst / "tokenizer.json").read_text())
    tok["model"]["merges"] = tok["model"]["merges"][:40]
    (dst / "tokenizer.json").write_text(json.dumps(tok))
    return dst


@pytest.fixture(scope="module")
def server(tiny_pair, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("model_options")
    tok_dir = coarse_tokenizer(tiny_pair[0], tmp / "tokenizer")
    template = tmp / "chat.jinja"
    template.write_text(TEMPLATE)
    log = tmp / "server.log"
    with open(log, "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "sloserve.launch", "--engine", "builtin",
             "--model-path", tiny_pair[0], "--draft-model-path", tiny_pair[1],
             "--tokenizer-path", str(tok_dir), "--chat-template", str(template),
             "--served-model-name", "tiny-served", "--api-key", KEY, "--port", "0",
             "--kv-cache-tokens", "4096", "--log-level", "warning"],
            cwd=REPO, stdout=subprocess.PIPE, stderr=err, text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = None
    deadline = time.monotonic() + 120
    while url is None and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        m = re.match(r"sloserve ready: (http://\S+)", line)
        url = m.group(1) if m else None
    if url is None:
        proc.kill()
        pytest.fail(f"server did not start:\n{log.read_text()[-3000:]}")
    yield url, tok_dir
    proc.terminate()
    assert proc.wait(30) == 0


@pytest.fixture
def tokenizers(tiny_pair, server):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_pair[0]), AutoTokenizer.from_pretrained(server[1])


def test_chat_prompt_is_rendered_with_the_template_file(server, tokenizers):
    url, _ = server
    own, given = tokenizers
    with openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60) as c:
        r = c.chat.completions.create(model="tiny-served", messages=MESSAGES, max_tokens=2,
                                      temperature=0)
    assert r.model == "tiny-served"
    text = given.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True,
                                     chat_template=TEMPLATE)
    assert text.startswith("[USER] Hello there") and text.endswith("[ASSISTANT]")
    assert r.usage.prompt_tokens == len(given.encode(text, add_special_tokens=False))
    default = given.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert r.usage.prompt_tokens != len(given.encode(default, add_special_tokens=False))


def test_prompts_use_the_given_tokenizer(server, tokenizers):
    url, tok_dir = server
    own, given = tokenizers
    prompt = "Once upon a time there was a tokenizer"
    assert len(given.encode(prompt)) != len(own.encode(prompt))  # the test means something
    h = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(url + "/generate", headers=h, timeout=60, json={
        "text": prompt, "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["prompt_tokens"] == len(given.encode(prompt,
                                                                      add_special_tokens=False))
    info = httpx.get(url + "/model_info", headers=h, timeout=60).json()
    assert info["tokenizer_path"] == str(tok_dir)


def test_served_model_name_and_api_key(server):
    url, _ = server
    assert httpx.get(url + "/health", timeout=60).status_code == 200  # open, as in SGLang
    for auth in (None, "Bearer wrong", KEY):
        h = {"Authorization": auth} if auth else {}
        r = httpx.get(url + "/v1/models", headers=h, timeout=60)
        assert r.status_code == 401, (auth, r.text)
    r = httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert r.status_code == 200 and [m["id"] for m in r.json()["data"]] == ["tiny-served"]
    with openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0, timeout=60) as c:
        with pytest.raises(openai.AuthenticationError):
            c.models.list()


def test_bad_template_and_tokenizer_are_errors_naming_the_option(tmp_path):
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}{{ m['content'] }}")
    for argv, option in ((["--chat-template", str(bad)], "--chat-template"),
                         (["--chat-template", "chatml"], "--chat-template"),
                         (["--tokenizer-path", str(tmp_path / "none")], "--tokenizer-path")):
        out = subprocess.run([sys.executable, "-m", "sloserve.launch", "--engine", "builtin",
                              *argv], capture_output=True, text=True, timeout=120, cwd=REPO)
        assert out.returncode == 2 and f"argument {option}" in out.stderr, out.stderr


def test_chat_template_string_or_file(tmp_path):
    from sloserve.runtime.chat_template import load_chat_template

    assert load_chat_template(TEMPLATE) == TEMPLATE
    f = tmp_path / "t.jinja"
    f.write_text(TEMPLATE)
    assert load_chat_template(str(f)) == TEMPLATE
    with pytest.raises(ValueError, match="line 1"):
        load_chat_template("{{ unclosed ")
