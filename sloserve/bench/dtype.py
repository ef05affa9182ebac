"""bf16 vs fp32 decoding on this CPU: the built-in engine's decode tokens/s at several batch
sizes for each dtype, side by side in one process (alternating runs, medians), with the
machine's floors beside each: the memory-bandwidth floor (every step reads all weights and
the batch's KV) and the compute floor (2 x parameters FLOPs per token), both from rates
measured here on the same thread count (a large copy; a large matmul per dtype).

    python -m sloserve.bench.dtype [--model smollm2] [--batches 1,8,32] [--new-tokens 64]
                                   [--repeats 3] [--out out/bench_dtype.json]

Takes about 5-10 minutes with the defaults on 2 cores (smollm2). Prints a table and writes
JSON. Decode time counts the steps after every request's prefill (time per step x batch).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from sloserve.bench.common import machine_info, print_table, write_json
from sloserve.replay.specbench import ordinary_prompts
from sloserve.runtime.config import EngineConfig
from sloserve.runtime.engine import Engine
from sloserve.runtime.request import SamplingParams
from sloserve.runtime.scheduler import SchedulerConfig

DTYPES = ("float32", "bfloat16")


def memory_bandwidth(mb: int = 512, repeats: int = 5) -> float:
    """Bytes/s of a large copy (read + write counted), median of `repeats`."""
    a = torch.ones(mb << 18)  # mb MB of float32
    b = torch.empty_like(a)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        b.copy_(a)
        times.append(time.perf_counter() - t)
    return 2 * a.numel() * 4 / statistics.median(times)


def matmul_flops(dtype: torch.dtype, n: int = 2048, repeats: int = 5) -> float:
    """FLOP/s of an n x n x n matmul in `dtype`, median of `repeats`."""
    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    a @ b
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t)
    return 2 * n**3 / statistics.median(times)


def decode_step_time(eng: Engine, prompts: list[list[int]], new_tokens: int) -> float:
    """Seconds per decode step once every request has its first token (prefill excluded)."""
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    reqs = [eng.add_request(p, params) for p in prompts]
    while any(len(r.output_ids) == 0 for r in reqs):
        eng.step()
    steps, t = 0, time.perf_counter()
    while eng.has_work:
        eng.step()
        steps += 1
    return (time.perf_counter() - t) / max(steps, 1)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 allow_abbrev=False)
    ap.add_argument("--model", default="smollm2", help="a model directory or preset")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--out", default="out/bench_dtype.json")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    batches = [int(x) for x in args.batches.split(",")]
    print(f"bf16 vs fp32 decode of {args.model}, batches {batches}, {args.repeats} repeats: "
          "about 5-10 minutes on 2 cores", flush=True)
    engines = {dt: Engine(EngineConfig(
        model_path=args.model, drafter="none", spec_policy="ar", dtype=dt,
        kv_cache_tokens=max(batches) * (args.prompt_tokens + args.new_tokens + 32),
        num_threads=args.threads,
        scheduler=SchedulerConfig(max_running_requests=max(batches), max_step_tokens=8192)))
        for dt in DTYPES}
    tok = engines["float32"].tokenizer
    texts = ordinary_prompts(max(batches))
    prompts = [(tok.apply_chat_template([{"role": "user", "content": t}],
                                        add_generation_prompt=True, tokenize=True,
                                        return_dict=True)["input_ids"]
                if tok.chat_template else tok(t)["input_ids"])[:args.prompt_tokens]
               for t in texts]
    cfg = engines["float32"].parts.target.cfg
    params = sum(p.numel() for p in engines["float32"].parts.target.model.parameters())
    bw = memory_bandwidth()
    flops = {dt: matmul_flops(getattr(torch, dt)) for dt in DTYPES}
    print(f"machine: copy {bw / 1e9:.1f} GB/s; matmul fp32 {flops['float32'] / 1e9:.0f}, "
          f"bf16 {flops['bfloat16'] / 1e9:.0f} GFLOP/s ({torch.get_num_threads()} threads)",
          flush=True)
    for eng in engines.values():  # warm-up (kernels, allocator)
        decode_step_time(eng, prompts[:2], 4)
    rows = []
    for b in batches:
        times: dict[str, list[float]] = {dt: [] for dt in DTYPES}
        for _ in range(args.repeats):
            for dt in DTYPES:  # alternate so machine noise hits both alike
                times[dt].append(decode_step_time(engines[dt], prompts[:b], args.new_tokens))
        ctx = sum(len(p) for p in prompts[:b]) + b * args.new_tokens // 2  # mean KV per step
        for dt in DTYPES:
            size = 4 if dt == "float32" else 2
            kv_bytes = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * size * ctx
            bw_floor = (params * size + kv_bytes) / bw
            compute_floor = 2 * params * b / flops[dt]
            step = statistics.median(times[dt])
            rows.append({"batch": b, "dtype": dt, "step_s": step, "tok_s": b / step,
                         "bandwidth_floor_s": bw_floor, "compute_floor_s": compute_floor,
                         "ceiling_tok_s": b / max(bw_floor, compute_floor),
                         "of_ceiling": max(bw_floor, compute_floor) / step,
                         "step_times_s": times[dt]})
        print(f"batch {b} done", flush=True)
    by = {(r["batch"], r["dtype"]): r for r in rows}
    print_table(
        ["batch", "dtype", "decode tok/s", "step ms", "bw floor ms", "compute floor ms",
         "of ceiling", "bf16/fp32"],
        [[r["batch"], r["dtype"], f"{r['tok_s']:.1f}", f"{r['step_s'] * 1e3:.1f}",
          f"{r['bandwidth_floor_s'] * 1e3:.2f}", f"{r['compute_floor_s'] * 1e3:.2f}",
          f"{r['of_ceiling']:.0%}",
          f"{by[(r['batch'], 'bfloat16')]['tok_s'] / by[(r['batch'], 'float32')]['tok_s']:.2f}x"
          if r["dtype"] == "bfloat16" else ""] for r in rows])
    result = {"benchmark": "dtype", "args": vars(args), "machine": machine_info(),
              "memory_bandwidth_Bps": bw, "matmul_flops": flops, "parameters": params,
              "rows": rows}
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
