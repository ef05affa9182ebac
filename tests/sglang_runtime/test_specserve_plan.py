"""SPECSERVE's own decisions inside SGLang 0.5.23's server on this CPU (issue 17, acceptance 3
and the per-request outputs): no forced lengths, the controller plans every step from the
draft's real confidences.

One SPECSERVE server on the tiny pair with its measured cost profile, `--enable-metrics`
and a step log (SLOSERVE_SGLANG_STEP_LOG: per step the rids, drafted / verified / accepted
counts, the draft confidences, the plan's chain probabilities P and the calibration map g).
The tests read the log against what they can compute themselves:

- the confidences are the draft model's probabilities of its proposals (recomputed in
  transformers from the generated text);
- verify lengths differ within one batch, every request verifies a prefix of its draft, and
  what is cut has the lowest chain probabilities (the drafter's collapse rule, the
  verifier's elimination when it trims);
- the calibration map converges: its error against the acceptance observed afterwards
  shrinks from the identity prior;
- meta_info's per-request spec fields and the Prometheus counters agree with the log.
"""

from __future__ import annotations

import json
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from tests.sglang_runtime.test_specserve_server import (
    TINY_PROFILE,
    LaunchedServer,
    _gen,
    _prompts,
)

pytestmark = pytest.mark.timeout(2400)

K_MAX = 4
COLLAPSE = 0.05  # policies/specserve/options.py: a chain below it leaves the draft batch


@pytest.fixture(scope="module")
def planned(sglang_python, tiny_sglang_pair, tmp_path_factory):
    """(server, step log reader, the outputs of the module's workload)."""
    target, draft = tiny_sglang_pair
    logs = tmp_path_factory.mktemp("plan_logs")
    step_log = logs / "steps.jsonl"
    server = LaunchedServer(
        sglang_python,
        ["--model-path", target, "--draft-model-path", draft, "--k-max", str(K_MAX),
         "--enable-metrics"],
        logs / "server.log",
        {"SLOSERVE_PROFILE": str(TINY_PROFILE), "SLOSERVE_SGLANG_STEP_LOG": str(step_log)})
    try:
        server.wait()
        outs: list[tuple[list[int], dict]] = []
        # batches of 12 (greedy and sampled mixed: different confidences within a batch),
        # then requests alone (their drafts can be recomputed position by position)
        for i in range(4):
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
        server.stop()


def test_confidences_are_the_draft_models_probabilities(planned, tiny_sglang_pair):
    """For greedy requests decoded alone, position j of a step drafts from the committed
    text plus the accepted drafts before it, so its confidence (the draft's softmax
    probability of its argmax) can be recomputed for every position up to the first
    rejection."""
    from transformers import AutoModelForCausalLM

    _, steps, outs = planned
    draft = AutoModelForCausalLM.from_pretrained(tiny_sglang_pair[1], dtype=torch.float32).eval()
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
    """Requests verify different lengths within one batch, each a prefix of its draft. What
    a request does not verify of the rounds its batch drafted (SGLang's batch forward drafts
    every row) is cut by chain probability: it left the draft batch once its P fell below
    COLLAPSE while every row that drafted on was above it; and when the verifier trims
    (elimination.py), every trimmed token is at most as likely as every kept one. (On this
    CPU a verified token costs ~1% of a step, so the verifier keeps the uniform plan and
    the cuts come from the drafter: the step log shows which.)"""
    _, steps, _ = planned
    ragged = cut = 0
    for s in steps:
        drafted, verified = np.array(s["drafted"]), np.array(s["verified"])
        assert np.all(verified <= drafted) and np.all(np.array(s["accepted"]) <= verified)
        ragged += len(set(verified.tolist())) > 1
        rounds = s["rounds"]
        P = [np.array(row[:d], dtype=float) for row, d in zip(s["chain"], drafted)]
        for p, d in zip(P, drafted):
            assert np.all(np.diff(p) <= 1e-9)  # chain probabilities fall along a row
            assert np.all(p[:-1] >= COLLAPSE)  # a row below COLLAPSE drafts no further
            if 0 < d < rounds:
                assert p[-1] < COLLAPSE, s  # cut early: its chain had collapsed
                cut += 1
        if (verified < drafted).any():  # the verifier trimmed
            kept = np.concatenate([p[:v] for p, v in zip(P, verified)])
            trimmed = np.concatenate([p[v:] for p, v in zip(P, verified)])
            assert kept.size == 0 or trimmed.max() <= kept.min() + 1e-6, s
    assert ragged >= 3 and cut >= 3, [(s["drafted"], s["verified"]) for s in steps[-10:]]


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


def test_calibration_converges(planned):
    """The map g in force at each step (the previous step's logged g; the identity before
    any) predicts each verified position's acceptance; binned over confidence, its error
    against what the following steps observed falls from the prior's to a small one."""
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
        pred = np.interp(centres, centres, g)
        return float((n * np.abs(pred - rate)).sum() / n.sum())

    half = len(samples) // 2
    later = samples[half:]  # judged on the outcomes of the second half of the run
    g_prior = centres  # g starts as the identity
    g_mid = np.array(steps[samples[half][0] - 1]["g"])  # learned from the first half
    g_end = np.array(steps[-1]["g"])
    e_prior, e_mid, e_end = error(g_prior, later), error(g_mid, later), error(g_end, later)
    # (the empirical rates carry sampling noise of their own: the error does not reach 0)
    assert e_mid < 0.5 * e_prior and e_end < 0.4 * e_prior and e_end <= e_mid + 0.02, \
        (e_prior, e_mid, e_end)


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
