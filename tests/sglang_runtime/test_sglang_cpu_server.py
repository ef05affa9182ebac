"""SGLang 0.5.23's own server on this CPU with sloserve's plugin and sgl_kernel stand-in: the
intel_amx backend on the stand-in's attention decodes like torch_native; STANDALONE speculative
decoding (EAGLEWorkerV2, topk 1) gives plain decoding's greedy tokens, alone and batched; and
with draft = target its speculation counters are exactly those of SGLang's algorithm re-done
in transformers, request by request (any error in the draft-side attention, the per-step
draft metadata or the KV bookkeeping changes which drafts are accepted).

Four servers (plain intel_amx, plain torch_native, STANDALONE with the 1-layer draft,
STANDALONE with draft = target), started once each, two at a time."""

from __future__ import annotations

import json
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from sglang_standalone_reference import standalone_greedy

from sloserve.sglang_cpu.cpu_server import CPUServerConfig, generate

# Server starts (60-100 s each, more on a busy machine) count against the first test using
# them; the project-wide 300 s limit is too short for that.
pytestmark = pytest.mark.timeout(1800)

MAX_NEW = 40
NUM_STEPS = 3


def _prompts(n: int, seed: int) -> list[list[int]]:
    """Random token-id prompts (4-60 tokens, no special ids) with distinct first tokens, so no
    two share a cached prefix."""
    g = torch.Generator().manual_seed(seed)
    firsts = (torch.randperm(2000, generator=g)[:n] + 10).tolist()
    out = []
    for first in firsts:
        length = int(torch.randint(4, 61, (1,), generator=g))
        out.append([first] + torch.randint(10, 2048, (length - 1,), generator=g).tolist())
    return out


def _sampling(max_new: int = MAX_NEW) -> dict:
    return {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}


def _one_at_a_time(cfg: CPUServerConfig, prompts: list[list[int]]) -> list[dict]:
    return [generate(cfg, {"input_ids": p, "sampling_params": _sampling()}) for p in prompts]


def _all_at_once(cfg: CPUServerConfig, prompts: list[list[int]]) -> list[dict]:
    """One request per prompt, all in flight together, so the scheduler batches them."""
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(
            lambda p: generate(cfg, {"input_ids": p, "sampling_params": _sampling()}), prompts))


def _server_info(cfg: CPUServerConfig) -> dict:
    with urllib.request.urlopen(cfg.url + "/get_server_info", timeout=30) as r:
        return json.loads(r.read())


def _ids(answers: list[dict]) -> list[list[int]]:
    return [a["output_ids"] for a in answers]


# ------------------------------------------------------------------------ (a) plain decoding


def test_intel_amx_on_the_shim_decodes_like_torch_native(servers):
    amx, native = servers.get("amx", "native")
    assert _server_info(amx)["attention_backend"] == "intel_amx", \
        "the sloserve plugin did not keep intel_amx"
    assert _server_info(native)["attention_backend"] == "torch_native"
    prompts = _prompts(8, seed=1)
    want = _ids(_one_at_a_time(native, prompts))
    assert _ids(_one_at_a_time(amx, prompts)) == want
    batch = _prompts(8, seed=2)
    assert _ids(_all_at_once(amx, batch)) == _ids(_all_at_once(native, batch))
    assert all(len(o) == MAX_NEW for o in want)
    servers.stop("native")  # not needed further; frees ~4 GB before the spec servers start


# ------------------------------------------------------------- (b) speculative = plain, greedy


SPEC_SERVERS = ("amx", "spec", "self_spec")  # started together by whichever test runs first


def test_standalone_one_at_a_time_matches_plain_decoding(servers):
    plain, spec, _ = servers.get(*SPEC_SERVERS)
    prompts = _prompts(16, seed=3)
    want = _ids(_one_at_a_time(plain, prompts))
    got = _one_at_a_time(spec, prompts)
    assert _ids(got) == want
    correct = sum(a["meta_info"]["spec_num_correct_drafts"] for a in got)
    proposed = sum(a["meta_info"]["spec_num_proposed_drafts"] for a in got)
    assert 0 < correct < proposed, "expected both accepted and rejected drafts"


def test_standalone_batched_matches_plain_decoding(servers):
    plain, spec, _ = servers.get(*SPEC_SERVERS)
    # 12 new prompts and 4 already served (their KV comes from the radix cache).
    prompts = _prompts(12, seed=4) + _prompts(16, seed=3)[:4]
    want = _ids(_all_at_once(plain, prompts))
    got = _all_at_once(spec, prompts)
    assert _ids(got) == want
    assert all(a["meta_info"]["spec_verify_ct"] > 0 for a in got)


# ------------------------------------- (c) draft = target: SGLang's own algorithm, exactly


@pytest.fixture(scope="module")
def hf_target(tiny_sglang_pair):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_sglang_pair[0], dtype=torch.float32).eval()


@pytest.mark.parametrize("batched", [False, True])
def test_draft_equal_target_counters_match_sglang_standalone_exactly(servers, hf_target,
                                                                      batched):
    _, _, self_spec = servers.get(*SPEC_SERVERS)
    prompts = _prompts(16 if not batched else 8, seed=5 if not batched else 6)
    answers = (_all_at_once if batched else _one_at_a_time)(self_spec, prompts)
    rates = []
    for prompt, answer in zip(prompts, answers):
        ref = standalone_greedy(hf_target, hf_target, prompt, MAX_NEW, NUM_STEPS)
        meta = answer["meta_info"]
        assert answer["output_ids"] == ref.output_ids
        assert (meta["spec_verify_ct"], meta["spec_num_correct_drafts"],
                meta["spec_num_proposed_drafts"]) == (
            ref.verify_ct, ref.num_correct_drafts, ref.num_proposed_drafts)
        assert meta["spec_accept_rate"] == pytest.approx(ref.accept_rate)
        rates.append(ref.accept_rate)
    print(f"\ndraft = target accept rates ({'batched' if batched else 'one at a time'}):",
          [round(r, 3) for r in rates])
