"""Profile SGLang's own forwards for SPECSERVE:

    python -m sloserve.profiler --engine sglang [--model-path T --draft-model-path D]
        [--levels 1,4,16] [--out DIR] [--rows-out FILE | --from-rows FILE] [SGLang's options]

Starts SGLang's server with SPECSERVE in sweep mode (every decode step cycles the draft
length through 0..k_max instead of deciding it, and logs its measured draft forwards, draft
extend and verify seconds with its batch size and context: controller.py), drives it at
several concurrency levels with random-token prompts, then fits the cost model of
docs/design.md sec. 2 to what SGLang's forwards took:

    target  T(n_ctx, n_q) from the verify forwards: n_q = B (k + 1), n_ctx = context + n_q,
            fitted on the steps that drafted (SGLang's verify path, an extend over the
            draft tree); the plain steps run the decode path (worker.py), which costs less
            by a fixed amount: `verify_fixed`, the plain steps' median shortfall from the
            fit, taken out of c (so c prices a decode forward, c + verify_fixed a verify)
    draft   from the draft forwards (k forwards of B tokens each, their mean context; the
            first also reads the rows the draft had not read, counted in), less the
            drafting step's setup paid once (`first`: fit.fit_step_cost)
    overhead  the plain steps' seconds outside the verify forward (they run no draft
            forward: draft_chain.py)
    verify_token  the price of a verified draft token at each batch size the sweep ran
            (verify_token_prices): on a CPU it is far from target's one b
    calibration  the draft's confidence -> conditional acceptance counts of the pair (every
            drafted chain's confidences against its accepted count), which the SPECSERVE
            policy's map g starts from (docs/design.md sec. 3)

and writes the profile (keyed by the pair, the device prefixed "sglang-" and the dtype) to
the user cache (default) or --out, where the SPECSERVE worker finds it (settings.py). Must run
in a python with SGLang's runtime (scripts/sglang_runtime_env.sh). Takes 3-10 minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import numpy as np

from sloserve.estimator.acceptance import ConfidenceCalibrator
from sloserve.estimator.profile_file import (
    PROFILES_DIR,
    ModelProfile,
    Profile,
    profile_filename,
    write_profile,
)
from sloserve.estimator.profile_lookup import default_dirs, fingerprint
from sloserve.profiler.fit import fit_forward_cost, fit_step_cost
from sloserve.sglang_cpu.cpu_server import wait_ready
from sloserve.sglang_ext import settings

WARMUP_REQUESTS = 2


def profiled_drafter(rest: list[str]) -> tuple[list[str], str]:
    """(the launcher's arguments, the drafter profiled): the draft model unless --drafter
    says otherwise. The launcher's default for a preset may be prompt lookup (smollm2's), but
    a profile is for pricing the draft's forwards, and the n-gram mode prices from the draft
    model's profile with the draft free (settings.load_cost); profiling prompt lookup
    under the draft model's name would price that draft as free."""
    if "--drafter" in rest:
        return rest, rest[rest.index("--drafter") + 1]
    return rest + ["--drafter", "model"], "model"


def fit_rows(rows: Sequence[dict], target_path: str, draft_path: str | None, device: str,
             dtype: str, levels: Sequence[int]) -> Profile:
    """The profile of timing rows (one per decode step, controller.py's JSON lines);
    draft_path None: the n-gram drafter's (draft key "ngram")."""
    target: list[tuple[float, float, float]] = []  # verify forwards of drafting steps
    plain: list[tuple[float, float, float]] = []  # decode forwards of plain steps
    batches: list[int] = []  # target's rows' decode batch sizes
    draft: list[tuple[float, float, float, float]] = []  # drafting steps
    plain_rest, rest = [], []
    for r in rows:
        if r.get("cold"):  # a shape's first step: one-time costs (VerifyOutcome.cold)
            continue
        B, k, ctx = r["batch"], r["k"], r["context"]
        q = B * (k + 1)
        (target if k else plain).append((ctx + q, q, r["verify"]))
        if k:  # (the draft reads no verified window: draft_chain.py; "extend" ~ 0)
            batches.append(B)
            # k forwards of B rows each, the first with the catch-up's rows besides
            # (draft_chain.py): one mean forward
            rows_read = B + r.get("catch_up_rows", 0) / k
            draft.append((k, ctx + B * (k + 1) / 2.0, rows_read, r["draft"]))
            rest.append(r["step"] - r["draft"] - r["extend"] - r["verify"])
        else:
            plain_rest.append(r["step"] - r["verify"])
    # the draft's per-step setup (first) fitted with its forwards: spread over them, a step
    # of one round was priced low, and every later round half again too high once the
    # online correction had matched the one-round steps (smollm2 pair, 2-core EPYC,
    # 2026-12-05: ~3 ms of setup, the draft's metadata and first round's extend, on 6-8 ms
    # forwards)
    t_fit, d_fit = fit_forward_cost(target or plain), fit_step_cost(draft)
    t_cost, verify_fixed = t_fit.cost, 0.0
    if target and plain:
        verify_fixed = max(0.0, -statistics.median(
            y - t_cost.time(n_ctx, n_q) for n_ctx, n_q, y in plain))
        verify_fixed = min(verify_fixed, t_cost.c)
        t_cost = replace(t_cost, c=t_cost.c - verify_fixed)
    calibration = calibration_counts(rows)
    overhead = statistics.median(plain_rest or rest)
    verify_token = verify_token_prices(target, batches, t_cost.a)
    return Profile(
        target=ModelProfile(target_path, fingerprint(target_path), t_cost, t_fit.stats),
        draft=ModelProfile(draft_path, fingerprint(draft_path), d_fit.cost, d_fit.stats)
        if draft_path is not None else ModelProfile("ngram", "", d_fit.cost, d_fit.stats),
        device=settings.sglang_device_key(device, draft_path is not None), dtype=dtype,
        overhead=max(0.0, overhead),
        verify_fixed=verify_fixed,
        grid={"concurrency": list(levels), "steps": [len(rows)]}, mode="sglang-sweep",
        calibration=calibration, verify_token=verify_token,
    )


