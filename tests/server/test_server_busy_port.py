"""A busy port is a one-line error with exit status 2 before any model loads (the built-in
pair is not even built: its cache stays empty), for the built-in engine and for SGLang's."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def busy_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.mark.parametrize("engine", ["builtin", "sglang"])
def test_busy_port_is_one_line_before_loading(busy_port, engine, tmp_path):
    env = {**os.environ, "SLOSERVE_CACHE": str(tmp_path / "cache")}
    out = subprocess.run(
        [sys.executable, "-m", "sloserve.launch", "--engine", engine, "--host", "127.0.0.1",
         "--port", str(busy_port), "--tpot-slo", "30ms"],
        capture_output=True, text=True, timeout=120, cwd=REPO, env=env)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip() == f"error: port {busy_port} is in use on 127.0.0.1"
    assert "ready" not in out.stdout
    assert not (tmp_path / "cache").exists()  # nothing was built or loaded


def test_bind_names_other_failures():
    from sloserve.listen import ListenError, bind

    with pytest.raises(ListenError, match="cannot listen on no-such-host.invalid"):
        bind("no-such-host.invalid", 0)
    sock = bind("127.0.0.1", 0)
    try:
        port = sock.getsockname()[1]
        sock.listen()
        with pytest.raises(ListenError, match=f"port {port} is in use on 127.0.0.1"):
            bind("127.0.0.1", port)
    finally:
        sock.close()
