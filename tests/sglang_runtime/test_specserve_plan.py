"""SPECSERVE's own decisions inside SGLang 0.5.23's server on this CPU (issue 17, the
per-request outputs): no forced lengths, the controller plans every step from the draft's
real confidences (--spec-lengths per-request).

One SPECSERVE server on the built-in pair (where a verified token costs enough for per-request
lengths to pay; with the tiny pair's nearly free tokens the plan stays uniform) with its
committed profile of SGLang's forwards, the policy option uniform_margin=0 (by default a
strict subset drafts or a tail is trimmed only if that raises E by 6%: measured on this
CPU, 4 in 34 steps of 12 requests were ragged with it and none trimmed, 35 in 35 and 23
without it), `--enable-metrics`
and a step log (--spec-step-log: per step the rids, drafted / verified / accepted
counts, the draft confidences, the plan's chain probabilities P and the calibration map g).
The tests read the log against what they can compute themselves:

- the confidences are the draft model's probabilities of its proposals (recomputed in
  transformers from the generated text);
- verify lengths differ within one batch, every request verifies a prefix of its draft, and
  what the verifier trims has the lowest chain probabilities;
- the calibration map converges: after the run it predicts the acceptance observed in the
  run's second half far better than the identity (g's prior) and better than the map the
  server started from (seeded from the profile's calibration, measured by the profiler on
  other prompts, all greedy);
- meta_info's per-request spec fields and the Prometheus counters agree with the log.
"""

from __future__ import annotations

import json
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

from sloserve.estimator.acceptance import ConfidenceCalibrator
from sloserve.estimator.profile_file import model_key
from sloserve.estimator.profile_lookup import fingerprint
from tests.sglang_runtime.launched import REPO, LaunchedServer
from tests.sglang_runtime.test_specserve_server import _gen, _prompts

pytestmark = pytest.mark.timeout(2400)

K_MAX = 4
COLLAPSE = 0.05  # policies/specserve/options.py: a chain below it leaves the draft batch


def builtin_sglang_profile(target: str, draft: str) -> Path:
    """The committed profile of SGLang's forwards of the built-in pair (configs/profiles; its
    costs corrected online on another CPU, its calibration a property of the pair)."""
    keys = [model_key(p, fingerprint(p)) for p in (target, draft)]
    found = sorted(REPO.glob(f"configs/profiles/{keys[0]}__{keys[1]}__sglang-*.json"))
    assert found, f"no SGLang profile of the built-in pair in configs/profiles ({keys})"
    return found[0]


LEARN_AT_LEAST = 600  # online calibration samples the workload gathers (the seed has 400)


def _seed_counts(pair: tuple[str, str]) -> float:
    """Samples the calibration map starts from (the profile's calibration as seeded)."""
    counts = np.array(json.loads(builtin_sglang_profile(*pair).read_text())["calibration"])
    seeded = ConfidenceCalibrator(n_bins=counts.shape[1])  # counts: [2, n_bins]
    seeded.seed(counts)
    return float(seeded.counts.sum())


def _learned(step_log: Path, seed_counts: float) -> float:
    """Calibration samples learned online so far (the last logged step's counts)."""
    lines = step_log.read_text().splitlines() if step_log.exists() else []
    if not lines:
        return 0.0
    return float(np.sum(json.loads(lines[-1])["g_counts"])) - seed_counts


@pytest.fixture(scope="module")
def builtin_pair() -> tuple[str, str]:
    from sloserve.runtime.models.builtin import ensure_builtin_pair

    target, draft = ensure_builtin_pair()
    return str(target), str(draft)


@pytest.fixture(scope="module")
def planned(sglang_python, builtin_pair, tmp_path_factory):
    """(server, step log reader, the outputs of the module's workload)."""
    target, draft = builtin_pair
    logs = tmp_path_factory.mktemp("plan_logs")
    step_log = logs / "steps.jsonl"
    server = LaunchedServer(
        sglang_python,
        ["--model-path", target, "--draft-model-path", draft, "--k-max", str(K_MAX),
         "--enable-metrics", "--spec-policy", "specserve",
         "--spec-profile", str(builtin_sglang_profile(target, draft)),
         "--spec-step-log", str(step_log), "--spec-lengths", "per-request",
         # the plan's per-request choices as they are, without the uniform-first margin
         # (with it, ragged steps are rare here: see the module docstring)
         "--spec-options", "uniform_margin=0"],
        # the draft in float32 (not bf16 where the CPU has it): confidences are compared
        # with the float32 draft model's probabilities below
        logs / "server.log", {"SLOSERVE_CPU_DRAFT_DTYPE": "float32"})
    try:
        server.wait()
        outs: list[tuple[list[int], dict]] = []
        # batches of 12 (greedy and sampled mixed: different confidences within a batch),
        # then requests alone (their drafts can be recomputed position by position). At
        # least 4 batches, more (up to 12) until the calibration map has learned
        # LEARN_AT_LEAST samples online: how many positions are verified depends on the
        # step costs this CPU measures and the requests' acceptance (4 batches gave ~1100 on
        # an Intel Xeon), and test_calibration_converges needs the online ones to outweigh
        # the seed's. (A CI run once learned 323: speculation had stopped for good at batch
        # 12, the bug policy.py's fresh-request rule mends; more batches cannot hide that.)
        seed_counts = _seed_counts(builtin_pair)
        for i in range(12):
            if i >= 4 and _learned(step_log, seed_counts) >= LEARN_AT_LEAST:
                break
            prompts = _prompts(12, seed=300 + i)
            temps = [0.0 if j % 3 else 1.0 for j in range(12)]
            with ThreadPoolExecutor(12) as pool:
                got = list(pool.map(lambda pt: _gen(server, pt[0], temperature=pt[1]),
                                    zip(prompts, temps)))
            outs += list(zip(prompts, got))
        for p in _prompts(4, seed=310):
            outs.append((p, _gen(server, p)))
        steps = [json.loads(x) for x in step_log.read_text().splitlines()]
        yield server, steps, outs
    finally:
        server.stop(wait=False)