MIN_BATCH_ROWS = 24  # verify forwards of one batch size that give its token price


def verify_token_prices(target: Sequence[tuple[float, float, float]], batches: Sequence[int],
                        a: float) -> tuple[tuple[float, float], ...]:
    """CostModel.verify_token from the verify forwards: target [(n_ctx, n_q, seconds)] and
    each one's decode batch size B. For every B with MIN_BATCH_ROWS forwards over at least
    four draft lengths (the sweep's levels; the batches passed through between them are too
    few and far apart), the Theil-Sen slope (the median of the pairwise slopes: a GC pause
    or a preempted forward moves it little) of the seconds, less the context's a * n_ctx,
    against the verified draft tokens n_q - B. Measured on the 2-core Xeon (2026-12-02):
    4.9 ms a token at batch 1, 2.5 at 2, 1.8-2.3 at 4-16 (one fitted b: 2.2)."""
    by_batch: dict[int, list[tuple[float, float]]] = {}
    for (n_ctx, n_q, y), B in zip(target, batches):
        by_batch.setdefault(B, []).append((n_q - B, y - a * n_ctx))
    table = []
    for B in sorted(by_batch):
        pts = np.asarray(by_batch[B])  # [N, 2] verified tokens, seconds
        if len(pts) < MIN_BATCH_ROWS or np.unique(pts[:, 0]).size < 4:
            continue
        i, j = np.triu_indices(len(pts), 1)
        dn = pts[j, 0] - pts[i, 0]
        ok = dn != 0.0
        slope = float(np.median((pts[j, 1] - pts[i, 1])[ok] / dn[ok]))
        table.append((float(B), max(0.0, slope)))
    return tuple(table)


def calibration_counts(rows: Sequence[dict]) -> tuple[tuple[float, ...], ...] | None:
    """[2, n_bins] rejected / accepted counts per draft-confidence bin from the rows that
    carry their chain's confidences (every request verified all k drafts of a sweep step),
    None if none does."""
    calib = ConfidenceCalibrator(prior_weight=0.0)
    for r in rows:
        conf = r.get("conf")
        if not conf or r["k"] == 0:
            continue
        c = np.array(conf, dtype=np.float64)  # [B, k]; null (not finite) -> NaN
        calib.update(c, np.full(len(c), r["k"]), np.asarray(r["accepted_per_request"]))
    if not calib.counts.sum():
        return None
    return tuple(tuple(round(float(x), 3) for x in row) for row in calib.counts)


