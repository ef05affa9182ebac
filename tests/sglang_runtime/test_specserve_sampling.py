"""Sampling through SPECSERVE inside SGLang 0.5.23's own server keeps the target's
distribution (issue 17, A2): a chi-square homogeneity test between the first generated
tokens of SGLang without speculation and of SPECSERVE (per-request verify lengths, sampled
drafts, chain_sampling.py's acceptance rule), on the tiny pair with top-k 6 so every
position has at most six outcomes. Both SPECSERVE servers run the TEST-ONLY forced lengths
(every request drafts 4, rows verify 0, 4, 1, 3, 2, 4 drafts in rotation: mixed lengths in
every batch; the per-request server is the session's, which test_specserve_ragged checks
greedy), so the rule is exercised on every step; the natural plan speculates little on
this pair at temperature 1. The default uniform mode (one k per batch) samples by the same
rule; its server cycles k through 0..4 (the profiler's sweep). The same test fails for a deliberately wrong rule (every
draft accepted: --spec-test-accept-all, test only), so it has the power to see a
broken rule. SGLang's own EAGLE verify would not pass: it commits the argmax on CPUs."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from scipy.stats import chi2_contingency

from tests.sglang_runtime.launched import (
    FORCED,
    ServerQueue,
    forced_args,
    post,
    specserve_args,
)

pytestmark = pytest.mark.timeout(2400)

PROMPT = [101, 202, 303, 404, 505, 606, 707, 808]
# for prompt lookup (--drafter ngram): 1,800 distinct tokens of the 2,048, so that almost
# every sampled token occurs in the prompt and the lookup proposes its follower there
PROMPT_NGRAM = [int(x) for x in np.random.default_rng(0).permutation(np.arange(4, 2048))[:1800]]
SAMPLING = {"temperature": 1.0, "top_k": 6, "max_new_tokens": 4, "ignore_eos": True}
N = 1200  # samples per server, the wrong rule's too (with 400, CI's run of 93492f4 gave
# p = 0.0027 > ALPHA for it: a negative control without the power to fail)
BATCH = 6  # requests per /generate call (SGLang batches them; larger batches speculate less)
ALPHA = 1e-3


@pytest.fixture(scope="module")
def sampling_servers(sglang_python, tiny_sglang_pair, tiny_plain, tiny_forced,
                     tmp_path_factory):
    target, draft = tiny_sglang_pair
    logs = tmp_path_factory.mktemp("sampling_logs")
    forced = forced_args(target, draft)  # the session's "specserve" server's arguments
    specs = {  # in the order the tests below use them
        # the default mode (one k per batch), its k forced in rotation by the profiler's sweep
        "uniform": (specserve_args(target, draft) + [
            "--spec-lengths", "uniform", "--spec-sweep", ",".join(map(str, FORCED))], {}),
        "wrong": (forced + ["--spec-test-accept-all"], {}),
        # prompt lookup's deterministic proposals (q one-hot), mixed lengths likewise
        "ngram": (forced + ["--drafter", "ngram"], {}),
    }
    queue = ServerQueue(sglang_python, logs, specs,
                        shared={"plain": tiny_plain, "specserve": tiny_forced})
    queue.start("uniform")  # while the session's servers are sampled
    samples: dict[str, Counter] = {}

    def sample(name: str, prompt: list[int] = PROMPT) -> Counter:
        """Counts of the generated (t1, .., t4) over N requests for `prompt` (the next
        server starts meanwhile)."""
        key = name if prompt is PROMPT else f"{name}@ngram-prompt"
        if key in samples:
            return samples[key]
        server = queue(name)  # "plain": the session's, kept for the modules after this
        counts: Counter = Counter()
        steps = []
        for _ in range(N // BATCH):
            out = post(server.url, "/generate", {"input_ids": [prompt] * BATCH,
                                                 "sampling_params": SAMPLING})
            for o in out:
                counts[tuple(o["output_ids"])] += 1
                steps += o["meta_info"].get("sloserve_draft_steps", [])
        samples[key] = counts
        samples[key + ":steps"] = Counter(steps)
        return counts

    yield sample
    queue.close()


def _p_value(a: Counter, b: Counter) -> float:
    """Chi-square homogeneity of two samples over the union of outcomes, outcomes with
    fewer than 10 observations in both together merged into one cell."""
    keys = sorted(set(a) | set(b))
    big = [k for k in keys if a[k] + b[k] >= 10]
    rest = [k for k in keys if a[k] + b[k] < 10]
    table = [[a[k] for k in big] + [sum(a[k] for k in rest)],
             [b[k] for k in big] + [sum(b[k] for k in rest)]]
    if table[0][-1] + table[1][-1] == 0:
        table = [row[:-1] for row in table]
    return float(chi2_contingency(table)[1])


@pytest.mark.parametrize("rule, keeps_distribution",
                         [("specserve", True), ("uniform", True), ("wrong", False)])
def test_sampling_keeps_the_target_distribution(sampling_servers, rule, keeps_distribution):
    plain = sampling_servers("plain")
    got = sampling_servers(rule)
    steps = sampling_servers(rule + ":steps")
    assert sum(k * c for k, c in steps.items()) > sum(got.values())  # drafts verified, mixed
    assert steps[0] > 0 and steps[4] > 0
    p = _p_value(plain, got)
    print(f"{rule}: chi-square p = {p:.3g} ({sum(got.values())} samples)")
    assert (p > ALPHA) == keeps_distribution, (rule, p, plain.most_common(5), got.most_common(5))


def test_sampling_with_prompt_lookup_keeps_the_target_distribution(sampling_servers):
    """SPECSERVE's n-gram drafter (draft_chain.NgramDraft): proposals without a draft
    distribution, accepted by the same rule with q one-hot on them."""
    plain = sampling_servers("plain", PROMPT_NGRAM)
    got = sampling_servers("ngram", PROMPT_NGRAM)
    steps = sampling_servers("ngram@ngram-prompt:steps")
    assert sum(k * c for k, c in steps.items()) > N  # proposals verified, in mixed lengths
    assert steps[0] > 0 and steps[4] > 0
    p = _p_value(plain, got)
    assert p > ALPHA, (p, plain.most_common(5), got.most_common(5))
