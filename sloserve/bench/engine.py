"""Plain decoding throughput of the built-in target: sloserve's engine vs transformers' generate,
side by side in one process, alternating runs, medians reported.

    python -m sloserve.bench.engine [--batches 1,8,32] [--new-tokens 128] [--repeats 3]

Two workloads per batch size: "equal" (every prompt --prompt-len tokens, every request
--new-tokens) and "mixed" (prompt lengths uniform in [16, 4 * prompt-len], output lengths
uniform in [new-tokens / 4, new-tokens], seeded). transformers' generate pads the prompts
(left) and decodes max(output) tokens for every row; tokens/s counts only the requested
tokens on both sides.

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


def workload(batch: int, prompt_len: int, new_tokens: int, vocab: int, mixed: bool):
    """(prompts, output lengths) for one batch, deterministic."""
    g = torch.Generator().manual_seed(batch)
    if not mixed:
        return torch.randint(10, vocab, (batch, prompt_len), generator=g).tolist(), [new_tokens] * batch
    lens = torch.randint(16, 4 * prompt_len + 1, (batch,), generator=g).tolist()
    outs = torch.randint(max(1, new_tokens // 4), new_tokens + 1, (batch,), generator=g).tolist()
    return [torch.randint(10, vocab, (n,), generator=g).tolist() for n in lens], outs


def run_sloserve(eng: Engine, prompts, outs: list[int]) -> float:
    params = [SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True) for n in outs]
    t = time.perf_counter()
    res = eng.generate(prompts, params)
    dt = time.perf_counter() - t
    assert [o["completion_tokens"] for o in res] == outs
    return dt


def run_hf(model, prompts, outs: list[int]) -> float:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])  # left padding
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        t = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=max(outs),
                             do_sample=False, pad_token_id=0)
        dt = time.perf_counter() - t
    assert out.shape[1] == width + max(outs)
    return dt


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False)
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
    for mixed in (False, True):
        for b in [int(x) for x in args.batches.split(",")]:
            prompts, outs = workload(b, args.prompt_len, args.new_tokens, vocab, mixed)
            run_sloserve(eng, prompts[:1], [4])  # warm-up both
            run_hf(hf, prompts[:1], [4])
            ours, theirs = [], []
            for _ in range(args.repeats):  # alternate so machine noise hits both alike
                ours.append(run_sloserve(eng, prompts, outs))
                theirs.append(run_hf(hf, prompts, outs))
            n = sum(outs)
            o, h = n / statistics.median(ours), n / statistics.median(theirs)
            rows.append({"workload": "mixed" if mixed else "equal", "batch": b,
                         "sloserve_tok_s": o, "transformers_tok_s": h, "speedup": o / h,
                         "sloserve_s": ours, "transformers_s": theirs})
    print_table(
        ["workload", "batch", "sloserve tok/s", "transformers tok/s", "speedup"],
        [[r["workload"], r["batch"], f"{r['sloserve_tok_s']:.1f}", f"{r['transformers_tok_s']:.1f}",
          f"{r['speedup']:.2f}x"] for r in rows],
    )
    result = {"benchmark": "engine", "args": vars(args), "machine": machine_info(), "rows": rows}
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
