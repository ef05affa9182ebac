"""The real model preset through SGLang's own runtime (issue #30): `python -m sloserve.launch
--engine sglang --model smollm2` starts SGLang 0.5.23 on the converted SmolLM2-135M-Instruct
(resolved by sloserve before SGLang starts), and its greedy output equals transformers'
`generate` on the same directory, token for token, 8 prompts x 64 tokens in float32 (batched,
the longest answer alone too); its chat endpoint answers meaningfully with the model's template.

Speculation on the real model inside SGLang, with the shipped distilled draft (issue #31):
SPECSERVE (sloserve's worker, fixed:3 so that every step drafts; its draft's linears
multiply in bf16 where the CPU has bf16 matmul hardware) and SGLang's own STANDALONE
(3 steps, topk 1) give the same greedy tokens, alone and batched, and their drafts are
accepted; likewise SPECSERVE with the preset's default drafter, prompt lookup (fixed:3, and
the default specserve-slo with per-request verify lengths). The draft model under
specserve-slo runs on the tiny pair (test_specserve_server, test_specserve_plan). (SGLang's
NGRAM speculation cannot run on this CPU: it needs tree masks and sgl_kernel ops that
SGLang's CPU path lacks, ../shared/notes/sglang-on-cpu.md.)"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from sloserve_testing import SMOLLM2_NEW

from tests.sglang_runtime.launched import ServerQueue, post

pytestmark = pytest.mark.timeout(2400)

NEW = SMOLLM2_NEW
# prompts each server answers alone (all of them batched too): one (a batch of one, 64 steps
# of ~160 ms a server on a 2-core AVX2 machine) keeps CI's five servers here within minutes
ALONE = 1


def _alone(answers: list[list[int]]) -> list[int]:
    """The ALONE prompts answered alone: those with the longest reference answers."""
    return sorted(range(len(answers)), key=lambda i: -len(answers[i]))[:ALONE]


@pytest.fixture(scope="module")
def smollm2_dir() -> str:
    from sloserve.runtime.models.presets import resolve_dir

    return str(resolve_dir("smollm2"))  # converted here first, so SGLang's side loads the cache


@pytest.fixture(scope="module")
def reference(smollm2_reference) -> tuple[list[list[int]], list[list[int]]]:
    """(prompt ids, transformers' greedy answers up to <|im_end|> or NEW tokens)."""
    return smollm2_reference


def _greedy(server, ids: list[int]) -> list[int]:
    out = post(server.url, "/generate", {"input_ids": ids, "sampling_params": {
        "max_new_tokens": NEW, "temperature": 0}})
    return out["output_ids"]


def test_sglang_greedy_equals_transformers(servers, reference):
    """SGLang's plain decoding of the preset (`--spec-policy ar`, started while transformers
    computes the reference)."""
    server = servers("plain")
    prompts, answers = reference
    picked = _alone(answers)
    alone = [_greedy(server, prompts[i]) for i in picked]
    with ThreadPoolExecutor(len(prompts)) as pool:
        batched = list(pool.map(lambda p: _greedy(server, p), prompts))
    # SGLang's output_ids include the stop token, as transformers' do
    assert alone == [answers[i] for i in picked]
    assert batched == answers
    assert sum(map(len, answers)) >= 4 * NEW


def test_sglang_chat_answers_meaningfully(servers):
    server = servers("plain")
    out = post(server.url, "/v1/chat/completions", {
        "model": "smollm2", "max_tokens": 32, "temperature": 0,
        "messages": [{"role": "user", "content": "What is the capital of France?"}]})
    assert "Paris" in out["choices"][0]["message"]["content"]


def test_linear_weights_take_the_layout_of_this_cpu(servers, reference):
    """The plugin gives the float32 linear weights this CPU's layout (cpu_weights.py: oneDNN-
    packed or column-major, as SLOSERVE_CPU_WEIGHTS resolves here): SmolLM2's 30 layers' 4
    linears and its LM head (tied to the input embedding) once, so the greedy output above
    is the relaid model's."""
    from sloserve.sglang_ext.cpu_weights import layout_from_env

    servers("plain")
    log = servers.log("plain").read_text(errors="replace")
    fn = {"packed": "pack_linear_weights", "column": "relayout_linear_weights"}
    layout = layout_from_env()
    assert layout in fn  # auto resolves to one of them on a CPU
    assert f"sloserve plugin: 121 weights relaid out by {fn[layout]}" in log, log[-3000:]


SPEC_SYSTEMS = {
    # info: the worker's line on its draft's bf16 linears (the lossless test reads it)
    "specserve-fixed3": ["--drafter", "model", "--spec-policy", "fixed:3", "--k-max", "4",
                         "--log-level", "info"],
    # the preset's default drafter inside SGLang, as in the built-in engine: prompt lookup
    "ngram-fixed3": ["--spec-policy", "fixed:3", "--k-max", "4"],
    "ngram-slo-per-request": ["--spec-policy", "specserve-slo", "--spec-lengths",
                              "per-request", "--tpot-slo", "2s"],
    "standalone3": ["--spec-policy", "ar", "--speculative-algorithm", "STANDALONE",
                    "--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
                    "--speculative-num-draft-tokens", "4"],
}


@pytest.fixture(scope="module")
def servers(sglang_python, smollm2_dir, tmp_path_factory):
    """The plain server, then SPEC_SYSTEMS' in their order: each starts while the one before
    it is tested (a start is mostly one core's Python imports, a test's decoding the other
    core's), and is stopped when the next one is asked for."""
    from sloserve.runtime.models.presets import PRESETS

    draft = PRESETS["smollm2"].draft()
    assert draft is not None, "the distilled draft ships with the repository"
    # info: the plugin's count of relaid weights (test_linear_weights_take_the_layout_of_this_cpu)
    specs = {"plain": (["--model", "smollm2", "--spec-policy", "ar", "--log-level", "info"],
                       {})}
    for system, args in SPEC_SYSTEMS.items():
        if system.startswith("standalone"):
            args = [*args, "--speculative-draft-model-path", str(draft)]
        specs[system] = (["--model", "smollm2", *args], {})
    queue = ServerQueue(sglang_python, tmp_path_factory.mktemp("smollm2"), specs)
    queue.start("plain")
    yield queue
    queue.close()


@pytest.mark.parametrize("system", list(SPEC_SYSTEMS))
def test_speculation_with_the_distilled_draft_is_lossless(servers, reference, system):
    s = servers(system)
    prompts, answers = reference

    def run(ids: list[int]) -> dict:
        return post(s.url, "/generate", {"input_ids": ids, "sampling_params": {
            "max_new_tokens": NEW, "temperature": 0}})

    # alone: a batch of one (every prompt is checked batched, where the verify's rows differ
    # in length and acceptance)
    picked = _alone(answers)
    alone = [run(prompts[i]) for i in picked]
    with ThreadPoolExecutor(len(prompts)) as pool:
        batched = list(pool.map(run, prompts))
    assert [o["output_ids"] for o in alone] == [answers[i] for i in picked]
    assert [o["output_ids"] for o in batched] == answers
    if system == "specserve-fixed3":  # the draft model's GEMMs: bf16 where the CPU has them
        from sloserve.runtime.cpu_tuning import cpu_has_bf16_matmul

        log = servers.log(system).read_text(errors="replace")
        bf16 = "SPECSERVE: the draft's 16 linear layers multiply in bf16" in log
        assert bf16 == cpu_has_bf16_matmul(), log[-3000:]
        assert "draft forward: sloserve's lean decoder" in log, log[-3000:]
    metas = [o["meta_info"] for o in alone + batched]
    if "slo" not in system:  # (its plan may judge a step not worth drafting)
        assert sum(m.get("spec_verify_ct", 0) for m in metas) > 0, metas[0]
        assert sum(m.get("spec_num_correct_drafts", 0) for m in metas) > 0, metas[0]