def _post(url: str, body: dict, timeout: float = 1800.0) -> dict:
    req = urllib.request.Request(url + "/generate", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def drive(url: str, levels: Sequence[int], new_tokens: int, max_prompt: int,
          vocab: int, rounds: int, seed: int = 0) -> None:
    """Requests at each concurrency level: `rounds` waves of as many at once as the level."""
    rng = random.Random(seed)

    def one(_: int) -> None:
        ids = [rng.randrange(10, vocab) for _ in range(rng.randint(16, max_prompt))]
        _post(url, {"input_ids": ids, "sampling_params": {
            "max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}})

    for n in range(WARMUP_REQUESTS):
        one(n)
    for level in levels:
        t0 = time.monotonic()
        with ThreadPoolExecutor(level) as pool:
            list(pool.map(one, range(rounds * level)))
        print(f"  concurrency {level}: {time.monotonic() - t0:.1f} s", flush=True)


def main(argv: Sequence[str]) -> int:
    from sloserve.cli.sglang_launch import sglang_args, sglang_runtime_available

    p = argparse.ArgumentParser(prog="python -m sloserve.profiler --engine sglang",
                                allow_abbrev=False, description=__doc__.split("\n")[0])
    p.add_argument("--levels", default="1,2,4,8,16", help="concurrency levels")
    p.add_argument("--new-tokens", type=int, default=40)
    p.add_argument("--max-prompt", type=int, default=512)
    p.add_argument("--rounds", type=int, default=3, help="request waves per level")
    p.add_argument("--rows-out", type=Path, default=None, help="also write the raw step rows")
    p.add_argument("--from-rows", type=Path, default=None,
                   help="fit the step rows a sweep wrote (--rows-out) instead of running one: "
                        "the same models, options and machine as that sweep")
    p.add_argument("--out", type=Path, default=None,
                   help="directory for the profile file (default: the user cache's "
                        "profiles/, where the SPECSERVE worker looks after configs/profiles/)")
    args, rest = p.parse_known_args(list(argv))
    if not sglang_runtime_available():
        print("error: needs SGLang's runtime in this python (scripts/sglang_runtime_env.sh)",
              file=sys.stderr)
        return 2
    levels = [int(x) for x in args.levels.split(",")]
    rest, drafter = profiled_drafter(rest)
    if "--dtype" not in rest:
        rest += ["--dtype", "float32"]
    if "--port" not in rest:
        rest += ["--port", "31999"]
    cmd, env = sglang_args(rest)
    k_max = int(cmd[cmd.index("--speculative-num-steps") + 1])
    target = cmd[cmd.index("--model-path") + 1]
    draft = cmd[cmd.index("--speculative-draft-model-path") + 1]
    url = f"http://127.0.0.1:{cmd[cmd.index('--port') + 1]}"
    dtype = rest[rest.index("--dtype") + 1]
    if args.from_rows is not None:
        return write_fit(_read_rows(args.from_rows, "--from-rows"), target, draft, drafter,
                         cmd, dtype, levels, args.out)
    with tempfile.TemporaryDirectory() as tmp:
        timings = Path(tmp) / "timings.jsonl"
        cmd, env = sglang_args(rest + [
            "--spec-sweep", ",".join(str(k) for k in range(k_max + 1)),
            "--spec-timings", str(timings)])
        print(f"profiling SGLang's forwards of {target} / {draft} (draft lengths 0..{k_max},"
              f" concurrency {levels}); this takes 3-10 minutes", flush=True)
        log = open(Path(tmp) / "server.log", "wb")  # noqa: SIM115
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            wait_ready(url, proc, 900)
            with open(Path(target) / "config.json") as f:
                vocab = json.load(f)["vocab_size"]
            drive(url, levels, args.new_tokens, args.max_prompt, vocab, args.rounds)
        except Exception:
            log.flush()
            print((Path(tmp) / "server.log").read_text(errors="replace")[-5000:],
                  file=sys.stderr)
            raise
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(60)
        rows = [json.loads(line) for line in timings.read_text().splitlines()]
    rows = rows[WARMUP_REQUESTS * args.new_tokens:]  # past the warm-up (compiles, caches)
    if args.rows_out:
        args.rows_out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return write_fit(rows, target, draft, drafter, cmd, dtype, levels, args.out)


def _read_rows(path: Path, option: str) -> list[dict]:
    try:
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, ValueError) as e:
        raise SystemExit(f"error: {option}: cannot read step rows from {path}: {e}") from e
    if not rows or not all(isinstance(r, dict) and "batch" in r and "k" in r for r in rows):
        raise SystemExit(f"error: {option}: {path} holds no sweep step rows")
    return rows


def write_fit(rows: list[dict], target: str, draft: str, drafter: str, cmd: list[str],
              dtype: str, levels: Sequence[int], out: Path | None) -> int:
    """Fit the sweep's step rows, write the profile and print what it found."""
    device = "cuda" if "--device" not in cmd else cmd[cmd.index("--device") + 1]
    # the n-gram drafter's profile goes under its own key ("ngram"), never the draft model's
    profile = fit_rows(rows, target, None if drafter == "ngram" else draft, device, dtype,
                       levels)
    out_dir = out or default_dirs()[-1] / PROFILES_DIR  # the user cache's profiles/
    path = write_profile(profile, out_dir / profile_filename(
        profile.target.key, profile.draft.key, profile.device, dtype))
    t, d = profile.target, profile.draft
    print(f"target: a={t.cost.a:.3g} b={t.cost.b:.3g} c={t.cost.c:.3g} q0={t.cost.q0:g} "
          f"(R^2 {t.fit.r2:.3f}, MAPE {t.fit.mape:.1%})" if t.fit else "")
    print(f"draft:  a={d.cost.a:.3g} b={d.cost.b:.3g} c={d.cost.c:.3g} q0={d.cost.q0:g} "
          f"first={d.cost.first:.3g} "
          f"(R^2 {d.fit.r2:.3f}, MAPE {d.fit.mape:.1%})" if d.fit else "")
    if profile.calibration is not None:
        rejected, accepted = (np.asarray(x) for x in profile.calibration)
        print(f"calibration: {int(rejected.sum() + accepted.sum())} draft positions, "
              f"acceptance {accepted.sum() / (rejected.sum() + accepted.sum()):.2f}")
    print(f"overhead {profile.overhead * 1e3:.2f} ms; {len(rows)} steps; wrote {path}")
    return 0
