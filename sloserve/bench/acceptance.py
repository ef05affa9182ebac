"""Acceptance per Spec-Bench category at a fixed draft length: how many draft tokens each
verify accepts, for the n-gram drafter and for a draft model, on the same prompts in one run.

    python -m sloserve.bench.acceptance [--model smollm2] [--drafters ngram,model] [--k 4]
        [--per-category 10] [--new-tokens 128] [--split all|held-out] [--out ...json]

Prompts: the first turn of the Spec-Bench questions (../shared/data/prompts/
spec_bench_questions.jsonl; 13 categories), --per-category of each, through the model's chat
template; plus a "code" row from the coding-like prompts of the same file. Greedy, policy
fixed:K, each category's prompts in one batch. Per category: mean accepted draft tokens per
verify (verifies = steps in which the request verified >= 1 draft token), acceptance rate
(accepted / verified), and the share of decode steps that had a draft to verify (the n-gram
drafter proposes nothing where the context has no match). --split held-out uses only the
questions train_draft never trains on. Takes about 2-4 minutes per drafter per 100 prompts
on 2 cores. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import time

from sloserve.bench.common import machine_info, print_table, write_json
from sloserve.replay.specbench import SHARED_PROMPTS
from sloserve.runtime.config import EngineConfig
from sloserve.runtime.engine import Engine
from sloserve.runtime.request import SamplingParams
from sloserve.runtime.scheduler import SchedulerConfig


def category_prompts(per_category: int, split: str) -> dict[str, list[str]]:
    """Per category, the first turns of its Spec-Bench questions (the held-out split only
    with split "held-out"), plus "code": coding questions and others that ask for Python."""
    from sloserve.replay.specbench import load_spec_bench

    if not SHARED_PROMPTS.is_file():
        raise SystemExit(f"error: the Spec-Bench prompts are not at {SHARED_PROMPTS}")
    qs = [q for q in load_spec_bench(SHARED_PROMPTS) if split == "all" or q.held_out]
    out: dict[str, list[str]] = {}
    for q in qs:
        out.setdefault(q.category, []).append(q.turns[0])
    out["code"] = [q.turns[0] for q in qs
                   if q.category == "coding" or "python" in q.turns[0].lower()]
    return {c: texts[:per_category] for c, texts in sorted(out.items())}


def run(eng: Engine, texts: list[str], new_tokens: int) -> dict:
    tok = eng.tokenizer
    ids = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                   tokenize=True, return_dict=True)["input_ids"]
           if tok.chat_template else tok(t)["input_ids"] for t in texts]
    t0 = time.perf_counter()
    res = eng.generate(ids, SamplingParams(max_new_tokens=new_tokens, temperature=0.0))
    elapsed = time.perf_counter() - t0
    verifies = sum(r["spec"]["verify_steps"] for r in res)
    accepted = sum(r["spec"]["accepted"] for r in res)
    verified = sum(r["spec"]["verified"] for r in res)
    steps = sum(max(1, r["completion_tokens"] - r["spec"]["accepted"]) for r in res)
    return {"prompts": len(texts), "tokens": sum(r["completion_tokens"] for r in res),
            "verifies": verifies, "accepted": accepted, "verified": verified,
            "accepted_per_verify": accepted / max(verifies, 1),
            "acceptance_rate": accepted / max(verified, 1),
            "steps_with_draft": verifies / max(steps, 1), "seconds": elapsed}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 allow_abbrev=False)
    ap.add_argument("--model", default="smollm2", help="a model directory or preset")
    ap.add_argument("--draft-model-path", default=None,
                    help="draft for --drafters model (default: the preset's own)")
    ap.add_argument("--drafters", default="ngram,model",
                    help="comma-separated: ngram, model (model is skipped without a draft)")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--per-category", type=int, default=10)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--split", choices=("all", "held-out"), default="all")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--out", default="out/bench_acceptance.json")
    args = ap.parse_args(argv)
    from sloserve.runtime.models.presets import preset_has_draft

    drafters = [d for d in args.drafters.split(",")
                if d != "model" or args.draft_model_path or preset_has_draft(args.model)]
    cats = category_prompts(args.per_category, args.split)
    n = sum(len(v) for v in cats.values())
    print(f"acceptance at k={args.k} over {len(cats)} categories ({n} prompts), drafters "
          f"{drafters}: about {2 * len(drafters) * max(1, n // 100)}-"
          f"{4 * len(drafters) * max(1, n // 100)} minutes on 2 cores", flush=True)
    rows = []
    for d in drafters:
        eng = Engine(EngineConfig(model_path=args.model, draft_model_path=args.draft_model_path,
                                  drafter=d, spec_policy=f"fixed:{args.k}", k_max=args.k,
                                  dtype=args.dtype, kv_cache_tokens=32768,
                                  scheduler=SchedulerConfig(max_running_requests=16)))
        for c, texts in cats.items():
            r = run(eng, texts, args.new_tokens)
            rows.append({"drafter": d, "category": c, **r})
            print(f"{d} {c}: {r['accepted_per_verify']:.2f} accepted per verify", flush=True)
    print_table(["category"] + [f"{d} acc/verify" for d in drafters]
                + [f"{d} rate" for d in drafters] + [f"{d} steps w/ draft" for d in drafters],
                [[c] + [f"{_get(rows, d, c, 'accepted_per_verify'):.2f}" for d in drafters]
                 + [f"{_get(rows, d, c, 'acceptance_rate'):.2f}" for d in drafters]
                 + [f"{_get(rows, d, c, 'steps_with_draft'):.0%}" for d in drafters]
                 for c in cats])
    result = {"benchmark": "acceptance", "args": vars(args), "machine": machine_info(),
              "rows": rows}
    write_json(args.out, result)
    return result


def _get(rows: list[dict], drafter: str, cat: str, key: str) -> float:
    return next(r[key] for r in rows if r["drafter"] == drafter and r["category"] == cat)


if __name__ == "__main__":
    main()
