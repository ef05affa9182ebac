"""SGLang servers started as a user starts them (`python -m sloserve.launch --engine sglang
...` in the SGLang environment), for the live test modules: `LaunchedServer` one server,
`ServerQueue` a module's servers in the order its tests use them, each started when the one
before it is done or, where the tests allow, while it is tested (a start costs 40-130 s on
2 cores)."""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

# held, not only drawn: servers started together draw ports at once (listen.py)
from sloserve.listen import reserve_loopback_port

REPO = Path(__file__).resolve().parents[2]
# the controller's cost profile of SGLang's forwards of the tiny pair on this CPU type
TINY_PROFILE = REPO / "tests" / "sglang_runtime" / "tiny_pair_sglang_profile.json"


# the session's port reservations, held to its end (a few dozen sockets)
_HELD: list[socket.socket] = []


def free_port() -> int:
    """A loopback port for a test server, held for the session: the server binds it beside the
    reservation, and no other draw (another server's, SGLang's own) can take it meanwhile."""
    sock = reserve_loopback_port()
    _HELD.append(sock)
    return sock.getsockname()[1]


def post(url: str, path: str, body: dict) -> dict:
    req = urllib.request.Request(url + path, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=1200) as r:
        return json.loads(r.read())


class LaunchedServer:
    def __init__(self, python: str, args: list[str], log: Path, env: dict[str, str]):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        cmd = [python, "-m", "sloserve.launch", "--engine", "sglang", "--port", str(self.port),
               "--dtype", "float32", "--log-level", "warning", *args]
        self.proc = subprocess.Popen(cmd, env={**os.environ, **env}, cwd=REPO,
                                     stdout=open(log, "wb"), stderr=subprocess.STDOUT,  # noqa: SIM115
                                     start_new_session=True)

    def wait(self, timeout: float = 900) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode}:\n"
                                   f"{self.log.read_text(errors='replace')[-8000:]}")
            try:
                with urllib.request.urlopen(self.url + "/health_generate", timeout=30):
                    return
            except (OSError, http.client.HTTPException):
                time.sleep(1.0)
        raise TimeoutError(self.log.read_text(errors="replace")[-8000:])

    def stop(self, wait: bool = True) -> None:
        """SIGTERM to the server's process group; wait: until it exited (SGLang's shutdown
        takes ~6 s on 2 cores), else a thread reaps it (`reap_stopped` joins them)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)
            if wait:
                self._reap()
            else:
                t = threading.Thread(target=self._reap, daemon=True)
                t.start()
                _REAPERS.append(t)

    def _reap(self) -> None:
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            pass
        # SGLang's scheduler and detokenizer can outlive the launcher they were started by
        # (seen 2026-12-01: both still running 20 minutes after their pytest run ended)
        try:
            os.killpg(self.proc.pid, 9)
        except ProcessLookupError:
            pass
        self.proc.wait()


_REAPERS: list[threading.Thread] = []


def reap_stopped() -> None:
    """Wait for every server stopped without waiting (conftest: at the session's end)."""
    while _REAPERS:
        _REAPERS.pop().join()


class ServerQueue:
    """A module's servers by name, `specs` in the order its tests ask for them: asking for
    one stops the ones before it and, `ahead`, starts the next, so that it starts while the
    one before it is tested (for tests that neither time nor race their requests: a start
    takes much of the 2 cores); `shared` servers (the session's) are only waited for. A
    name asked for again after a later one is started again (correct, only slower)."""

    def __init__(self, python: str, logs: Path, specs: dict[str, tuple[list[str], dict]],
                 shared: dict[str, LaunchedServer] | None = None, ahead: bool = True):
        self.python, self.logs, self.specs = python, logs, specs
        self.order = list(specs)
        self.shared = shared or {}
        self.ahead = ahead
        self.started: dict[str, LaunchedServer] = {}

    def start(self, name: str) -> None:
        if name not in self.started:
            args, env = self.specs[name]
            self.started[name] = LaunchedServer(self.python, args, self.logs / f"{name}.log",
                                                env)

    def __call__(self, name: str) -> LaunchedServer:
        if name in self.shared:
            self.shared[name].wait()
            return self.shared[name]
        i = self.order.index(name)
        for other in [n for n in self.started if self.order.index(n) < i]:
            self.started.pop(other).stop(wait=False)
        for n in self.order[i:i + 1 + self.ahead]:
            self.start(n)
        self.started[name].wait()
        return self.started[name]

    def log(self, name: str) -> Path:
        return self.logs / f"{name}.log"

    def close(self) -> None:
        for server in self.started.values():
            server.stop(wait=False)
        self.started.clear()


# the TEST-ONLY forced lengths: every request drafts k_max = 4 and batch row i verifies
# FORCED[(i + n) % 6] drafts in the n-th step (0 and 4 in one batch, mixed lengths in every
# batch), so that the verify and acceptance rules run on every step
FORCED = (0, 4, 1, 3, 2, 4)


def specserve_args(target: str, draft: str) -> list[str]:
    """SPECSERVE (`specserve`, k_max 4) on the tiny pair with its SGLang profile."""
    return ["--model-path", target, "--draft-model-path", draft, "--k-max", "4",
            "--spec-policy", "specserve", "--spec-profile", str(TINY_PROFILE)]


def forced_args(target: str, draft: str) -> list[str]:
    """SPECSERVE with per-request verify lengths forced to FORCED."""
    return specserve_args(target, draft) + [
        "--spec-lengths", "per-request", "--spec-test-verify-lens", ",".join(map(str, FORCED))]