def test_confidences_are_the_draft_models_probabilities(planned, builtin_pair):
    """For greedy requests decoded alone, position j of a step drafts from the committed
    text plus the accepted drafts before it, so its confidence (the draft's softmax
    probability of its argmax) can be recomputed for every position up to the first
    rejection."""
    from transformers import AutoModelForCausalLM

    _, steps, outs = planned
    draft = AutoModelForCausalLM.from_pretrained(builtin_pair[1], dtype=torch.float32).eval()
    pairs = []
    for prompt, out in outs[-4:]:
        rid, ids = out["meta_info"]["id"], out["output_ids"]
        seq = prompt + ids
        with torch.no_grad():
            probs = torch.softmax(draft(torch.tensor([seq])).logits[0].float(), -1)  # [L, V]
        top = probs.max(dim=-1).values
        done = 1  # tokens committed before the step (the prefill's first)
        for s in steps:
            if rid not in s["rids"]:
                continue
            r = s["rids"].index(rid)
            for j in range(min(s["accepted"][r] + 1, s["drafted"][r])):
                row = len(prompt) + done + j - 1  # the row predicting position j + 1
                if row + 1 < len(seq):
                    pairs.append((s["conf"][r][j], float(top[row])))
            done += s["accepted"][r] + 1
    got, want = np.array(pairs).T
    assert len(pairs) >= 40 and np.ptp(want) > 0.2  # many positions, not a constant
    np.testing.assert_allclose(got, want, atol=1e-4)


def test_verify_lengths_differ_and_what_is_cut_is_the_least_likely(planned):
    """Requests verify different lengths within one batch, each a prefix of its draft. Chain
    probabilities fall along a row and a row whose chain fell below COLLAPSE drafts no
    further. When the verifier trims (elimination.py: on the built-in pair a verified token
    costs ~3% of a target forward), every trimmed token is at most as likely as every
    kept one in its batch: the lowest-chain-probability tails go."""
    _, steps, _ = planned
    ragged, trims = check_step_log(steps, K_MAX)
    assert ragged >= 5 and trims >= 3, [(s["drafted"], s["verified"]) for s in steps[-10:]]


def _calibration_samples(steps: list[dict]) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """Per step with drafts: (step index, confidences, outcomes) of the positions that say
    something about the conditional acceptance (accepted ones and the first rejection)."""
    out = []
    for i, s in enumerate(steps):
        c, o = [], []
        for row, v, a in zip(s["conf"], s["verified"], s["accepted"]):
            for j in range(min(a + 1, v)):
                c.append(row[j])
                o.append(1.0 if j < a else 0.0)
        if c:
            out.append((i, np.array(c), np.array(o)))
    return out


