"""SPECSERVE's own decisions inside SGLang 0.5.23's server on this CPU (issue 17, the
per-request outputs): no forced lengths, the controller plans every step from the draft's
real confidences (SLOSERVE_SGLANG_LENGTHS=per-request).

One SPECSERVE server on the tiny pair with its measured cost profile, `--enable-metrics`
and a step log (SLOSERVE_SGLANG_STEP_LOG: per step the rids, drafted / verified / accepted
counts, the draft confidences, the plan's chain probabilities P and the calibration map g).
The tests read the log against what they can compute themselves:

- the confidences are the draft model's probabilities of its proposals (recomputed in
  transformers from the generated text);
- meta_info's per-request spec fields and the Prometheus counters agree with the log.

Not here (issue 17, acceptance 3, open): that verify lengths differ within a batch, that
what is cut has the lowest chain probabilities, and that the calibration converges. On this
machine the per-request plan drafts in about one step in ten alone and never in batches of
4-12 with the tiny pair (its draft is under-confident: confidences 0.2-0.5 are accepted
three times in four, while g starts as the identity and learns only from drafted steps), so
a live test of them has too few ragged steps to judge.
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
        {"SLOSERVE_PROFILE": str(TINY_PROFILE), "SLOSERVE_SGLANG_STEP_LOG": str(step_log),
         "SLOSERVE_SGLANG_LENGTHS": "per-request"})
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
