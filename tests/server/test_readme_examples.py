"""README's examples work as written. Every fenced code block in README.md carries a marker
comment just above it, which this module reads:

    <!-- readme-test: server -->       the launch command: started here (port 0) for the rest
    <!-- readme-test: run -->          run against that server (its URL put in for :30000)
    <!-- readme-test: ci -->           the test command: .ci/run must run it as written
    <!-- readme-test: skip: REASON --> not run here, for the stated reason

A block without a marker fails the test, so a new example is either run or says why not."""

from __future__ import annotations

import os
import queue
import re
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README_URL = "http://127.0.0.1:30000"
MARKED = re.compile(r"<!-- readme-test: (\w+)(?::\s*(.*?))? -->\n```(\w+)\n(.*?)```", re.S)


def blocks(kind: str | None = None) -> list[tuple[str, str, str, str]]:
    """(kind, reason, language, code) of README's marked blocks, in order."""
    found = MARKED.findall((REPO / "README.md").read_text())
    return [b for b in found if kind is None or b[0] == kind]


def test_every_block_is_marked_and_every_skip_says_why():
    text = (REPO / "README.md").read_text()
    assert len(re.findall(r"^```\w+\n", text, re.M)) == len(blocks()) > 0
    for kind, reason, _, code in blocks():
        assert kind in ("server", "run", "ci", "skip"), kind
        assert kind != "skip" or reason.strip(), code
    assert len(blocks("server")) == 1 and len(blocks("ci")) == 1 and len(blocks("run")) >= 4


def test_ci_runs_the_readme_test_command():
    (_, _, _, command), = blocks("ci")
    assert command.strip() in (REPO / ".ci" / "run").read_text()


def test_quick_start_launch_options_parse():
    """The quick start's own launch (after its pip installs) takes options this launcher
    accepts (starting it would bind port 30000)."""
    from sloserve.launch import build_parser

    launch = blocks()[0][3].strip().split("&&")[-1]
    argv = shlex.split(launch)
    assert argv[:3] == ["python", "-m", "sloserve.launch"]
    build_parser().parse_args(argv[3:])


@pytest.fixture(scope="module")
def readme_server(tmp_path_factory):
    """The URL of README's launch command, run with --port 0."""
    (_, _, _, command), = blocks("server")
    argv = shlex.split(command.strip())
    assert argv[:3] == ["python", "-m", "sloserve.launch"] and "--port" in argv
    argv[argv.index("--port") + 1] = "0"
    log = tmp_path_factory.mktemp("readme") / "server.log"
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, *argv[1:]], cwd=REPO, stdout=subprocess.PIPE,
                                stderr=err, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()
    url, deadline = None, time.monotonic() + 180  # a first start builds the pair
    while url is None and time.monotonic() < deadline and proc.poll() is None:
        try:
            m = re.match(r"sloserve ready: (http://\S+)", lines.get(timeout=1))
            url = m.group(1) if m else None
        except queue.Empty:
            pass
    if url is None:
        proc.kill()
        pytest.fail(f"README's server did not start:\n{log.read_text()[-3000:]}")
    yield url
    proc.terminate()
    assert proc.wait(30) == 0


RUN = blocks("run")


@pytest.mark.parametrize("lang,code", [(b[2], b[3]) for b in RUN],
                         ids=[f"{b[2]}-{i}" for i, b in enumerate(RUN)])
def test_example_runs_as_written(readme_server, lang, code):
    code = code.replace(README_URL, readme_server)
    cmd = ["bash", "-c", code] if lang == "bash" else [sys.executable, "-c", code]
    assert lang in ("bash", "python")
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=REPO)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert out.stdout.strip()
    if lang == "bash":
        assert '"meta_info"' in out.stdout
