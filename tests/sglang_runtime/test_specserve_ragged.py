"""SPECSERVE's per-request verify lengths inside SGLang 0.5.23's own server on this CPU (issue
17): the plan stops drafting round by round, each request verifies its own k_r + 1 tokens
through SGLang's RaggedVerifyLayout, with the draft's real confidences and an online
calibration map.

Servers (one set per module, started as a user does, `python -m sloserve.launch --engine
sglang`): SGLang without speculation (the reference), SPECSERVE with the TEST-ONLY setting
--spec-test-verify-lens (every request drafts k_max = 4 and batch row i verifies
FORCED[(i + n) % 6] drafts in the n-th step: 0 and 4 in one batch; the session's server,
which the sampling module samples from too), and SPECSERVE with one draft length per batch
and each request's verify trimmed by its own plan (--spec-lengths trim). Both SPECSERVE
servers write their per-step decisions to a step log (--spec-step-log) that the tests read:
every step's decisions obey the invariants checked below, whichever module's requests they
were."""

from __future__ import annotations

import json

import pytest

from tests.sglang_runtime.launched import FORCED, ServerQueue, specserve_args
from tests.sglang_runtime.test_specserve_server import (
    _all_at_once,
    _gen,
    _prompts,
)

pytestmark = pytest.mark.timeout(2400)


@pytest.fixture(scope="module")
def ragged(sglang_python, tiny_sglang_pair, tiny_plain, tiny_forced, tmp_path_factory):
    target, draft = tiny_sglang_pair
    logs = tmp_path_factory.mktemp("ragged_logs")
    specs = {
        # one draft length per batch, each request's verify trimmed from the chain's
        # confidences (without the uniform-first margin, so the plan may trim)
        "trimmed": (specserve_args(target, draft) + [
            "--spec-lengths", "trim",
            # the profile's prices as they are: corrected online by this machine's timings
            # (2026-11-27) the tiny pair drafted in 8-9 steps, too few for the checks below
            "--spec-options", "uniform_margin=0,correct_cost=false",
            "--spec-step-log", str(logs / "trimmed.jsonl")], {}),
    }
    # the session's plain and forced servers (the sampling module's too), and this one
    get = ServerQueue(sglang_python, logs, specs,
                      shared={"plain": tiny_plain, "forced": tiny_forced})
    get.start("trimmed")  # beside the session's (three starts at once: same total work)
    step_logs = {"forced": tiny_forced.step_log, "trimmed": logs / "trimmed.jsonl"}
    get.step_log = lambda name: [json.loads(x) for x in  # type: ignore[attr-defined]
                                 step_logs[name].read_text().splitlines()]
    yield get
    get.close()


def test_greedy_equals_plain_with_0_and_4_verified_drafts_in_one_batch(ragged):
    plain, forced = ragged("plain"), ragged("forced")
    batch = _prompts(12, seed=71)
    want = [g["output_ids"] for g in _all_at_once(plain, batch)]
    got = _all_at_once(forced, batch)
    assert [g["output_ids"] for g in got] == want
    alone = _prompts(3, seed=72)
    assert [_gen(forced, p)["output_ids"] for p in alone] == \
        [_gen(plain, p)["output_ids"] for p in alone]
    steps = ragged.step_log("forced")
    mixed = [s for s in steps if 0 in s["verified"] and max(s["verified"]) >= 4]
    assert len(mixed) >= 10, [s["verified"] for s in steps[:20]]
    for s in steps:
        assert all(v <= d and v in FORCED for v, d in zip(s["verified"], s["drafted"]))
        assert all(a <= v for a, v in zip(s["accepted"], s["verified"]))
    assert {v for s in steps if len(s["rids"]) == 1 for v in s["verified"]} == set(FORCED)
    # per-request meta_info counts what each request verified, not k_max per step
    for g in got:
        m = g["meta_info"]
        verified = sum(m["sloserve_draft_steps"])
        assert m["spec_num_correct_drafts"] <= verified
        assert len(m["sloserve_draft_steps"]) == m["spec_verify_ct"]


def test_trimmed_steps_draft_one_length_and_stay_greedy_exact(ragged):
    """--spec-lengths trim: every request of a step drafts the batch's one length, verifies
    at most that, and the output equals plain greedy decoding, batched and alone."""
    plain, trimmed = ragged("plain"), ragged("trimmed")
    batch = _prompts(12, seed=73)
    want = [g["output_ids"] for g in _all_at_once(plain, batch)]
    assert [g["output_ids"] for g in _all_at_once(trimmed, batch)] == want
    alone = _prompts(2, seed=74)
    assert [_gen(trimmed, p)["output_ids"] for p in alone] == \
        [_gen(plain, p)["output_ids"] for p in alone]
    steps = ragged.step_log("trimmed")
    assert len(steps) >= 10  # steps that drafted were logged with their confidences
    for s in steps:
        assert len(set(s["drafted"])) == 1 and s["drafted"][0] == s["rounds"] > 0
        assert all(a <= v <= d for a, v, d in zip(s["accepted"], s["verified"],
                                                   s["drafted"]))
        assert all(len(c) == s["rounds"] for c in s["conf"])
    trims = sum(v < d for s in steps for v, d in zip(s["verified"], s["drafted"]))
    print(f"trimmed: {len(steps)} drafting steps, {trims} verify lengths trimmed")
