"""SGLang + SPECSERVE against SGLang's own speculation and plain decoding, closed loop, on one
machine in one run (issue #17, acceptance 4). Takes about 20-25 minutes on a 2-core CPU
with the defaults on the built-in pair (servers started one after another, 60-120 s each),
45 minutes for five systems on smollm2; it prints its estimate first.

    python -m sloserve.bench.sglang_specserve [--levels 1,4,16] [--repeats 3]
        [--new-tokens 64] [--prompt-tokens 128] [--model-path T --draft-model-path D] [--out out/...json]

Systems, each SGLang 0.5.23's own server (`python -m sloserve.launch --engine sglang`, the
CPU engine's flags added on machines without CUDA), float32, the same model pair:

    plain         SGLang without speculation (--spec-policy ar)
    plain:sync    the same without SGLang's overlap schedule (--disable-overlap-schedule),
                  as SGLang runs every speculative server on a CPU (STANDALONE and NGRAM
                  included: "Overlap schedule is not implemented for speculative decoding on
                  CPU"), and SPECSERVE everywhere
    standalone:1  SGLang's STANDALONE speculation (the draft model, topk 1), 1 draft step
    standalone:3  the same, 3 draft steps
    specserve     SPECSERVE in its default mode (sloserve's controller: one draft length
                  per batch and step, k_max 4), its cost profile of SGLang's forwards if one
                  is in the user cache (python -m sloserve.profiler --engine sglang),
                  corrected online
    specserve:per-request  the same with --spec-lengths per-request (the plan stops
                  drafting round by round; per-request verify lengths, a ragged verify)
    specserve:MODE:OPTIONS  MODE (uniform | per-request) with the policy's options set
                  (--spec-options, "+" between name=value pairs), e.g.
                  specserve:per-request:uniform_margin=0
    sloserve[:POLICY[:MODE[:OPTIONS]]]  SPECSERVE as `python -m sloserve.launch --engine
                  sglang` starts it by default (policy specserve-slo, the launcher's k_max;
                  --k-max here overrides it), or with POLICY (any of the registry: fixed:3
                  is written fixed=3, lut:1=0 lut=1=0), MODE and OPTIONS as above
    sloserve-ngram[:POLICY[:MODE[:OPTIONS]]]  the same with `--drafter ngram` (prompt
                  lookup over each request's tokens; no draft forward)
    standalone:N  SGLang's STANDALONE with N draft steps (any N)
    SYSTEM/no-profile  a SPECSERVE system without its cost profile (--spec-profile none:
                  the estimate from the models' shapes, corrected online)
    SYSTEM/row    any system (the suffix last) with SGLang's own row-major float32 weights on a CPU
                  (SLOSERVE_CPU_WEIGHTS=row; sloserve's plugin packs them for oneDNN or
                  stores them column-major by default, sloserve/sglang_ext/cpu_weights.py);
                  SPECSERVE then reads the profile measured that way; SYSTEM/column and
                  SYSTEM/packed ask for those layouts
    SYSTEM/f32-draft  a SPECSERVE system whose draft model multiplies in float32 where the
                  CPU has bf16 matmul hardware (SLOSERVE_CPU_DRAFT_DTYPE=float32; bf16 by
                  default there, sloserve/sglang_ext/cpu_weights.py); with a layout suffix
                  in either order
    SYSTEM/pad, SYSTEM/nopad  any system whose float32 packed products of 1-3 rows are
                  padded to 4 rows / never padded (SLOSERVE_CPU_PAD_ROWS=on / off; by
                  default the machine's measured decision, runtime/models/cpu_linear.py)
    SYSTEM/torch-attn  any system whose CPU shim attends in plain torch instead of the
                  project's C++ paged attention (SLOSERVE_CPU_KERNELS=0;
                  sloserve/sglang_cpu/cpu_ops/attention.py)
    SYSTEM/sglang-draft  a SPECSERVE system whose draft forwards run through SGLang's model
                  runner instead of sloserve's lean decoder (SLOSERVE_LEAN_DRAFT=0;
                  sloserve/sglang_ext/lean_draft.py)
    SYSTEM/sglang-verify  a SPECSERVE system whose steps without drafting run through
                  SGLang's verify of the bonus token instead of as plain decode steps
                  (SLOSERVE_DECODE_STEP=0; sloserve/sglang_ext/worker.py _decode_step)

SGLang's own adaptive speculation (`--speculative-adaptive`) applies only to EAGLE/EAGLE3
in 0.5.23 (speculative/adaptive_spec_params.py: adaptive_unsupported_reason); with
STANDALONE SGLang logs that it falls back to static steps, so it is not a separate system
here.

Load: a closed loop of C clients (C = each level); each sends an ordinary prompt (Spec-Bench
questions when beside the checkout, cut to --prompt-tokens of the target's tokenizer) asking
for --new-tokens greedy tokens (ignore_eos) and sends the next when its answer arrives,
until max(4 C, 8) requests finished. tok/s = completion tokens / wall seconds of the loop;
steady tok/s = the tokens streamed while all C clients still had a request in flight / those
seconds (the loop's drain, in which fewer than C requests run and whose length is set by how
far apart the last ones finish, left out: with four requests a client it was 7-17% of a
loop's time on the Xeon, 2026-11-28). Each level is measured --repeats times after a warm-up
loop (compiles, caches, SPECSERVE's calibration and online correction) and the
median reported. The servers run one at a time, or with --interleave all at once (each
sleeps while idle) with every repeat and level measured on each system in turn, every second
repeat in the reverse order of the one before and the order rotating per pair of repeats
(`cell_order`): a machine whose speed drifts over the run (this CPU's do by 10-30%) then moves
every system alike. Run it on a quiet machine (CPU contention slows SGLang's
steps 20x). With --restart every repeat starts (and warms) its servers afresh: a
server's speed can differ from one start to the next by more than the effects measured here,
and then only repeats over starts show it. With --slices N (and --interleave) each cell's
loop is cut into N consecutive slices and the systems take turns at every slice (the order
of `cell_order` per slice), the cell's figures summed over its slices (`merge_loops`): on a
VM whose speed swings by 20% within a minute (the Xeon, 2026-11-29: a step's time within one
cell), turns of 10-20 s leave the systems far less apart than whole cells minutes apart.
A slice of max(4 C, 8) / N requests is one or two waves at C >= 4, and a counted loop's
last wave drains for as long as its slowest request runs: speculation spreads the steps at
which requests finish (each accepts its own), so a few-wave loop prices that spread rather
than the server's rate at C. With --seconds S each loop (each slice) is timed instead: C
clients for S seconds, the requests still running then aborted, and tok/s (steady tok/s
alike) over the window from the opening prefills' end to S (`timed_loop`).
Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from sloserve.bench.common import bench_prompts, machine_info, print_table, write_json
from sloserve.bench.step_clock import cell_clock, read_clock
from sloserve.replay.http_target import SSEStream, consume_sse_line
from sloserve.runtime.cpu_kernels import ENV_SWITCH as KERNELS_ENV
from sloserve.runtime.models.cpu_linear import PAD_ENV
from sloserve.sglang_cpu.cpu_server import stop_server, wait_ready
from sloserve.sglang_ext import STEP_CLOCK_ENV
from sloserve.sglang_ext.cpu_weights import DRAFT_DTYPE_ENV, LAYOUT_ENV
from sloserve.sglang_ext.lean_draft import ENV_SWITCH as LEAN_ENV
from sloserve.sglang_ext.settings import DECODE_STEP_ENV

REPO = Path(__file__).resolve().parents[2]
SYSTEMS = ("plain", "standalone:1", "standalone:3", "specserve", "specserve:per-request")


def sglang_python() -> str:
    """The python of SGLang's runtime environment (scripts/sglang_runtime_env.sh)."""
    explicit = os.environ.get("SLOSERVE_SGLANG_PYTHON")
    if explicit:
        return explicit
    proc = subprocess.run(["bash", str(REPO / "scripts" / "sglang_runtime_env.sh"),
                           "--no-create"], capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit("needs SGLang's runtime environment: bash scripts/sglang_runtime_env.sh")
    return proc.stdout.strip().splitlines()[-1]


def file_stem(system: str) -> str:
    """The system's name as a file name (its log, its timings lines)."""
    return system.replace(":", "-").replace("/", "-")


def ours(system: str) -> bool:
    """Whether the system is sloserve's SPECSERVE worker (not SGLang's own). `sloserve:ar`
    is not: the launcher starts plain SGLang for policy ar (no worker, no timings lines)."""
    base = _env_suffixes(system)[0].split("@", 1)[0].removesuffix("/no-profile")
    if base.startswith("sloserve") and base.split(":")[1:2] == ["ar"]:
        return False
    return system.startswith(("specserve", "sloserve"))


# suffixes that set one system's server environment (any of them, last, in any order)
ENV_SUFFIXES = {"/row": (LAYOUT_ENV, "row"), "/column": (LAYOUT_ENV, "column"),
                "/packed": (LAYOUT_ENV, "packed"), "/f32-draft": (DRAFT_DTYPE_ENV, "float32"),
                "/pad": (PAD_ENV, "on"), "/nopad": (PAD_ENV, "off"),
                "/torch-attn": (KERNELS_ENV, "0"), "/sglang-draft": (LEAN_ENV, "0"),
                "/sglang-verify": (DECODE_STEP_ENV, "0")}


def _env_suffixes(system: str) -> tuple[str, dict[str, str]]:
    """(SYSTEM without its environment suffixes, the environment they set)."""
    env: dict[str, str] = {}
    while True:
        for suffix, (name, value) in ENV_SUFFIXES.items():
            if system.endswith(suffix):
                system = system.removesuffix(suffix)
                env[name] = value
                break
        else:
            return system, env


def system_env(system: str) -> dict[str, str]:
    """The environment one system's server adds: `SYSTEM/row`: SGLang's row-major weights
    (`/column`, `/packed`: those layouts); `SYSTEM/f32-draft`: SPECSERVE's draft model in
    float32 (not bf16 where the CPU has it)."""
    return _env_suffixes(system)[1]


def system_args(system: str, target: str, draft: str, k_max: int | None = None) -> list[str]:
    """`python -m sloserve.launch --engine sglang` options of one system. `SYSTEM/no-profile`:
    without a cost profile; `SYSTEM@DIR`: with the draft model in DIR instead of `draft`;
    `SYSTEM/row`, `SYSTEM/f32-draft`: the options of SYSTEM (the rest is `system_env`'s)."""
    base, env = _env_suffixes(system)
    if env:
        return system_args(base, target, draft, k_max)
    if system.endswith("/no-profile"):  # a SPECSERVE system as on the pair's first start
        return system_args(system.removesuffix("/no-profile"), target, draft, k_max) + [
            "--spec-profile", "none"]
    if "@" in system:
        system, draft = system.split("@", 1)
    pair = ["--model-path", target, "--draft-model-path", draft]
    if system == "plain":
        return pair + ["--spec-policy", "ar"]
    if system == "plain:sync":  # SGLang's scheduler as every speculative server has it here
        return pair + ["--spec-policy", "ar", "--disable-overlap-schedule"]
    if system.startswith("specserve"):
        _, mode, options = (system.split(":", 2) + ["", ""])[:3]
        return pair + ["--k-max", "4", "--spec-policy", "specserve",
                       "--spec-lengths", mode or "uniform",
                       "--spec-options", options.replace("+", ",")]
    if system.startswith("sloserve"):
        name, policy, mode, options = (system.split(":", 3) + ["", "", ""])[:4]
        out = pair + (["--k-max", str(k_max)] if k_max is not None else [])
        out += ["--drafter", "ngram" if name == "sloserve-ngram" else "model"]
        if policy:
            out += ["--spec-policy", policy.replace("=", ":", 1)]
        if mode:  # else the launcher's default for the drafter
            out += ["--spec-lengths", mode]
        return out + ["--spec-options", options.replace("+", ",")]
    steps = int(system.split(":")[1])  # SGLang's own: sloserve adds nothing (ar) but the CPU
    return ["--model-path", target, "--spec-policy", "ar",  # engine's flags
            "--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", draft,
            "--speculative-num-steps", str(steps), "--speculative-eagle-topk", "1",
            "--speculative-num-draft-tokens", str(steps + 1)]


class Server:
    def __init__(self, python: str, args: list[str], port: int, log: Path,
                 extra_env: dict[str, str] | None = None) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.log = log
        env = {**os.environ, **(extra_env or {})}
        # the checkout's sloserve in SGLang's processes (its plugin and SPECSERVE worker)
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
        cmd = [python, "-m", "sloserve.launch", "--engine", "sglang", "--port", str(port),
               "--dtype", "float32", "--log-level", "warning", *args]
        self.proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=open(log, "wb"),  # noqa: SIM115
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def wait(self) -> None:
        try:
            wait_ready(self.url, self.proc, 1800)
        except Exception:
            print(self.log.read_text(errors="replace")[-4000:], file=sys.stderr)
            raise

    def generate(self, ids: list[int], new_tokens: int, ignore_eos: bool = True,
                 stop: threading.Event | None = None) -> dict:
        return generate(self.url, ids, new_tokens, ignore_eos, stop)

    def stop(self) -> None:
        stop_server(self.proc, 60)


def generate(url: str, ids: list[int], new_tokens: int, ignore_eos: bool = True,
             stop: threading.Event | None = None) -> dict:
    """One greedy request to SGLang's /generate, streamed and read as the replay's HTTP
    target reads it: the last chunk's JSON (the whole output and meta_info) with
    "arrivals", [(perf_counter seconds, completion tokens so far)] whenever the count grew,
    so a closed loop can count the tokens made in any window of it. stop: once set, the
    request is being aborted (`timed_loop`): the stream's end or error then returns what
    arrived (possibly nothing) instead of raising."""
    body = {"input_ids": ids, "stream": True,
            "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0,
                                "ignore_eos": ignore_eos}}
    req = urllib.request.Request(url + "/generate", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    stream = SSEStream()
    with urllib.request.urlopen(req, timeout=3600) as r:
        for raw in r:
            error = consume_sse_line(raw.decode(), time.perf_counter(), stream)
            if error is not None and not (stop is not None and stop.is_set()):
                raise RuntimeError(f"{url}/generate: {error}")
            if stream.done or error is not None:
                break
    if not stream.chunk_s and not (stop is not None and stop.is_set()):
        raise RuntimeError(f"{url}/generate: the stream ended without a token")
    return {**stream.last, "arrivals": list(zip(stream.chunk_s, stream.chunk_tokens))}


def abort_all(url: str) -> None:
    """SGLang's /abort_request for every request the server holds."""
    req = urllib.request.Request(url + "/abort_request", json.dumps({"abort_all": True}).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        r.read()


def timed_window(requests: list[tuple[float, list[tuple[float, int]]]], concurrency: int,
                 seconds: float) -> tuple[float, int]:
    """(seconds, tokens) of a timed closed loop's window: from the moment every client's
    first request had its first token (the loop's opening prefills, which all systems run
    alike, left out) to `seconds` after the loop's start, when the clients stopped.

    requests: per request (start, arrivals) in the order sent, times from the loop's start,
    arrivals as `generate` returns them. A request's tokens count by the arrival times of
    its stream (a chunk of several tokens counts whole when it arrives), so a loop's window
    holds the tokens made at concurrency C with no drain in it: a request still running
    at the end is cut there, not waited for."""
    opening = [arr[0][0] for _, arr in requests[:concurrency] if arr]
    if len(opening) < concurrency or max(opening) >= seconds:
        raise RuntimeError(f"a timed loop of {seconds:g} s at concurrency {concurrency} "
                           "ended before every client had its first token: make it longer")
    begin = max(opening)

    def upto(arr: list[tuple[float, int]], t: float) -> int:
        return max((n for a, n in arr if a <= t), default=0)

    tokens = sum(upto(arr, seconds) - upto(arr, begin) for _, arr in requests)
    return seconds - begin, tokens


def timed_loop(server: Server, prompts: list[list[int]], concurrency: int, seconds: float,
               new_tokens: int, ignore_eos: bool = True, first: int = 0) -> dict:
    """A closed loop of `concurrency` clients for `seconds` (prompts first, first + 1, ...
    cyclically, each client sending its next when its answer arrives), then every request
    still running aborted; its figures over `timed_window` (tok/s and steady tok/s alike;
    `merge_loops`'s sums). Unlike `closed_loop` it never drains: a speculative server's
    requests finish at different steps, and a loop of a few waves spends its last one at
    less than its concurrency, for as long as the slowest request takes."""
    t0 = time.perf_counter()
    stop = threading.Event()
    sent = itertools.count()
    done: list[tuple[int, float, dict]] = []
    failed: list[BaseException] = []

    def client() -> None:
        try:
            while not stop.is_set() and time.perf_counter() - t0 < seconds:
                i = next(sent)
                start = time.perf_counter() - t0
                out = server.generate(prompts[(first + i) % len(prompts)], new_tokens,
                                      ignore_eos, stop)
                done.append((i, start, out))
        except BaseException as e:  # noqa: BLE001 - re-raised below, in the caller
            failed.append(e)
            stop.set()

    threads = [threading.Thread(target=client, daemon=True) for _ in range(concurrency)]
    for t in threads:
        t.start()
    stop.wait(max(0.0, seconds - (time.perf_counter() - t0)))
    stop.set()
    while any(t.is_alive() for t in threads):  # a request sent as the loop ended may
        abort_all(server.url)                   # reach SGLang after an abort: again
        for t in threads:
            t.join(timeout=1.0)
    if failed:
        raise failed[0]
    done.sort(key=lambda d: d[0])
    metas = [o.get("meta_info", {}) for _, _, o in done]
    steps = [k for m in metas for k in m.get("sloserve_draft_steps", [])]
    window_s, tokens = timed_window(
        [(start, [(t - t0, k) for t, k in o["arrivals"]]) for _, start, o in done],
        concurrency, seconds)
    return merge_loops([{
        "wall": window_s, "requests": len(done), "tokens": tokens,
        "made": sum(o["arrivals"][-1][1] for _, _, o in done if o["arrivals"]),
        "steady_s": window_s, "steady_tokens": tokens,
        "verify_ct": sum(m.get("spec_verify_ct", 0) for m in metas),
        "draft_steps": len(steps), "drafted": sum(steps)}])


def steady_window(requests: list[tuple[float, list[tuple[float, int]]]]) -> tuple[float, int]:
    """(seconds, tokens) of a closed loop while every client still had a request in flight.

    requests: per request (start, arrivals), times from the loop's start, arrivals as
    `generate` returns them (the last one is the request's end). After the last request
    starts, the next one to finish leaves its client with nothing to send: from then on the
    loop drains at less than its concurrency, and the drain's length depends on how far
    apart the last requests finish rather than on how fast the server is at that
    concurrency. The window ends at that finish (at C = 1, the loop's end); tokens are the
    ones that had arrived by then."""
    last_start = max(start for start, _ in requests)
    end = min(arr[-1][0] for start, arr in requests if arr[-1][0] > last_start)
    tokens = sum(max((n for t, n in arr if t <= end), default=0) for _, arr in requests)
    return end, tokens


def closed_loop(server: Server, prompts: list[list[int]], concurrency: int, n: int,
                new_tokens: int, ignore_eos: bool = True, first: int = 0) -> dict:
    """n requests (prompts first, first + 1, ... cyclically), `concurrency` in flight; tok/s
    over the loop's wall time (its drain included) and over its steady window
    (`steady_window`), with the sums they come from (`merge_loops`)."""
    t0 = time.perf_counter()

    def one(i: int) -> tuple[float, dict]:
        start = time.perf_counter() - t0
        return start, server.generate(prompts[(first + i) % len(prompts)], new_tokens,
                                      ignore_eos)

    with ThreadPoolExecutor(concurrency) as pool:
        done = list(pool.map(one, range(n)))
    wall = time.perf_counter() - t0
    metas = [o["meta_info"] for _, o in done]
    steps = [k for m in metas for k in m.get("sloserve_draft_steps", [])]
    steady_s, steady_tokens = steady_window(
        [(start, [(t - t0, k) for t, k in o["arrivals"]]) for start, o in done])
    return merge_loops([{
        "wall": wall, "requests": n, "tokens": sum(m["completion_tokens"] for m in metas),
        "steady_s": steady_s, "steady_tokens": steady_tokens,
        "verify_ct": sum(m.get("spec_verify_ct", 0) for m in metas),
        "draft_steps": len(steps), "drafted": sum(steps)}])


def warm_up(server: Server, prompts: list[list[int]], concurrency: int, new_tokens: int,
            ignore_eos: bool = True) -> None:
    """Run a server's first steps unmeasured: a closed loop of 2 x `concurrency` requests at
    `concurrency`, then two at 1, so that the batch shapes the measurement meets have run
    once (a new shape's first steps run long) and the controller's cost correction has
    seen both ends of the batch sizes."""
    closed_loop(server, prompts, concurrency, 2 * concurrency, new_tokens, ignore_eos)
    closed_loop(server, prompts, 1, 2, new_tokens, ignore_eos)


SUMS = ("wall", "requests", "tokens", "steady_s", "steady_tokens", "verify_ct", "draft_steps",
        "drafted")


def merge_loops(parts: list[dict]) -> dict:
    """One cell's figures from the closed loops it ran in (--slices: one per slice; each part
    has the sums in SUMS): tok/s = all tokens over all the loops' seconds, steady tok/s
    likewise over the steady windows, tokens per verify and the mean draft steps a
    request's decode step drafted (None where nothing was verified or counted)."""
    out = {k: sum(p[k] for p in parts) for k in SUMS}
    # the tokens the verify count is of: a timed loop's are its requests' whole outputs, not
    # the window's (`timed_loop`'s "made")
    made = sum(p.get("made", p["tokens"]) for p in parts)
    return {**out, "made": made, "slices": len(parts),
            "tok_s": out["tokens"] / out["wall"],
            # each slice's own tok/s, in order (`paired_slices`)
            "slice_tok_s": [t for p in parts for t in p.get("slice_tok_s",
                                                            [p["tokens"] / p["wall"]])],
            "steady_tok_s": out["steady_tokens"] / out["steady_s"],
            "accept_len": made / out["verify_ct"] if out["verify_ct"] else None,
            "mean_k": out["drafted"] / out["draft_steps"] if out["draft_steps"] else None}


class Running:
    """One system's server, warmed up, and where its worker writes its timings lines."""

    def __init__(self, system: str, python: str, target: str, draft: str, logs: Path,
                 port: int, k_max: int | None, timings: bool, start: int = 0,
                 seconds: float | None = None, step_logs: bool = False,
                 step_clock: bool = False) -> None:
        """start: which start of this system in the run (0: the first; a restart appends to
        the timings file and writes its own server log); seconds: each slice a timed loop
        of this long (`timed_loop`), else a counted one (`closed_loop`); step_clock: the
        scheduler's step clock on (any system; `step_clock.py`), each cell's medians in its
        result's "clock"."""
        self.system = system
        self.seconds = seconds
        args = system_args(system, target, draft, k_max)
        self.timings_file = logs / f"{file_stem(system)}.timings.jsonl"
        self.timed = timings and ours(system)
        if self.timed:  # one JSON line per decode step (worker's controller)
            if start == 0:
                self.timings_file.unlink(missing_ok=True)
            args += ["--spec-timings", str(self.timings_file.resolve())]
        if step_logs and ours(system):  # the per-request plan's steps (diagnostics; slower)
            steps = logs / f"{file_stem(system)}.steps.jsonl"
            if start == 0:
                steps.unlink(missing_ok=True)
            args += ["--spec-step-log", str(steps.resolve())]
        log = f"{file_stem(system)}{f'.start{start + 1}' if start else ''}.log"
        env = system_env(system)
        self.clock_file = logs / f"{file_stem(system)}.clock.txt" if step_clock else None
        if self.clock_file is not None:
            if start == 0:
                self.clock_file.unlink(missing_ok=True)
            env = {**env, STEP_CLOCK_ENV: str(self.clock_file.resolve())}
        self.server = Server(python, args, port, logs / log, extra_env=env)
        self.mark = 0  # the timings lines before the cell being measured
        self.windows: list[tuple[float, float]] = []  # the cell's loops (perf_counter)

    def warm(self, prompts: list[list[int]], levels: list[int], new_tokens: int,
             ignore_eos: bool, t0: float) -> None:
        self.server.wait()
        print(f"[{self.system}] server up in {time.monotonic() - t0:.0f} s; warm-up",
              flush=True)
        warm_up(self.server, prompts, max(levels), new_tokens, ignore_eos)

    def measure(self, prompts: list[list[int]], c: int, new_tokens: int,
                ignore_eos: bool, part: int = 0, parts: int = 1) -> dict:
        """Slice `part` of `parts` of the cell's closed loop at concurrency c (max(4 c, 8)
        requests, prompts 0, 1, ... in order, cut into `parts` consecutive runs of at
        least c requests each); the last slice carries the worker's per-step breakdown of
        the whole cell (its timings lines since the first slice: no other server writes
        them)."""
        n = max(4 * c, 8)
        lo, hi = part * n // parts, (part + 1) * n // parts
        if self.timed and part == 0:
            self.mark = _lines(self.timings_file)
        if part == 0:
            self.windows = []
        t0 = time.perf_counter()
        if self.seconds is not None:  # --seconds: a timed loop from the same first prompt
            r = timed_loop(self.server, prompts, c, self.seconds, new_tokens, ignore_eos,
                           first=lo)
        else:
            r = closed_loop(self.server, prompts, c, hi - lo, new_tokens, ignore_eos, first=lo)
        self.windows.append((t0, time.perf_counter()))
        if self.timed and part == parts - 1:
            r["steps"] = step_breakdown(self.timings_file, self.mark)
        if self.clock_file is not None and part == parts - 1:
            r["clock"] = cell_clock(read_clock(self.clock_file), self.windows, c)
        return r


def run_systems(systems: list[str], python: str, target: str, draft: str,
                levels: list[int], repeats: int, new_tokens: int, prompts: list[list[int]],
                logs: Path, port: int, k_max: int | None = None, ignore_eos: bool = True,
                timings: bool = False, interleave: bool = False, restart: bool = False,
                slices: int = 1, seconds: float | None = None, step_logs: bool = False,
                step_clock: bool = False, on_repeat: Callable[[dict[str, dict[int, list[dict]]]], None] | None = None,
                ) -> dict[str, dict[int, list[dict]]]:
    """{system: {concurrency: [one result per repeat]}}. One server at a time, its repeats
    back to back; or (interleave) every server up at once (each sleeps while idle) and each
    (repeat, level) measured on every system in turn in `cell_order`, so a machine
    drifting over the run moves every system alike. restart: fresh servers (started and
    warmed again) for every repeat, so that the repeats sample how fast a start happens to
    be. slices: each cell's loop cut into this many slices, the systems taking turns at
    every slice (`record`). `on_repeat(results so far)` runs after every repeat (the
    caller saves them: a run stopped early keeps its repeats)."""
    out: dict[str, dict[int, list[dict]]] = {s: {c: [] for c in levels} for s in systems}

    def record(runs: list[Running], rep: int, c: int) -> None:
        """One (repeat, level) cell on every system: `slices` rounds, each running one
        slice of the cell's loop on every system in turn (cell_order), so that a machine
        whose speed changes within the cell moves every system alike."""
        parts: dict[str, list[dict]] = {run.system: [] for run in runs}
        for part in range(slices):
            for run in cell_order(runs, rep * slices + part):
                parts[run.system].append(run.measure(prompts, c, new_tokens, ignore_eos,
                                                     part, slices))
        for run in runs:
            r = merge_loops(parts[run.system])
            for key in ("steps", "clock"):  # the last slice's: the whole cell's
                if parts[run.system][-1].get(key) is not None:
                    r[key] = parts[run.system][-1][key]
            out[run.system][c].append(r)
            print(f"[{run.system}] repeat {rep + 1}/{repeats} concurrency {c}: "
                  f"{r['tok_s']:.1f} tok/s ({r['wall']:.1f} s), steady "
                  f"{r['steady_tok_s']:.1f} tok/s ({r['steady_s']:.1f} s)", flush=True)

    groups = [systems] if interleave else [[s] for s in systems]
    # the repeats each set of servers measures: all of them, or one each (restart)
    blocks = [[r] for r in range(repeats)] if restart else [list(range(repeats))]
    for group in groups:
        for block in blocks:
            t0 = time.monotonic()
            runs: list[Running] = []
            try:
                # one server starts at a time: SGLang sizes its KV pool on a CPU from the
                # memory its weights leave free, which servers loading beside it would take
                for i, s in enumerate(group):
                    runs.append(Running(s, python, target, draft, logs, port + i, k_max,
                                        timings, start=block[0] if restart else 0,
                                        seconds=seconds, step_logs=step_logs,
                                        step_clock=step_clock))
                    runs[-1].server.wait()
                for run in runs:
                    run.warm(prompts, levels, new_tokens, ignore_eos, t0)
                for rep in block:
                    t_rep = time.monotonic()
                    for c in levels:
                        record(runs, rep, c)
                    per = (time.monotonic() - (t0 if restart else t_rep)) / 60
                    print(f"repeat {rep + 1}/{repeats} of {group} done; about "
                          f"{(repeats - rep - 1) * per:.0f} minutes of its repeats left",
                          flush=True)
                    if on_repeat is not None:
                        on_repeat(out)
            finally:
                for run in runs:
                    run.server.stop()
    return out


def clock_rows(results: dict[str, dict[int, list[dict]]], systems: list[str],
               levels: list[int]) -> list[list]:
    """The --step-clock table's rows: per level and system, the medians over repeats of
    each cell's step clock (`step_clock.cell_clock`), and its period over plain's."""
    rows, period = [], {}
    for c in levels:
        for s in systems:
            cells = [r["clock"] for r in results[s][c] if r.get("clock")]
            if not cells:
                continue
            med = {k: statistics.median(x[k] for x in cells)
                   for k in ("steps", "period_ms", "run_ms", "between_ms", "process_ms",
                             "next_ms")}
            period[s, c] = med["period_ms"]
            rows.append([c, s, f"{med['steps']:.0f}", *(f"{med[k]:.2f}" for k in (
                "period_ms", "run_ms", "between_ms", "process_ms", "next_ms")),
                         f"{med['period_ms'] / period['plain', c]:.3f}"
                         if ("plain", c) in period else "-"])
    return rows


def paired_slices(mine: list[dict], other: list[dict]) -> list[float]:
    """tok/s ratios of one system to another, slice by slice over every repeat of a cell:
    the same slice of the same repeat ran on the two servers in one turn, seconds apart,
    from the same prompts. On the Xeon VM whose speed swings by 20-40% within a minute (a
    fixed matrix product's rate per second: 0.86-1.27 of its median, 2026-12-02) a ratio of
    whole cells carries that swing; one of adjacent slices less of it, though the pairs of
    8 s slices still spread +-10% there (the swings are faster than a turn of the systems)."""
    return [a / b for x, y in zip(mine, other)
            for a, b in zip(x["slice_tok_s"], y["slice_tok_s"])]


def cell_order(runs: list, rep: int) -> list:
    """The order in which repeat `rep` measures the systems: pairs of repeats run one rotation
    forward, then backward (A B C, C B A; then B C A, A C B ...), so a machine whose speed
    drifts linearly over a pair (this CPU's change by 10-30% within ten minutes) gives every
    system the same mean position in it."""
    shift = (rep // 2) % len(runs)
    order = runs[shift:] + runs[:shift]
    return order[::-1] if rep % 2 else order


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.is_file() else 0


def step_breakdown(path: Path, start: int) -> dict:
    """Mean milliseconds per decode step of the worker's timings lines from `start` on:
    the whole step, the draft rounds, the draft reading the verified window, the verify
    forward, the policy's Python, and the rest (SGLang's scheduling, sampling, the hooks);
    with the mean batch, draft rounds and verified tokens per step."""
    rows = [json.loads(x) for x in path.read_text().splitlines()[start:]]
    rows = [r for r in rows if r.get("batch")]
    if not rows:
        return {}
    for r in rows:  # the rounds alone: the catch-up on skipped steps is its own part
        r["draft"] = float(r["draft"]) - float(r.get("catch_up", 0.0))
    mean = lambda key: statistics.fmean(float(r.get(key, 0.0)) for r in rows)  # noqa: E731
    keys = ("draft", "catch_up", "extend", "verify", "policy")
    parts = {k: 1e3 * mean(k) for k in ("step", *keys)}
    parts["other"] = parts["step"] - sum(parts[k] for k in keys)
    drafting = [r for r in rows if r["k"]]
    plain_ms, all_ms = _token_ms([r for r in rows if not r["k"]]), _token_ms(rows)
    return {**{f"{k}_ms": round(v, 3) for k, v in parts.items()}, "steps": len(rows),
            # milliseconds a token made, over the steps that drafted nothing, those that
            # drafted, and all: within one server (one start's speed), what speculation
            # saved there (`in_server_gain`), which comparing servers across starts cannot
            # tell apart from their starts' speeds (BENCHMARKS.md, 2026-12-05)
            "plain_token_ms": plain_ms, "spec_token_ms": _token_ms(drafting),
            "token_ms": all_ms,
            "in_server_gain": (round(plain_ms / all_ms - 1.0, 4)
                               if plain_ms and all_ms and drafting else None),
            "batch": round(mean("batch"), 2), "rounds": round(mean("k"), 3),
            "verified": round(mean("verified"), 3),
            # per draft round, over the steps that drafted
            "draft_round_ms": round(1e3 * statistics.fmean(r["draft"] / r["k"]
                                                           for r in drafting), 3)
            if drafting else None}


def _token_ms(rows: list[dict]) -> float | None:
    """Milliseconds a token over these timings lines: their step seconds over the tokens
    they made (a token per request and step, plus each accepted draft token)."""
    made = sum(int(r["batch"]) + int(r.get("accepted", 0)) for r in rows)
    return round(1e3 * sum(float(r["step"]) for r in rows) / made, 3) if made else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sloserve.bench.sglang_specserve",
                                description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--levels", default="1,4,16")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=128, help="prompts cut to this")
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--model-path", "--model", default=None,
                   help="target: a directory or a preset (default: the built-in pair; "
                        "smollm2: the real model and its distilled draft)")
    p.add_argument("--draft-model-path", default=None,
                   help="default: the preset's draft")
    p.add_argument("--k-max", type=int, default=None,
                   help="k_max of the sloserve[...] systems (default: the launcher's)")
    p.add_argument("--chat", choices=("auto", "on", "off"), default="auto",
                   help="prompts in the target's chat template, answers end at its stop "
                        "token (auto: when the target has a template)")
    p.add_argument("--timings", action="store_true",
                   help="SPECSERVE's per-step breakdown (the worker's timings lines)")
    p.add_argument("--step-clock", action="store_true",
                   help="every server's scheduler step clock (any system): per level, the "
                        "median decode step's period at the full batch, its forward's part "
                        "and the scheduler's work between forwards")
    p.add_argument("--step-logs", action="store_true",
                   help="SPECSERVE's per-request step log (--spec-step-log: each per-request "
                        "step's first-round predictions, confidences and outcomes) in the "
                        "logs folder; it slows the server, so for diagnostics")
    p.add_argument("--interleave", action="store_true",
                   help="start every system's server at once and measure each repeat and "
                        "level on all of them in turn (a drifting machine moves all alike)")
    p.add_argument("--restart", action="store_true",
                   help="fresh servers for every repeat: on a shared 2-core VM one start of "
                        "a server can stay ~20%% faster than another start of the same one "
                        "(BENCHMARKS.md), which repeats on one start do not sample")
    p.add_argument("--slices", type=int, default=1,
                   help="with --interleave, cut each (repeat, level) loop into this many "
                        "slices (1-4; 1-32 timed, --seconds) and measure the systems in turn "
                        "at every slice: a machine whose speed swings within minutes moves "
                        "all alike")
    p.add_argument("--seconds", type=float, default=None,
                   help="time each cell's loop (each slice's, with --slices) instead of "
                        "counting its requests: C clients for this many seconds, then the "
                        "requests still running aborted; tok/s over the window after the "
                        "opening prefills, no drain in it (a counted loop's last wave runs "
                        "below C for as long as its slowest request, which a speculative "
                        "server's spread of finishing steps lengthens)")
    p.add_argument("--port", type=int, default=31877,
                   help="the first system's port (interleaved: one port per system)")
    p.add_argument("--out", default="out/bench_sglang_specserve.json")
    args = p.parse_args(argv)
    # a counted slice keeps at least C requests (max(4 C, 8) a cell); a timed one its seconds
    if not 1 <= args.slices <= (4 if args.seconds is None else 32):
        p.error(f"argument --slices: {args.slices} is not in 1..4 (1..32 with --seconds)")
    if args.slices > 1 and not args.interleave:
        p.error("argument --slices: needs --interleave (the systems take turns per slice)")
    if args.seconds is not None and not args.seconds >= 5:
        p.error(f"argument --seconds: {args.seconds:g} is below 5 (a loop's opening prefills "
                "must end well inside it)")
    levels = [int(x) for x in args.levels.split(",")]
    systems = args.systems.split(",")
    from sloserve.runtime.models.presets import resolve_pair

    try:
        target, maybe_draft = resolve_pair(args.model_path, args.draft_model_path, "model")
    except ValueError as e:
        p.error(f"argument --draft-model-path: {e}")
    assert maybe_draft is not None
    draft = maybe_draft
    python = sglang_python()
    # each run's own folder: a shared one let the next run's servers overwrite the last
    # run's timings lines (2026-12-02)
    out = Path(args.out)
    logs = out.with_name(f"{out.stem}_logs")
    logs.mkdir(parents=True, exist_ok=True)
    # measured on 2 cores: a smollm2 server starts (one after another) in 3-5.5 min on the
    # Intel Xeons, 5-11 min on the AMD EPYC (AVX2); a counted (system, level, repeat) cell
    # takes 0.3 (built-in pair, C = 1) to 1.5 min (smollm2, C = 16) on the Xeon, 3x that on
    # the EPYC; a timed one its slices' seconds and ~5 s a slice of opening and aborting
    n, cells = len(systems), len(systems) * len(levels) * args.repeats
    n *= args.repeats if args.restart else 1  # server starts
    lo, hi = ((0.3 * cells, 1.5 * cells) if args.seconds is None else
              (cells * args.slices * (args.seconds + 3) / 60,) * 2)
    print(f"SGLang closed loop: {systems} at concurrency {levels}, {args.repeats} repeats, "
          f"{args.new_tokens} tokens a request; about {3 * n + lo:.0f}-"
          f"{5.5 * n + hi * 1.2:.0f} minutes on a 2-core Intel Xeon, up to 2x that on an "
          f"AVX2-only CPU; a line after every repeat says how long is left (server logs "
          f"in {logs})", flush=True)
    prompts, chat = bench_prompts(target, args.prompt_tokens, args.chat)
    print(f"prompts: 64 Spec-Bench questions, categories round-robin"
          f"{', in the chat template' if chat else ''}, at most {args.prompt_tokens} tokens",
          flush=True)
    t0 = time.monotonic()

    def save(results: dict[str, dict[int, list[dict]]], complete: bool = False) -> None:
        write_json(args.out, {"machine": machine_info(), "args": vars(args), "target": target,
                              "draft": draft, "minutes": (time.monotonic() - t0) / 60,
                              "complete": complete,
                              "results": {s: {str(c): v for c, v in r.items()}
                                          for s, r in results.items()}})

    results = run_systems(systems, python, target, draft, levels, args.repeats,
                          args.new_tokens, prompts, logs, args.port, args.k_max,
                          ignore_eos=not chat, timings=args.timings,
                          interleave=args.interleave, restart=args.restart,
                          slices=args.slices, seconds=args.seconds,
                          step_logs=args.step_logs, step_clock=args.step_clock,
                          on_repeat=save)
    rows, summary, steady = [], {}, {}
    for c in levels:
        med = {s: statistics.median(r["tok_s"] for r in results[s][c]) for s in systems}
        steady[c] = {s: statistics.median(r["steady_tok_s"] for r in results[s][c])
                     for s in systems}
        best = max(med.values())
        for s in systems:
            runs = results[s][c]
            acc = [r["accept_len"] for r in runs if r["accept_len"] is not None]
            ks = [r["mean_k"] for r in runs if r["mean_k"] is not None]
            rows.append([c, s, f"{med[s]:.1f}", f"{med[s] / best:.3f}",
                         f"{med[s] / med['plain']:.3f}" if "plain" in med else "-",
                         f"{steady[c][s]:.1f}",
                         f"{steady[c][s] / steady[c]['plain']:.3f}" if "plain" in med else "-",
                         f"{statistics.median(acc):.2f}" if acc else "-",
                         f"{statistics.median(ks):.2f}" if ks else "-",
                         " ".join(f"{r['tok_s']:.0f}" for r in runs)])
        summary[c] = med
    print("(steady: tok/s while all C clients had a request in flight, the loop's drain left"
          " out)")
    print_table(["C", "system", "tok/s (median)", "vs best", "vs plain", "steady tok/s",
                 "steady vs plain", "tokens/verify",
                 "mean k", "repeats tok/s"], rows)
    if args.timings:
        brows = []
        for s in systems:
            for c in levels:
                b = [r["steps"] for r in results[s][c] if r.get("steps")]
                if not b:
                    continue
                med = {k: statistics.median(x[k] for x in b) for k in b[0]
                       if all(x.get(k) is not None for x in b)}
                brows.append([c, s, *(f"{med.get(k, float('nan')):.2f}" for k in (
                    "batch", "rounds", "verified", "step_ms", "draft_ms", "draft_round_ms",
                    "catch_up_ms", "extend_ms", "verify_ms", "policy_ms", "other_ms",
                    "plain_token_ms", "token_ms")),
                    " ".join(f"{x['in_server_gain']:+.1%}" if x.get("in_server_gain")
                             is not None else "-" for x in b)])
        if brows:
            print("\nSPECSERVE per decode step (medians over repeats of the means; ms/token "
                  "k = 0: over its steps that drafted nothing; in-server gain: that over all "
                  "its steps' ms/token, each repeat):")
            print_table(["C", "system", "batch", "rounds", "verified", "step ms", "draft ms",
                         "ms/round", "catch-up ms", "extend ms", "verify ms", "policy ms",
                         "other ms", "ms/token k = 0", "ms/token", "in-server gain"],
                        brows)
    if args.step_clock:
        print("\nThe scheduler's decode steps at batch C (medians over repeats of each cell's "
              "medians; between: the period less the step's run_batch, SGLang's own work "
              "between forwards, of which process: result processing, next batch: the "
              "next batch's preparation):")
        print_table(["C", "system", "steps", "period ms", "run ms", "between ms",
                     "process ms", "next batch ms", "period vs plain"],
                    clock_rows(results, systems, levels))
    mine = [s for s in systems if ours(s)]
    for c, metric in ((c, metric) for metric in ("tok_s", "steady_tok_s") for c in levels):
        m = summary[c] if metric == "tok_s" else steady[c]
        others = [v for s, v in m.items() if not ours(s)]
        for s in mine:
            line = f"concurrency {c}{' (steady)' if metric != 'tok_s' else ''}: {s}"
            if others:
                line += f" {m[s] / max(others) - 1:+.1%} vs the best of SGLang's"
            if "plain" in m:
                line += f", {m[s] / m['plain'] - 1:+.1%} vs plain"
                # the same repeat's cells lie minutes apart: a drift between repeats cancels
                paired = [a[metric] / b[metric] for a, b in zip(results[s][c],
                                                                   results["plain"][c])]
                line += (f" (per repeat {' '.join(f'{x - 1:+.1%}' for x in paired)}, "
                         f"median {statistics.median(paired) - 1:+.1%})")
            theirs = sorted((s2 for s2 in m if not ours(s2)), key=lambda s2: -m[s2])
            # paired slice by slice (`paired_slices`): against plain and the best of SGLang's
            against = [x for x in ("plain", *theirs[:1]) if x in m] if metric == "tok_s" else []
            for o in dict.fromkeys(against):
                ratios = paired_slices(results[s][c], results[o][c])
                q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
                line += (f"; slice by slice vs {o}: median "
                         f"{statistics.median(ratios) - 1:+.1%} (quartiles "
                         f"{q[0] - 1:+.1%} {q[2] - 1:+.1%}, {len(ratios)} pairs)")
            print(line)
    save(results, complete=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
