"""Plain decoding throughput of the built-in target: sloserve's engine vs transformers' generate,
side by side in one process, alternating runs, medians reported.

    python -m sloserve.bench.engine [--batches 1,8,32] [--new-tokens 128] [--repeats 3]

Prints a table and writes JSON (default out/bench_engine.json).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from sloserve.bench.common import machine_info, print_table, write_json
from sloserve.runtime.config import EngineConfig
from sloserve.runtime.engine import Engine
from sloserve.runtime.request import SamplingParams
from sloserve.runtime.scheduler import SchedulerConfig


def _prompts(batch: int, length: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(batch)
    return torch.randint(10, vocab, (batch, length), generator=g).tolist()


def run_sloserve(eng: Engine, prompts, new_tokens: int) -> float:
    sp = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    t = time.perf_counter()
    out = eng.generate(prompts, sp)
    dt = time.perf_counter() - t
    assert all(o["completion_tokens"] == new_tokens for o in out)
    return dt


def run_hf(model, prompts, new_tokens: int) -> float:
    ids = torch.tensor(prompts)
    with torch.inference_mode():
        t = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=0)
        dt = time.perf_counter() - t
    assert out.shape[1] == ids.shape[1] + new_tokens
    return dt


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="out/bench_engine.json")
    args = ap.parse_args(argv)
    from transformers import AutoModelForCausalLM

    eng = Engine(EngineConfig(spec_policy="ar", drafter="none",
                              scheduler=SchedulerConfig(max_running_requests=64, max_step_tokens=4096)))
    hf = AutoModelForCausalLM.from_pretrained(eng.parts.target_path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    vocab = eng.parts.target.cfg.vocab_size
    rows = []
    for b in [int(x) for x in args.batches.split(",")]:
        prompts = _prompts(b, args.prompt_len, vocab)
        run_sloserve(eng, prompts[:1], 4)  # warm-up both
        run_hf(hf, prompts[:1], 4)
        ours, theirs = [], []
        for _ in range(args.repeats):  # alternate so machine noise hits both alike
            ours.append(run_sloserve(eng, prompts, args.new_tokens))
            theirs.append(run_hf(hf, prompts, args.new_tokens))
        n = b * args.new_tokens
        o, h = n / statistics.median(ours), n / statistics.median(theirs)
        rows.append({"batch": b, "sloserve_tok_s": o, "transformers_tok_s": h, "speedup": o / h,
                     "sloserve_s": ours, "transformers_s": theirs})
    print_table(
        ["batch", "sloserve tok/s", "transformers tok/s", "speedup"],
        [[r["batch"], f"{r['sloserve_tok_s']:.1f}", f"{r['transformers_tok_s']:.1f}",
          f"{r['speedup']:.2f}x"] for r in rows],
    )
    result = {"benchmark": "engine", "args": vars(args), "machine": machine_info(), "rows": rows}
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
