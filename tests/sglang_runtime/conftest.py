"""Fixtures for tests that run SGLang 0.5.23's own server on this CPU: the SGLang environment's
python, the tiny model pair, and a module-scoped pool of servers started at most once each
(a start costs 60-100 s on 2 cores), two at a time."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from sloserve.sglang_cpu.cpu_server import (
    CPUServerConfig,
    SpecConfig,
    generate,
    start_server,
    stop_server,
    wait_ready,
)
from sloserve.sglang_cpu.tiny_pair import ensure_tiny_pair
from tests.sglang_runtime.launched import LaunchedServer, forced_args, free_port, reap_stopped

REPO = Path(__file__).resolve().parents[2]
# float32: the backends and the transformers reference then differ only by summation order.
# (SGLang's default "auto" runs this float32 checkpoint in float16 on CPUs.)
SERVER_ARGS = ("--dtype", "float32", "--log-level", "warning")


def _sglang_python() -> str | None:
    explicit = os.environ.get("SLOSERVE_SGLANG_PYTHON")
    if explicit:
        return explicit
    proc = subprocess.run(
        ["bash", str(REPO / "scripts" / "sglang_runtime_env.sh"), "--no-create"],
        capture_output=True, text=True,
    )
    if proc.returncode == 3:
        return None
    if proc.returncode != 0:
        raise RuntimeError(f"scripts/sglang_runtime_env.sh failed:\n{proc.stderr}")
    return proc.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="session", autouse=True)
def _reap_stopped_servers():
    """Servers stopped without waiting for SGLang's shutdown (`LaunchedServer.stop(wait=
    False)`: the next one starts meanwhile) have all exited by the session's end."""
    yield
    reap_stopped()


@pytest.fixture(scope="session")
def sglang_python() -> str:
    py = _sglang_python()
    if py is None:
        pytest.skip("no SGLang 0.5.23 environment: create it with `bash "
                    "scripts/sglang_runtime_env.sh` (11 GB) or set SLOSERVE_SGLANG_PYTHON")
    return py


@pytest.fixture(scope="session")
def tiny_sglang_pair() -> tuple[str, str]:
    target, draft = ensure_tiny_pair()
    return str(target), str(draft)


class ServerPool:
    """Named SGLang servers, each started on first request and kept for the module."""

    def __init__(self, python: str, logs: Path, configs: dict[str, dict]):
        self.python, self.logs, self.configs = python, logs, configs
        self.running: dict[str, tuple[CPUServerConfig, subprocess.Popen]] = {}
        self.start_seconds: dict[str, float] = {}

    def get(self, *names: str) -> list[CPUServerConfig]:
        """The servers' configs, starting the missing ones concurrently."""
        new = [n for n in names if n not in self.running]
        t0 = time.monotonic()
        for name in new:
            cfg = CPUServerConfig(port=free_port(), extra_args=SERVER_ARGS, **self.configs[name])
            proc = start_server(cfg, self.python, self.logs / f"{name}.log")
            self.running[name] = (cfg, proc)
        for name in new:
            cfg, proc = self.running[name]
            try:
                wait_ready(cfg.url, proc, timeout=600)
            except Exception as e:
                log = (self.logs / f"{name}.log").read_text(errors="replace")
                self.stop(name)
                raise RuntimeError(f"SGLang server {name!r} did not start: {e}\n--- its log ---\n"
                                   f"{log[-20000:]}") from e
            # The first speculative step compiles a helper with torch.compile (about 30 s, or
            # minutes on a busy machine); do it here rather than inside a test's requests.
            generate(cfg, {"input_ids": [11, 12, 13, 14], "sampling_params": {
                "max_new_tokens": 8, "temperature": 0, "ignore_eos": True}})
            self.start_seconds[name] = time.monotonic() - t0
        return [self.running[n][0] for n in names]

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text(errors="replace")

    def stop(self, name: str) -> None:
        if name in self.running:
            stop_server(self.running.pop(name)[1])

    def stop_all(self) -> None:
        for name in list(self.running):
            self.stop(name)


@pytest.fixture(scope="module")
def servers(sglang_python, tiny_sglang_pair, tmp_path_factory):
    target, draft = tiny_sglang_pair
    spec = dict(num_steps=3, eagle_topk=1, num_draft_tokens=4)
    pool = ServerPool(sglang_python, tmp_path_factory.mktemp("sglang_logs"), {
        "amx": dict(model_path=target, attention_backend="intel_amx"),
        "native": dict(model_path=target, attention_backend="torch_native"),
        "spec": dict(model_path=target, spec=SpecConfig(draft_model_path=draft, **spec)),
        "self_spec": dict(model_path=target, spec=SpecConfig(draft_model_path=target, **spec)),
    })
    yield pool
    pool.stop_all()
    if pool.start_seconds:
        print("\nSGLang server start seconds:",
              {k: round(v, 1) for k, v in pool.start_seconds.items()})


@pytest.fixture(scope="session")
def tiny_plain(sglang_python, tiny_sglang_pair, tmp_path_factory):
    """`sloserve.launch --engine sglang --spec-policy ar` on the tiny pair (SGLang's plain
    decoding, the reference of the SPECSERVE modules' greedy and sampling tests): one server
    for the session, as a start costs about a minute on a 2-core AVX2 machine. Yielded started
    but maybe not ready: a module calls `.wait()` after starting its own servers beside it."""
    target, draft = tiny_sglang_pair
    server = LaunchedServer(sglang_python, ["--model-path", target, "--draft-model-path", draft,
                                            "--spec-policy", "ar"],
                            tmp_path_factory.mktemp("tiny_plain") / "server.log", {})
    try:
        yield server
    finally:
        server.stop(wait=False)


@pytest.fixture(scope="session")
def tiny_forced(sglang_python, tiny_sglang_pair, tmp_path_factory):
    """SPECSERVE with the forced lengths on the tiny pair, its per-step decisions in
    `.step_log` (--spec-step-log, one JSON line a drafting step): shared by the ragged
    module's greedy test and the sampling module's (a start is about a minute here). Started
    on first use; the steps of both modules' requests land in the one log."""
    target, draft = tiny_sglang_pair
    logs = tmp_path_factory.mktemp("tiny_forced")
    step_log = logs / "steps.jsonl"
    server = LaunchedServer(sglang_python, forced_args(target, draft)
                            + ["--spec-step-log", str(step_log)], logs / "server.log", {})
    server.step_log = step_log  # type: ignore[attr-defined]
    try:
        yield server
    finally:
        server.stop(wait=False)