def test_calibration_converges(planned, builtin_pair):
    """The map g predicts each verified position's acceptance from its confidence. Binned
    over confidence, its error against what the run's second half observed: the identity
    (g's prior without a profile) is far off for this draft; the map the
    server started from (the profile's calibration, from the profiler's greedy random-token
    prompts) is closer; the map learned by the end of the run closer still
    (its online samples outweigh the seed's 400 by the end)."""
    _, steps, _ = planned
    n_bins = len(steps[-1]["g"])
    centres = (np.arange(n_bins) + 0.5) / n_bins
    samples = _calibration_samples(steps)
    assert sum(len(c) for _, c, _ in samples) >= 300

    def error(g: np.ndarray, part: list) -> float:
        """Sample-weighted |g - observed rate| over confidence bins."""
        conf = np.concatenate([c for _, c, _ in part])
        hit = np.concatenate([o for _, _, o in part])
        b = np.minimum((conf * n_bins).astype(int), n_bins - 1)
        n = np.bincount(b, minlength=n_bins)
        rate = np.bincount(b, weights=hit, minlength=n_bins) / np.maximum(n, 1)
        return float((n * np.abs(g - rate)).sum() / n.sum())

    seeded = ConfidenceCalibrator(n_bins=n_bins)
    profile = builtin_sglang_profile(*builtin_pair)
    seeded.seed(np.array(json.loads(profile.read_text())["calibration"]))
    np.testing.assert_allclose(steps[0]["g"], seeded.table, atol=1e-6)  # started from it
    later = samples[len(samples) // 2:]
    e_identity, e_seed = error(centres, later), error(seeded.table, later)
    e_end = error(np.array(steps[-1]["g"]), later)
    learned = np.array(steps[-1]["g_counts"]).sum() - seeded.counts.sum()
    print(f"calibration error: identity {e_identity:.3f}, seed {e_seed:.3f}, "
          f"end {e_end:.3f}; {learned:.0f} samples learned online")
    # (the empirical rates carry sampling noise of their own: the error does not reach 0)
    assert learned > 400
    # (measured: identity 0.42, seed 0.14, end 0.06: the run's sampled requests are
    # calibrated unlike the profiler's greedy ones, and g learned them)
    assert e_end < 0.3 * e_identity and e_end < 0.75 * e_seed, (e_identity, e_seed, e_end)


def test_meta_info_and_prometheus_count_the_per_request_lengths(planned):
    server, steps, outs = planned
    verified_by_rid: dict[str, list[int]] = {}
    accepted_by_rid: dict[str, int] = {}
    for s in steps:
        for rid, v, a in zip(s["rids"], s["verified"], s["accepted"]):
            verified_by_rid.setdefault(rid, []).append(v)
            accepted_by_rid[rid] = accepted_by_rid.get(rid, 0) + a
    for _, out in outs:
        m = out["meta_info"]
        steps_r = m["sloserve_draft_steps"]
        assert steps_r == verified_by_rid[m["id"]]  # one entry per decode step, k_r each
        assert m["spec_verify_ct"] == len(steps_r)
        assert m["spec_num_correct_drafts"] == accepted_by_rid[m["id"]]
        assert m["spec_num_proposed_drafts"] == sum(steps_r)
        assert m["spec_accept_rate"] == pytest.approx(
            m["spec_num_correct_drafts"] / sum(steps_r) if sum(steps_r) else 0.0)
        assert m["spec_accept_length"] == pytest.approx(
            m["completion_tokens"] / m["spec_verify_ct"])
    with urllib.request.urlopen(server.url + "/metrics", timeout=60) as r:
        text = r.read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("sloserve_spec_") and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = values.get(name, 0.0) + float(value)
    drafted = sum(sum(s["drafted"]) for s in steps)
    verified = sum(sum(s["verified"]) for s in steps)
    accepted = sum(sum(s["accepted"]) for s in steps)
    assert values["sloserve_spec_proposed_tokens_total"] == drafted
    assert values["sloserve_spec_verified_tokens_total"] == verified
    assert values["sloserve_spec_accepted_tokens_total"] == accepted
    for j in range(1, K_MAX + 1):
        want = sum(v >= j for s in steps for v in s["verified"])
        assert values[f'sloserve_spec_verified_at_position_total{{position="{j}"}}'] == want
    assert values['sloserve_spec_draft_length_total{k="0"}'] == \
        sum(v == 0 for s in steps for v in s["verified"])


def check_step_log(steps: list[dict], k_max: int) -> tuple[int, int]:
    """Checks every per-request step of a step log (lengths within what was drafted, chain
    probabilities falling along a row, no row drafting on below COLLAPSE where the plan
    steered the rounds (a looked-up chain comes whole: the n-gram drafter), trimmed tokens
    at most as likely as every kept one of their step); returns (steps with ragged verify
    lengths, steps the verifier trimmed)."""
    ragged = trims = 0
    for s in steps:
        drafted, verified = np.array(s["drafted"]), np.array(s["verified"])
        assert np.all(verified <= drafted) and np.all(np.array(s["accepted"]) <= verified)
        assert drafted.max(initial=0) <= s["rounds"] <= k_max
        ragged += len(set(verified.tolist())) > 1
        P = [np.array(row[:d], dtype=float) for row, d in zip(s["chain"], drafted)]
        for p in P:
            assert np.all(np.diff(p) <= 1e-9)  # chain probabilities fall along a row
            if not s.get("looked_up"):  # a row below COLLAPSE drafts no further
                assert np.all(p[:-1] >= COLLAPSE)
        if (verified < drafted).any():  # the verifier trimmed
            trims += 1
            kept = np.concatenate([p[:v] for p, v in zip(P, verified)])
            trimmed = np.concatenate([p[v:] for p, v in zip(P, verified)])
            assert kept.size == 0 or trimmed.max() <= kept.min() + 1e-6, s
    return ragged, trims
