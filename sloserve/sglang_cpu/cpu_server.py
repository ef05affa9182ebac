"""Command line and environment that start SGLang's own server (`python -m
sglang.launch_server`) on a CPU-only machine, plus start/wait/stop helpers.

On CPUs without CUDA, SGLang 0.5.23 needs:
- SGLANG_USE_CPU_ENGINE=1 (its is_cpu() switch) and `--device cpu --disable-cuda-graph`;
- an `sgl_kernel` with the CPU ops: sloserve's stand-in directory goes first on PYTHONPATH
  (only when no CUDA device is present; a CUDA machine keeps the real package);
- `--max-total-tokens` and `--mem-fraction-static`, or SGLang sizes its KV cache from the
  machine's RAM (12.5 GB on a 24 GB machine);
- `--attention-backend intel_amx`, the only CPU backend with speculative decoding; sloserve's
  plugin (sloserve.sglang_ext.register, loaded by SGLang itself) keeps SGLang from replacing
  it with torch_native on CPUs without AMX;
- `--sleep-on-idle`: an idle scheduler otherwise polls its sockets without pause and keeps a
  core busy, which on a 2-core machine slows every other process (and every other server)
  several-fold.
The python running the server must have SGLang and sloserve installed
(scripts/sglang_runtime_env.sh prepares one).
"""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

SHIM_DIR = Path(__file__).resolve().parent / "cpu_shim"  # holds the sgl_kernel stand-in


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:  # no torch here: decide by the driver's presence
        return Path("/proc/driver/nvidia/version").exists()
    return torch.cuda.is_available()


@dataclass(frozen=True)
class SpecConfig:
    """SGLang's EAGLE-family speculative decoding (`--speculative-*`)."""

    draft_model_path: str
    algorithm: str = "STANDALONE"
    num_steps: int = 3
    eagle_topk: int = 1
    num_draft_tokens: int = 4

    def args(self) -> list[str]:
        return [
            "--speculative-algorithm", self.algorithm,
            "--speculative-draft-model-path", self.draft_model_path,
            "--speculative-num-steps", str(self.num_steps),
            "--speculative-eagle-topk", str(self.eagle_topk),
            "--speculative-num-draft-tokens", str(self.num_draft_tokens),
        ]


@dataclass(frozen=True)
class CPUServerConfig:
    model_path: str
    port: int
    host: str = "127.0.0.1"
    attention_backend: str = "intel_amx"
    max_total_tokens: int = 4096
    # SGLang sizes the KV pool as (memory free after loading) - (memory free before it) x
    # (1 - this), capped by max_total_tokens, and refuses to start (exit 247) when that is
    # <= 0. On a CPU "free" is the machine's: servers loading beside each other take it
    # too, so with 0.3 (a load may use 30% of what was free) the fourth of four starts at
    # once failed on a 24 GB machine, and a CI test server beside others; at 0.9 only
    # running out of memory fails, and the cap still sizes the pool.
    mem_fraction_static: float = 0.9
    spec: SpecConfig | None = None
    extra_args: tuple[str, ...] = field(default_factory=tuple)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


def server_command(cfg: CPUServerConfig, python: str) -> list[str]:
    cmd = [
        python, "-m", "sglang.launch_server",
        "--model-path", cfg.model_path,
        "--host", cfg.host, "--port", str(cfg.port),
        "--device", "cpu", "--disable-cuda-graph",
        "--attention-backend", cfg.attention_backend,
        "--max-total-tokens", str(cfg.max_total_tokens),
        "--mem-fraction-static", str(cfg.mem_fraction_static),
        "--sleep-on-idle",
    ]
    if cfg.spec is not None:
        cmd += cfg.spec.args()
    return cmd + list(cfg.extra_args)


def server_env(base: dict[str, str] | None = None, *, use_shim: bool | None = None) -> dict[str, str]:
    """`base` (default os.environ) plus SGLANG_USE_CPU_ENGINE=1 and, unless a CUDA device is
    present (or use_shim says otherwise), the sgl_kernel stand-in first on PYTHONPATH."""
    env = dict(os.environ if base is None else base)
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    if use_shim is None:
        use_shim = not cuda_available()
    if use_shim:
        rest = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(SHIM_DIR)]
        env["PYTHONPATH"] = os.pathsep.join([str(SHIM_DIR), *rest])
    return env


def start_server(cfg: CPUServerConfig, python: str, log_path: Path) -> subprocess.Popen:
    """Start the server in its own process group, stdout and stderr to log_path."""
    log = open(log_path, "wb")  # noqa: SIM115  (owned by the child's lifetime)
    return subprocess.Popen(
        server_command(cfg, python), env=server_env(), stdout=log, stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 300.0) -> None:
    """Block until GET url/health_generate answers 200; raise if the process exits first or
    the timeout passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"SGLang server exited with code {proc.returncode} before ready")
        try:
            with urllib.request.urlopen(url + "/health_generate", timeout=30) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError, http.client.HTTPException):
            pass  # HTTPException: e.g. a connect to a port nobody listens on yet, given itself
        time.sleep(1.0)
    raise TimeoutError(f"SGLang server at {url} not ready after {timeout:.0f} s")


def stop_server(proc: subprocess.Popen, timeout: float = 30.0) -> None:
    """SIGTERM the server's process group (launcher, scheduler, detokenizer; started in a
    session of its own, so the group is the launcher's pid), then SIGKILL whatever of it is
    left after the launcher exited or after `timeout`: SGLang's children can outlive it."""
    pgid = proc.pid
    if proc.poll() is None:
        os.killpg(pgid, 15)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(pgid, 9)
    except ProcessLookupError:
        pass
    proc.wait()
    # the group's other processes die after the launcher is reaped, and the launcher's
    # listening socket, inherited by SGLang's children, stays bound until the last is gone:
    # a server restarted on the same port at once failed to bind it (the bench's --restart,
    # 2026-12-05, with the machine swapping)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)


def generate(cfg: CPUServerConfig, payload: dict, timeout: float = 600.0) -> dict | list:
    """POST /generate (SGLang's native API) and return the decoded JSON answer."""
    req = urllib.request.Request(
        cfg.url + "/generate", data=json.dumps(payload).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())
